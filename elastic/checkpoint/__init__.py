"""Sharded, resharding checkpoints through fsspec with commit markers.

Public surface:

* :class:`CheckpointManager`: async save (one in flight), commit, purge, resume;
* :func:`find_latest_complete`: the newest complete step of a run (``elastic status``);
* :func:`inspect_step`, :func:`list_steps`, :func:`step_url`: layout helpers;
* :func:`init_from`: start from a DCP checkpoint another program wrote (plain ``dcp.save``);
* :func:`validate_run_id`: refuses run ids that do not name one directory.
"""

from elastic.checkpoint.foreign import init_from
from elastic.checkpoint.layout import (
    COMMIT_MARKER,
    StepInfo,
    find_latest_complete,
    inspect_step,
    list_steps,
    step_url,
    validate_run_id,
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
    "init_from",
    "inspect_step",
    "list_steps",
    "step_url",
    "validate_run_id",
]
