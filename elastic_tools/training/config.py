"""Training configuration: pydantic models, YAML loading, overrides.

A config is one YAML file with the sections ``job``, ``model``, ``data``,
``optimizer``, ``checkpoint`` and ``distributed``. Values are layered, last wins:

1. the YAML file;
2. environment variables ``ELASTIC_<SECTION>__<KEY>=value`` (e.g.
   ``ELASTIC_JOB__MAX_STEPS=100``);
3. command-line overrides ``section.key=value``.

Override values are parsed as YAML scalars, so ``true``, ``3`` and ``0.1`` get
their natural types. Any problem is raised as one :class:`ConfigError` whose
message names the file, the field, the bad value and what is allowed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from elastic import env, runid
from elastic.checkpoint.config import BoundedModel, CheckpointConfig, validate_url
from elastic.errors import ConfigError

_SECTION_ENV = re.compile(rf"^{env.CONFIG_PREFIX}([A-Z0-9_]+?)__([A-Z0-9_]+)$")
TINY_MODELS = ("tiny_cnn",)


class _Section(BoundedModel):
    """A section of the worker's config (unknown fields, inf/nan and numbers beyond int64
    refused: :class:`~elastic.checkpoint.config.BoundedModel`)."""


class JobConfig(_Section):
    """What run this is and how long it lasts."""

    run_id: str = Field(
        "default",
        min_length=1,
        max_length=runid.MAX_LENGTH,
        pattern=r"^[A-Za-z0-9_.\-]+$",
        description="checkpoint run id; unset or 'default' under an agent: the rendezvous id",
    )
    max_steps: int | None = Field(200, ge=1)
    max_epochs: int | None = Field(None, ge=1)
    stop_at: int | None = Field(
        None, ge=1, description="stop (with a checkpoint) at this step; the schedule is unchanged"
    )
    seed: int = 0
    log_every: int = Field(10, ge=1)
    threads: int = Field(1, ge=0, description="torch.set_num_threads; 0 keeps torch's default")
    deterministic: bool = True
    progress_bar: bool = True
    sample_ledger: bool = Field(False, description="log every rank's sample indices per step")
    min_step_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="pace steps to at least this long (slow motion for demos/tests)",
    )

    @field_validator("run_id")
    @classmethod
    def _names_one_directory(cls, run_id: str) -> str:
        if run_id in (".", ".."):
            raise ValueError(
                "a run id names the checkpoint directory, so it must not be '.' or '..'; "
                "use letters, digits, '.', '_' and '-'"
            )
        return run_id

    @model_validator(mode="after")
    def _one_limit(self) -> JobConfig:
        if self.max_steps is None and self.max_epochs is None:
            raise ValueError(
                "set job.max_steps or job.max_epochs (or both; the first reached wins)"
            )
        return self


class ModelConfig(_Section):
    """Which network to train."""

    name: str = "resnet18"
    num_classes: int = Field(10, ge=2)
    small_input: bool = Field(True, description="3x3 stem, no max-pool: for 32x32 images")

    @field_validator("name")
    @classmethod
    def _known_model(cls, name: str) -> str:
        import torchvision

        known = torchvision.models.list_models(module=torchvision.models)
        if name not in known and name not in TINY_MODELS:
            raise ValueError(
                f"unknown model; use a torchvision classification model such as "
                f"resnet18, resnet50, mobilenet_v3_small, or {', '.join(TINY_MODELS)}"
            )
        return name


class DataConfig(_Section):
    """Where samples come from and how they are batched."""

    source: Literal["synthetic", "cifar10", "imagefolder"] = "synthetic"
    path: str | None = Field(None, description="local path or fsspec URL (cifar10, imagefolder)")
    num_samples: int = Field(4096, ge=1, description="synthetic dataset size")
    image_size: int = Field(32, ge=8, le=512)
    noise: float = Field(0.6, ge=0.0, description="synthetic per-sample noise level")
    global_batch_size: int = Field(128, ge=1)
    micro_batch_size: int = Field(16, ge=1)

    @model_validator(mode="after")
    def _batches(self) -> DataConfig:
        if self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must not exceed "
                f"global_batch_size ({self.global_batch_size})"
            )
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"micro_batch_size ({self.micro_batch_size})"
            )
        if self.source != "synthetic" and not self.path:
            raise ValueError(f"data.path is required when data.source is {self.source!r}")
        return self


class OptimizerConfig(_Section):
    """Optimizer and learning-rate schedule."""

    name: Literal["sgd", "adamw"] = "sgd"
    lr: float = Field(0.1, gt=0.0)
    min_lr: float = Field(0.0, ge=0.0, description="floor of the cosine schedule")
    momentum: float = Field(0.9, ge=0.0, lt=1.0)
    weight_decay: float = Field(5e-4, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "step"] = "cosine"
    step_size: int = Field(1000, ge=1, description="steps between decays (schedule: step)")
    gamma: float = Field(0.1, gt=0.0, le=1.0)
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        "none", description="scale lr with world_size / reference_world_size"
    )
    reference_world_size: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _lr_range(self) -> OptimizerConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class DistributedConfig(_Section):
    """Process-group settings."""

    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(300.0, gt=0.0, le=10_000_000)
    checkpoint_timeout_s: float = Field(600.0, gt=0.0, le=10_000_000)


class Config(_Section):
    """The whole training configuration."""

    job: JobConfig = JobConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    distributed: DistributedConfig = DistributedConfig()

    @model_validator(mode="after")
    def _warmup_fits(self) -> Config:
        steps = self.job.max_steps
        if steps is not None and self.optimizer.warmup_steps >= steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) must be below "
                f"job.max_steps ({steps})"
            )
        return self


DEFAULT_RUN_ID = "default"


def checkpoint_run_id(cfg: Config, environ: Mapping[str, str] | None = None) -> str:
    """The run id that names this job's checkpoint directory (the rule is
    :func:`elastic.runid.resolve`): ``job.run_id`` when it is set to anything but
    ``default``; else the rendezvous id under an agent; else ``job.run_id``."""
    chosen = cfg.job.run_id
    explicit = "run_id" in cfg.job.model_fields_set and chosen != DEFAULT_RUN_ID
    return runid.resolve(chosen if explicit else None, environ, default=chosen)


def parse_overrides(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Turn ``["job.max_steps=5", ...]`` into ``{"job": {"max_steps": 5}}``."""
    tree: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or not section or not field:
            raise ConfigError(
                f"The override {item!r} is malformed; write section.key=value, "
                "e.g. job.max_steps=100."
            )
        tree.setdefault(section, {})[field] = _scalar(raw)
    return tree


