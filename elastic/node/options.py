"""The node's options: one typed model that the agent and its workers read.

Each option has one name (``straggler.ratio``) and four ways to set it, last wins:

1. its default (the model below);
2. ``$ELASTIC_<KEY>`` (``ELASTIC_STRAGGLER_RATIO=2``): the key upper-cased, dots as ``_``;
3. ``elastic-agent --options-file FILE``: YAML, ``straggler: {ratio: 2}``;
4. ``--rdzv-conf straggler.ratio=2`` on ``elastic-agent``;
5. the ``elastic-agent`` flag ``--straggler-ratio 2`` (on/off options:
   ``--straggler-drop`` / ``--no-straggler-drop``).

The agent hands the result to its workers through the same ``$ELASTIC_<KEY>`` variables;
a worker started without an agent reads them too, and :class:`elastic.Run` takes the
worker's own groups (``straggler``, ``hang``) as keyword arguments.

The packed spellings of earlier releases (``ELASTIC_STRAGGLER=X,K``, ``ELASTIC_HANG=on`` or
``FLOOR_S,MULTIPLE``, ``ELASTIC_PROBATION=off`` or ``FIRST_S,CAP_S,MAX_FAILURES``) still
work for this release, with a warning that names the new spelling.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from elastic import env
from elastic.errors import ConfigError

logger = logging.getLogger(__name__)


def _on_off(value: Any) -> Any:
    """``1/on/true/yes`` and ``0/off/false/no`` (any case) for an on/off option."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in env.ON:
            return True
        if text in env.OFF:
            return False
        raise ValueError("accepted: on or off (1/0, true/false, yes/no)")
    return value


OnOff = Annotated[bool, BeforeValidator(_on_off)]


class _Group(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class StragglerOptions(_Group):
    """Straggler detection (always on) and the policy that drops a slow node."""

    drop: OnOff = Field(
        False, description="drop a node detected as a straggler; off: detection and events only"
    )
    ratio: float = Field(2.0, gt=1, le=1000, description="slow: slower than this x the median")
    steps: int = Field(5, ge=1, le=1_000_000, description="for this many consecutive steps")
    min_slow_s: float = Field(
        10.0, ge=0, le=1e7, description="and for at least this many s of its compute time"
    )
    min_nodes: int = Field(
        1, ge=1, le=1_000_000, description="never drop below this many nodes (agent: --nnodes MIN)"
    )
    window_s: float = Field(60.0, gt=0, le=1e7, description="at most one drop per this many s")


class HangOptions(_Group):
    """The stuck-step check: a rank whose step runs past the bound exits."""

    enabled: OnOff = Field(False, description="exit a rank whose step runs past the bound")
    floor_s: float = Field(60.0, gt=0, le=1e7, description="the bound is at least this many s")
    multiple: float = Field(10.0, gt=0, le=1e6, description="bound: this x the median step time")


class ProbationOptions(_Group):
    """What a node the straggler policy dropped does: health checks, then it rejoins."""

    enabled: OnOff = Field(True, description="sit out and rejoin; off: a dropped node leaves")
    first_s: float = Field(5.0, gt=0, le=1e7, description="first health check after this many s")
    cap_s: float = Field(60.0, gt=0, le=1e7, description="the longest back-off between checks")
    max_failures: int = Field(5, ge=1, le=1_000_000, description="failed checks before it leaves")
    probe: str = Field("", description="a health-check command; empty: the built-in probe")


class SnapshotOptions(_Group):
    """In-memory snapshots a replacement worker resumes from."""

    every: str = Field(
        "", description="steps between snapshots: N, auto or 0; empty: auto under elastic-agent"
    )
    background: OnOff = Field(True, description="copy snapshots in a background thread")


class NodeOptions(_Group):
    """Every option of a node (agent and workers), with its one default."""

    straggler: StragglerOptions = Field(StragglerOptions(), description="straggler policy")
    hang: HangOptions = Field(HangOptions(), description="stuck-step check")
    probation: ProbationOptions = Field(ProbationOptions(), description="dropped-node probation")
    snapshot: SnapshotOptions = Field(SnapshotOptions(), description="memory snapshots")
    warm_start: OnOff = Field(True, description="fork workers from a server that imported torch")
    in_place: OnOff = Field(True, description="re-form running workers in place on a change")
    tutorial_check: OnOff = Field(True, description="stop a worker that calls mp.spawn, clearly")
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="serve Prometheus metrics on this port (0: any free)"
    )


class Option(BaseModel):
    """One option as the reference table shows it."""

    key: str  # straggler.ratio
    flag: str  # --straggler-ratio
    env: str  # ELASTIC_STRAGGLER_RATIO
    default: Any
    description: str
    on_off: bool


def _walk(model: type[BaseModel], prefix: str = "") -> Iterator[Option]:
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            yield from _walk(kind, f"{key}.")
            continue
        yield Option(
            key=key,
            flag="--" + key.replace(".", "-").replace("_", "-"),
            env=env.option(key),
            default=info.default,
            description=info.description or "",
            on_off=kind is bool,
        )


OPTIONS: tuple[Option, ...] = tuple(_walk(NodeOptions))
KEYS = frozenset(o.key for o in OPTIONS)
ENV_NAMES = tuple(o.env for o in OPTIONS)
BY_KEY = {o.key: o for o in OPTIONS}

# -- the packed spellings of earlier releases ------------------------------------------------

_LEGACY = {
    env.STRAGGLER: ("straggler", ("drop", "ratio", "steps")),
    env.HANG: ("hang", ("enabled", "floor_s", "multiple")),
    env.PROBATION: ("probation", ("enabled", "first_s", "cap_s", "max_failures")),
}
_warned: set[str] = set()


