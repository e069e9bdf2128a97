"""The job's directory a worker finds in ``$ELASTIC_JOB_DIR``: the same across restarts.

A plain torchrun script keeps its own checkpoint (torchvision's ``checkpoint.pth``); after
a restart it must find it again. The agent gives every worker ``ELASTIC_JOB_DIR``: the
agent's own ``$ELASTIC_JOB_DIR`` when set (used as it is), else
``$ELASTIC_JOB_ROOT/<run-id>`` (``ELASTIC_JOB_ROOT`` defaults to ``elastic-jobs`` in the
agent's working directory), created before the worker starts. The run id is the same on
every node and every restart of the job, so the directory is too; for several machines
put the root on storage every node sees. The recipe: docs/from-the-tutorial.md.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from elastic import env

logger = logging.getLogger(__name__)

DEFAULT_ROOT = "elastic-jobs"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def job_dir(run_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """The job's directory (absolute, not created) for ``run_id`` under ``environ``."""
    environ = os.environ if environ is None else environ
    given = environ.get(env.JOB_DIR, "").strip()
    if given:
        return Path(given).absolute()
    root = Path(environ.get(env.JOB_ROOT, "").strip() or DEFAULT_ROOT)
    name = _UNSAFE.sub("_", run_id).strip(".") or "job"
    return root.absolute() / name


def ensure(run_id: str, environ: Mapping[str, str] | None = None) -> Path:
    """:func:`job_dir`, created (with its parents) if missing. A directory the agent cannot
    create (a read-only working directory) is only logged: the workers start all the same,
    and a script that writes there gets the error itself."""
    path = job_dir(run_id, environ)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        logger.warning(
            "Cannot create the job directory %s (%s); set %s to a writable directory.",
            path,
            exc,
            env.JOB_ROOT,
        )
    return path