def env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """Collect ``ELASTIC_<SECTION>__<KEY>`` variables into an override tree."""
    tree: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        match = _SECTION_ENV.match(name)
        if match:
            section, field = match.group(1).lower(), match.group(2).lower()
            tree.setdefault(section, {})[field] = _scalar(raw)
    return tree


def load_config(
    path: str | os.PathLike[str] | None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Load, layer and validate a config.

    Args:
        path: the YAML file, or ``None`` for built-in defaults.
        overrides: ``section.key=value`` strings; they win over everything.
        environ: where to read ``ELASTIC_<SECTION>__<KEY>``; defaults to ``os.environ``.

    Raises:
        ConfigError: naming the file, the field, the bad value and what is allowed.
    """
    source = str(path) if path is not None else "<defaults>"
    tree = _read_yaml(path) if path is not None else {}
    for layer in (
        env_overrides(os.environ if environ is None else environ),
        parse_overrides(overrides),
    ):
        tree = _merge(tree, layer)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(source, exc)) from exc


def _read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(
            f"Cannot read config file {path}: {exc.strerror}; check the path."
        ) from exc
    except yaml.YAMLError as exc:
        detail = str(exc).replace("\n", " ")
        raise ConfigError(f"{path}: not valid YAML ({detail}); fix the syntax.") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections, not {type(data).__name__}."
        )
    return data


def _merge(base: dict[str, Any], layer: dict[str, dict[str, Any]]) -> dict[str, Any]:
    merged = dict(base)
    for section, fields in layer.items():
        current = merged.get(section)
        merged[section] = {**current, **fields} if isinstance(current, dict) else dict(fields)
    return merged


def _scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def _describe(source: str, exc: ValidationError) -> str:
    """Render pydantic's first error as one line: file, field, value, what is allowed."""
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "<top level>"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        section = ".".join(str(p) for p in first["loc"][:-1])
        allowed = _allowed_fields(section)
        return (
            f"{source}: unknown field {field!r}; allowed in "
            f"{section or 'the top level'}: {', '.join(allowed)}."
        )
    more = f" (and {exc.error_count() - 1} more problems)" if exc.error_count() > 1 else ""
    value = first.get("input")
    shown = f" = {value!r}" if not isinstance(value, dict) else ""
    return f"{source}: {field}{shown} is invalid: {message}.{more}"


def _allowed_fields(section: str) -> list[str]:
    model: type[BaseModel] = Config
    if section:
        annotation = Config.model_fields[section].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
    return sorted(model.model_fields)


__all__ = [
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "JobConfig",
    "ModelConfig",
    "OptimizerConfig",
    "checkpoint_run_id",
    "env_overrides",
    "load_config",
    "parse_overrides",
    "validate_url",
]
