"""The one rule for a job's run id: the name its snapshots and checkpoints live under.

1. The id the user chose (``elastic.Run(run_id=...)``, the config's ``job.run_id``).
2. Else, under an agent, the rendezvous id (``$TORCHELASTIC_RUN_ID``), so that two jobs
   never share a checkpoint directory by accident; but not the random UUID that
   ``torchrun --standalone`` makes up for every launch, which would never resume.
3. Else the default (``"local"``; the config's ``job.run_id`` default).

Every id must name one directory: letters, digits, ``.``, ``_`` and ``-`` from the
rendezvous; a chosen one is checked where it names the directory
(:func:`elastic.checkpoint.layout.validate_run_id`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from elastic import env
from elastic.errors import ConfigError

DEFAULT = "local"
# A run id names one directory (255 bytes on most filesystems); room for what tools add.
MAX_LENGTH = 200
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def resolve(
    chosen: str | None, environ: Mapping[str, str] | None = None, default: str = DEFAULT
) -> str:
    """The run id by the rule above (``chosen`` None or empty: not chosen)."""
    if chosen:
        return chosen
    rdzv = (os.environ if environ is None else environ).get(env.RUN_ID, "")
    if not rdzv or _UUID.match(rdzv.lower()):
        return default
    if rdzv in (".", "..") or not _NAME.match(rdzv) or len(rdzv) > MAX_LENGTH:
        raise ConfigError(
            f"The rendezvous id {rdzv!r} cannot name a checkpoint directory; choose a run id "
            f"(job.run_id, or Run(run_id=...)) of up to {MAX_LENGTH} letters, digits, '.', '_' "
            "and '-'."
        )
    return rdzv


__all__ = ["DEFAULT", "MAX_LENGTH", "resolve"]
