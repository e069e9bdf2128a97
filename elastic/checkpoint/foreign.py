"""DCP checkpoints read without a manager: another program's ``dcp.save``, or a step whole.

* :func:`init_from` starts a run from a directory that plain ``dcp.save`` wrote
  (torchtitan, a user's earlier runs, any DCP writer): it loads what the directory
  holds of the given state and names what it could not restore (a data cursor,
  RNG states: the caller starts those afresh). A model-only checkpoint (the model's
  keys at the top, as torchtitan's ``last_save_model_only`` writes them) fills the
  state's ``model`` entry;
* :func:`read_entries` reads whole top-level entries of one checkpoint (``model``,
  ``optim``) with no template, for ``elastic checkpoint export``.

Both read the directory's ``.metadata`` through an allowlist of DCP's classes
(:mod:`elastic.checkpoint.dcp_metadata`; only ``read_entries`` checks it against a commit
marker's record): another program's checkpoint runs no code here, but its values are
its own, so start only from a directory you trust. Non-tensor values load with
``weights_only=True``. The ranks of ``init_from`` agree through
:mod:`elastic.checkpoint.dcp_driver` (checked JSON, no pickles between them).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import ReadItem

from elastic.checkpoint import dcp_driver
from elastic.checkpoint.storage import (
    EmptyStateDictLoadPlanner,
    SafeLoadPlanner,
    flatten_state_dict,
    load_in_this_process,
    make_reader,
    store_loaded,
)
from elastic.errors import CheckpointError

logger = logging.getLogger(__name__)

MODEL = "model"
# Other names of a top-level entry in checkpoints that other programs wrote.
ALIASES: dict[str, tuple[str, ...]] = {"optim": ("optimizer",), "model": ("model_state_dict",)}


def init_from(url: str, state: dict[str, Any], group: dist.ProcessGroup | None = None) -> list[str]:
    """Load into ``state`` (in place: tensors copied into, other values replaced) what the
    DCP checkpoint at ``url`` holds of it, on every rank of ``group``; whatever world
    size wrote it.

    Each top-level entry of ``state`` loads from the same name in the checkpoint, else
    from an alias (:data:`ALIASES`: ``optim`` from torchtitan's ``optimizer``), and
    ``model`` else from the checkpoint's top-level keys (torchtitan's layout).

    Returns:
        The dotted names (DCP's flattened keys, e.g. ``train.consumed``) of the entries
        of ``state`` that the checkpoint does not hold, sorted; they keep their values.

    Raises:
        CheckpointError: ``url`` holds no readable DCP checkpoint, or none of ``state``,
            or a stored entry does not fit the state (another shape).
    """
    stored = _stored_keys(url)
    parts, missing = _plan(state, stored)
    if not parts:
        raise CheckpointError(
            f"The checkpoint {url} holds none of the state to start from (it stores "
            f"{_sample(stored)}); check checkpoint.init_from."
        )
    for part in parts:
        _load(url, part, group)
    if missing:
        logger.info("Started from %s; not restored: %s.", url, ", ".join(missing))
    return missing


def _stored_keys(url: str) -> set[str]:
    try:
        metadata = make_reader(url).read_metadata()
    except (OSError, EOFError, ValueError, AttributeError, ImportError) as exc:
        raise CheckpointError(
            f"{url} holds no readable DCP checkpoint ({type(exc).__name__}: {exc}); point "
            "checkpoint.init_from at the directory that holds .metadata."
        ) from exc
    return set(metadata.state_dict_metadata)


def _plan(state: dict[str, Any], stored: set[str]) -> tuple[list[dict[str, Any]], list[str]]:
    """The states to load one after another (each shares its values with ``state``) and
    the flattened names the checkpoint lacks."""
    parts: list[dict[str, Any]] = []
    missing: list[str] = []
    for key, value in state.items():
        for source, part in _sources(key, value):
            names = _flat_names(part)
            if names & stored:
                parts.append(part)
                missing += [_renamed(n, source, key) for n in sorted(names - stored)]
                break
        else:
            missing += sorted(_flat_names({key: value}))
    return parts, sorted(missing)


def _sources(key: str, value: Any) -> list[tuple[str, dict[str, Any]]]:
    """Where entry ``key`` may lie in a checkpoint, best first: (its name there, the state
    to load it as, sharing ``value``)."""
    sources = [(key, {key: value})] + [(alias, {alias: value}) for alias in ALIASES.get(key, ())]
    if key == MODEL and isinstance(value, dict):
        sources.append(("", value))  # torchtitan: the model's keys at the top level
    return sources


def _renamed(name: str, source: str, key: str) -> str:
    """A flattened name under ``source`` in the checkpoint, as named under ``key``."""
    return key + (name[len(source) :] if source else f".{name}")


def _flat_names(state: dict[str, Any]) -> set[str]:
    return set(flatten_state_dict(state)[0])


def _load(url: str, state: dict[str, Any], group: dist.ProcessGroup | None) -> None:
    try:
        dcp_driver.load(
            state,
            storage_reader=make_reader(url),
            planner=SafeLoadPlanner(allow_partial_load=True),
            process_group=group,
        )
    except (Exception, CheckpointException) as exc:  # DCP wraps each rank's error
        raise CheckpointError(
            f"Cannot start from the checkpoint {url}: {_first_line(exc)}."
        ) from exc


class _TemplateFreePlanner(EmptyStateDictLoadPlanner):
    """DCP's planner that builds the state from the metadata (as ``dcp_to_torch_save``
    does, with the same private loader),
    but non-tensor values load with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        store_loaded(self, read_item, obj)


def read_entries(
    url: str, keys: Sequence[str], expected_metadata: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Read the top-level entries ``keys`` of the checkpoint at ``url`` whole, in this
    process (no process group, no template); ``expected_metadata`` is the commit
    marker's record of ``.metadata``, checked before it is unpickled.

    Raises:
        CheckpointError: the checkpoint cannot be read, or holds none of ``keys``.
    """
    state: dict[str, Any] = {}  # filled in place by the planner (dcp.load would copy it)
    try:
        load_in_this_process(
            state,
            storage_reader=make_reader(url, expected_metadata),
            planner=_TemplateFreePlanner(keys=set(keys)),
        )
    except (Exception, CheckpointException) as exc:  # DCP wraps the reader's error
        raise CheckpointError(f"Cannot read the checkpoint {url}: {_first_line(exc)}.") from exc
    if not state:
        raise CheckpointError(f"The checkpoint {url} holds none of {', '.join(keys)}.")
    return state


def _sample(names: set[str], count: int = 3) -> str:
    shown = sorted(names)[:count]
    more = f" and {len(names) - count} more" if len(names) > count else ""
    return (", ".join(shown) + more) if shown else "nothing"


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException) and exc.failures:
        _, (inner, _) = sorted(exc.failures.items())[0]
        exc = inner
    return f"{type(exc).__name__}: {exc}".splitlines()[0].rstrip(".")


__all__ = ["ALIASES", "MODEL", "init_from", "read_entries"]