def _legacy(name: str, raw: str) -> dict[str, str]:
    """``ELASTIC_STRAGGLER=2,5`` and friends as the new keys, with a warning (once)."""
    group, keys = _LEGACY[name]
    text = raw.strip().lower()
    if text in env.OFF or text == "":
        values = {keys[0]: "off"}
    elif text in env.ON and group != "straggler":
        values = {keys[0]: "on"}
    else:
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != len(keys) - 1:
            form = ",".join(k.upper() for k in keys[1:])
            raise ConfigError(
                f"${name}={raw!r} is not '{form}', 'on' or 'off'; better, set "
                + " and ".join(f"${env.option(f'{group}.{k}')}" for k in keys)
                + "."
            )
        values = {keys[0]: "on", **dict(zip(keys[1:], parts, strict=True))}
    new = {f"{group}.{k}": v for k, v in values.items()}
    if name not in _warned:
        _warned.add(name)
        spelled = " ".join(f"{env.option(k)}={v}" for k, v in new.items())
        message = f"${name}={raw} is deprecated and goes in the next release; use {spelled}."
        warnings.warn(message, DeprecationWarning, stacklevel=3)
        logger.warning("%s", message)
    return new


# -- reading --------------------------------------------------------------------------------


def from_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The options set in the environment (old spellings first, so new ones win), by key."""
    environ = os.environ if environ is None else environ
    found: dict[str, str] = {}
    for name in _LEGACY:
        if name in environ:
            found.update(_legacy(name, environ[name]))
    found.update({o.key: environ[o.env] for o in OPTIONS if o.env in environ})
    return found


def from_file(path: str) -> dict[str, Any]:
    """The options in YAML file ``path``, by key: nested (``straggler: {ratio: 2}``) or
    dotted (``straggler.ratio: 2``).

    Raises:
        ConfigError: the file cannot be read, is not YAML, or is not a mapping.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            data = yaml.safe_load(file)
    except OSError as exc:
        raise ConfigError(
            f"Cannot read the options file {path} ({exc.strerror}); fix --options-file."
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"The options file {path} is not valid YAML ({exc}); fix --options-file."
        ) from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"The options file {path} holds a {type(data).__name__}; accepted: a mapping of "
            "options, such as 'straggler: {drop: on, ratio: 2}'."
        )
    return _flatten(data)


def _flatten(data: Mapping[Any, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def build(*layers: Mapping[str, Any]) -> NodeOptions:
    """The model from flat ``key: value`` layers (later wins) over the defaults.

    Raises:
        ConfigError: an unknown key, or a value the option does not accept, in one sentence.
    """
    tree: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key not in KEYS:
                raise ConfigError(
                    f"Unknown option '{key}'; the options are {', '.join(sorted(KEYS))} "
                    "(see 'elastic-agent --help')."
                )
            *groups, leaf = key.split(".")
            node = tree
            for group in groups:
                node = node.setdefault(group, {})
            node[leaf] = value
    try:
        made = NodeOptions.model_validate(tree)
    except ValidationError as exc:
        raise _sentence(exc, layers) from exc
    _check(made)
    return made


def load(
    environ: Mapping[str, str] | None = None, **overrides: Mapping[str, Any] | BaseModel | None
) -> NodeOptions:
    """The options from the environment, with the groups in ``overrides`` (``straggler=``,
    ``hang=``, as :class:`elastic.Run` takes them) over them."""
    flat: dict[str, Any] = {}
    for group, given in overrides.items():
        if given is None:
            continue
        values = given.model_dump() if isinstance(given, BaseModel) else dict(given)
        flat.update({f"{group}.{k}": v for k, v in values.items()})
    return build(from_env(environ), flat)


def to_env(options: NodeOptions) -> dict[str, str]:
    """Every option as the ``$ELASTIC_<KEY>`` a worker reads (None: left out)."""
    out: dict[str, str] = {}
    for option in OPTIONS:
        value = _get(options, option.key)
        if value is None or value == "":
            continue
        out[option.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


def _get(options: BaseModel, key: str) -> Any:
    value: Any = options
    for part in key.split("."):
        value = getattr(value, part)
    return value


def _check(made: NodeOptions) -> None:
    probation = made.probation
    if probation.cap_s < probation.first_s:
        raise ConfigError(
            f"The option probation.cap_s (--probation-cap-s or $ELASTIC_PROBATION_CAP_S) "
            f"does not accept {probation.cap_s:g}, below probation.first_s="
            f"{probation.first_s:g}; accepted: a cap at least the first wait."
        )
    every = made.snapshot.every.strip().lower()
    if every and every != "auto" and not (every.isdigit()):
        raise ConfigError(
            f"The option snapshot.every (--snapshot-every or $ELASTIC_SNAPSHOT_EVERY) does not "
            f"accept {made.snapshot.every!r}; accepted: a whole number of steps, auto, or 0 (off)."
        )


def _sentence(exc: ValidationError, layers: tuple[Mapping[str, Any], ...]) -> ConfigError:
    error = exc.errors()[0]
    key = ".".join(str(p) for p in error["loc"])
    option = BY_KEY.get(key)
    given = next((layer[key] for layer in reversed(layers) if key in layer), error.get("input"))
    accepted = str(error["msg"]).removeprefix("Value error, ")
    where = f" ({option.flag} or ${option.env})" if option else ""
    return ConfigError(
        f"The option {key}{where} does not accept {given!r}; {accepted[0].lower()}{accepted[1:]}."
    )


__all__ = [
    "BY_KEY",
    "ENV_NAMES",
    "KEYS",
    "OPTIONS",
    "HangOptions",
    "NodeOptions",
    "Option",
    "ProbationOptions",
    "SnapshotOptions",
    "StragglerOptions",
    "build",
    "from_env",
    "from_file",
    "load",
    "to_env",
]
