"""Sharded, resharding checkpoints through fsspec with commit markers.

Public surface:

* :class:`CheckpointManager`: async save (one in flight), commit, purge, resume;
* :func:`find_latest_complete`: the newest complete step of a run (``elastic status``);
* :func:`inspect_step`, :func:`list_steps`, :func:`step_url`: layout helpers.
"""

from elastic.checkpoint.layout import (
    COMMIT_MARKER,
    StepInfo,
    find_latest_complete,
    inspect_step,
    list_steps,
    step_url,
)
from elastic.checkpoint.manager import CheckpointManager, CommitFence, SaveOutcome
from elastic.checkpoint.stager import Stager

__all__ = [
    "COMMIT_MARKER",
    "CheckpointManager",
    "CommitFence",
    "SaveOutcome",
    "Stager",
    "StepInfo",
    "find_latest_complete",
    "inspect_step",
    "list_steps",
    "step_url",
]
