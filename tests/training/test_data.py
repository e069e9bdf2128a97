"""Datasets: synthetic determinism, CIFAR-10 pickles and ImageFolder from paths and URLs."""

from __future__ import annotations

import pickle
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from PIL import Image

from elastic.errors import ConfigError
from elastic_tools.training.config import DataConfig
from elastic_tools.training.data import SyntheticImages, build_dataset, collate


def test_synthetic_is_deterministic_and_class_conditional() -> None:
    a, b = SyntheticImages(64, 4, 16, seed=1), SyntheticImages(64, 4, 16, seed=1)
    xa, ya = collate(a, torch.arange(64))
    xb, yb = collate(b, torch.arange(64))
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == (64, 3, 16, 16) and set(ya.tolist()) == {0, 1, 2, 3}
    means = torch.stack([xa[ya == c].mean(0) for c in range(4)])
    assert torch.cdist(means.flatten(1), means.flatten(1)).fill_diagonal_(1e9).min() > 1.0
    assert not torch.equal(xa, collate(SyntheticImages(64, 4, 16, seed=2), torch.arange(64))[0])


def _write_cifar(fs: fsspec.AbstractFileSystem, root: str, per_batch: int = 4) -> None:
    rng = np.random.default_rng(0)
    fs.makedirs(root, exist_ok=True)
    for n in range(1, 6):
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": [int(x) for x in rng.integers(0, 10, per_batch)],
        }
        with fs.open(f"{root}/data_batch_{n}", "wb") as f:
            pickle.dump(batch, f)


@pytest.mark.parametrize("where", ["file", "memory"])
def test_cifar10_pickles_from_path_or_url(tmp_path: Path, where: str) -> None:
    url = str(tmp_path / "cifar") if where == "file" else f"memory://c-{uuid.uuid4().hex[:6]}"
    fs, root = fsspec.core.url_to_fs(url)
    _write_cifar(fs, root)
    dataset = build_dataset(
        DataConfig(
            source="cifar10", path=url, global_batch_size=4, micro_batch_size=2, image_size=16
        ),
        10,
        0,
    )
    images, labels = collate(dataset, torch.arange(20))
    assert len(dataset) == 20 and images.shape == (20, 3, 16, 16)
    assert labels.max() < 10


def test_imagefolder_classes_from_directories(tmp_path: Path) -> None:
    for cls, colour in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20, 20), colour).save(tmp_path / "imgs" / cls / f"{i}.png")
    dataset = build_dataset(
        DataConfig(
            source="imagefolder",
            path=str(tmp_path / "imgs"),
            image_size=8,
            global_batch_size=2,
            micro_batch_size=1,
        ),
        2,
        0,
    )
    images, labels = collate(dataset, torch.arange(6))
    assert dataset.classes == ["cat", "dog"]
    assert labels.tolist() == [0, 0, 0, 1, 1, 1] and images.shape == (6, 3, 8, 8)
    assert images[0, 0].mean() > images[0, 2].mean()


def test_missing_dataset_is_a_config_error(tmp_path: Path) -> None:
    cfg = DataConfig(source="imagefolder", path=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="cannot be read as imagefolder"):
        build_dataset(cfg, 2, 0)


class _Planted:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("planted code ran",))


def test_a_cifar_batch_that_builds_anything_but_arrays_is_refused(tmp_path: Path) -> None:
    fs, root = fsspec.core.url_to_fs(str(tmp_path / "cifar"))
    _write_cifar(fs, root)
    with fs.open(f"{root}/data_batch_3", "wb") as f:
        pickle.dump({b"data": _Planted(), b"labels": [1]}, f)
    cfg = DataConfig(
        source="cifar10", path=str(tmp_path / "cifar"), global_batch_size=4, micro_batch_size=2
    )
    with pytest.raises(ConfigError, match="is not part of a CIFAR-10 batch"):
        build_dataset(cfg, 10, 0)
