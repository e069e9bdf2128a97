"""Datasets: an offline learnable synthetic set, CIFAR-10 (pickle), ImageFolder.

Nothing is ever downloaded. CIFAR-10 and ImageFolder read from a local path or
any fsspec URL (``s3://bucket/cifar-10-batches-py``). Every dataset returns
``(image, label)`` with ``image`` a float tensor ``3 x S x S`` normalized to
roughly zero mean, unit variance; :func:`collate` fetches a batch by indices.

The synthetic set is class-conditional: each class has a smooth random colour
pattern (its prototype), and sample ``i`` is its class prototype under a random
contrast plus per-pixel noise, all drawn from a generator seeded by
``(seed, i)``. It is deterministic, needs no files, and a small CNN learns it
within a few dozen steps on CPU.
"""

from __future__ import annotations

import io
import logging
import pickle
from typing import Any

import fsspec
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from elastic.errors import ConfigError
from elastic_tools.training.config import DataConfig

logger = logging.getLogger(__name__)

_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")
_CIFAR_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(3, 1, 1)
_CIFAR_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(3, 1, 1)


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
    """Procedurally generated, class-conditional images; deterministic from ``seed``."""

    def __init__(
        self, num_samples: int, num_classes: int, image_size: int, seed: int, noise: float = 0.6
    ) -> None:
        self.num_samples = num_samples
        self.num_classes = num_classes
        self.image_size = image_size
        self.seed = seed
        self.noise = noise
        gen = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, 3, 4, 4, generator=gen)
        self.prototypes = F.interpolate(
            coarse, size=(image_size, image_size), mode="bilinear", align_corners=False
        )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        gen = torch.Generator().manual_seed(self.seed * 7_919 + index + 1)
        label = int(torch.randint(self.num_classes, (1,), generator=gen))
        contrast = 0.5 + torch.rand(1, generator=gen)
        noise = torch.randn(3, self.image_size, self.image_size, generator=gen)
        return self.prototypes[label] * contrast + self.noise * noise, label


class _CifarUnpickler(pickle.Unpickler):
    """CIFAR-10's python batches: dicts, lists, bytes and numpy arrays, nothing else."""

    _ALLOWED = {("_codecs", "encode"), ("numpy", "ndarray"), ("numpy", "dtype")} | {
        (f"numpy.{core}.{module}", name)
        for core in ("core", "_core")
        for module, name in (("multiarray", "_reconstruct"), ("numeric", "_frombuffer"))
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a CIFAR-10 batch")
        return super().find_class(module, name)


class Cifar10(Dataset[tuple[torch.Tensor, int]]):
    """CIFAR-10 training split from the python pickle batches (``data_batch_1..5``)."""

    def __init__(self, url: str, image_size: int = 32) -> None:
        fs, root = fsspec.core.url_to_fs(url)
        arrays: list[np.ndarray] = []
        labels: list[int] = []
        for n in range(1, 6):
            with fs.open(f"{root.rstrip('/')}/data_batch_{n}", "rb") as f:
                batch: dict[bytes, Any] = _CifarUnpickler(f, encoding="bytes").load()
            arrays.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            labels.extend(int(x) for x in batch[b"labels"])
        self.images = torch.from_numpy(np.concatenate(arrays))
        self.labels = labels
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        image = (self.images[index].float() / 255.0 - _CIFAR_MEAN) / _CIFAR_STD
        return _resize(image, self.image_size), self.labels[index]


class ImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """``root/<class>/<image>`` from a local path or an fsspec URL; classes sorted by name."""

    def __init__(self, url: str, image_size: int) -> None:
        self.fs, root = fsspec.core.url_to_fs(url)
        root = root.rstrip("/")
        files = sorted(p for p in self.fs.find(root) if p.lower().endswith(_IMAGE_EXTENSIONS))
        if not files:
            raise FileNotFoundError(f"no images under {url}")
        self.classes = sorted({p[len(root) + 1 :].split("/")[0] for p in files})
        index = {name: i for i, name in enumerate(self.classes)}
        self.samples = [(p, index[p[len(root) + 1 :].split("/")[0]]) for p in files]
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with self.fs.open(path, "rb") as f:
            image = Image.open(io.BytesIO(f.read())).convert("RGB")
        array = np.asarray(image.resize((self.image_size, self.image_size)), dtype=np.float32)
        tensor = torch.from_numpy(array).permute(2, 0, 1) / 255.0
        return (tensor - _CIFAR_MEAN) / _CIFAR_STD, label


def build_dataset(cfg: DataConfig, num_classes: int, seed: int) -> Dataset[Any]:
    """Build the configured dataset.

    Raises:
        ConfigError: the dataset path cannot be read or holds no usable data.
    """
    if cfg.source == "synthetic":
        return SyntheticImages(cfg.num_samples, num_classes, cfg.image_size, seed, cfg.noise)
    assert cfg.path is not None  # the config validator guarantees it
    try:
        if cfg.source == "cifar10":
            return Cifar10(cfg.path, cfg.image_size)
        return ImageFolder(cfg.path, cfg.image_size)
    except (OSError, ValueError, KeyError, pickle.UnpicklingError) as exc:
        raise ConfigError(
            f"data.path = {cfg.path!r} cannot be read as {cfg.source} ({exc}); "
            "point it at an existing local directory or fsspec URL."
        ) from exc


def collate(dataset: Dataset[Any], indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fetch samples ``indices`` and stack them into ``(images, labels)``."""
    samples = [dataset[int(i)] for i in indices]
    images = torch.stack([s[0] for s in samples])
    labels = torch.tensor([s[1] for s in samples], dtype=torch.long)
    return images, labels


def _resize(image: torch.Tensor, size: int) -> torch.Tensor:
    if image.shape[-1] == size:
        return image
    return F.interpolate(image[None], size=(size, size), mode="bilinear", align_corners=False)[0]


__all__ = ["Cifar10", "ImageFolder", "SyntheticImages", "build_dataset", "collate"]
