"""Names of every environment variable the project reads or sets, in one place."""

from __future__ import annotations

import os

# torch elastic: opt out of the agent-hosted shared TCPStore (see elastic.rendezvous.registry).
TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Set by torch elastic for every worker.
RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
GROUP_RANK = "GROUP_RANK"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"
RUN_ID = "TORCHELASTIC_RUN_ID"

# Ours.
EVENT_LOG = "ELASTIC_EVENT_LOG"  # path of the JSON-lines event log; unset = no file
CONFIG_PREFIX = "ELASTIC_"  # ELASTIC_<SECTION>__<KEY>=value overrides a config field
ETCD_BIN = "ELASTIC_ETCD_BIN"  # etcd binary for the embedded server and the tests
FORK_SERVER_PID = "ELASTIC_FORK_SERVER_PID"  # set by the warm-start fork server for its workers
WARM_START = "ELASTIC_WARM_START"  # 0 = start each worker as a fresh process (elastic.agent.warm)
FENCE = "ELASTIC_FENCE"  # JSON FenceSpec the agent hands its workers (commit fencing)
SECRET_FILE = "ELASTIC_SECRET_FILE"  # per-job secret that signs checkpoint commit markers
ETCD_PASSWORD = "ELASTIC_ETCD_PASSWORD"  # etcd password; the agent removes it from its env
METRICS_PORT = "ELASTIC_METRICS_PORT"  # elastic-agent --metrics-port: serve Prometheus metrics
SNAPSHOT_EVERY = "ELASTIC_SNAPSHOT_EVERY"  # steps between memory snapshots: N, "auto" or 0 (off)
SNAPSHOT_OWNER = "ELASTIC_SNAPSHOT_OWNER"  # the agent pid whose node the snapshot files belong to
SNAPSHOT_BACKGROUND = "ELASTIC_SNAPSHOT_BACKGROUND"  # 1/0: copy snapshots in a background thread
CHANNEL = "ELASTIC_CHANNEL"  # path prefix of the agent <-> worker files for in-place re-forms
IN_PLACE = "ELASTIC_IN_PLACE"  # 0 = never re-form a running worker in place (see elastic.worker)
JOB_DIR = "ELASTIC_JOB_DIR"  # a worker's per-job directory, stable across restarts (agent.jobdir)
JOB_ROOT = "ELASTIC_JOB_ROOT"  # where the agent makes <run-id>/ for ELASTIC_JOB_DIR
TUTORIAL_CHECK = "ELASTIC_TUTORIAL_CHECK"  # 0 = workers may mp.spawn (agent.tutorial_check)
STRAGGLER_MIN_NODES = "ELASTIC_STRAGGLER_MIN_NODES"  # the agent's --nnodes MIN for the policy
PROBATION_PROBE = "ELASTIC_PROBATION_PROBE"  # a health-check command (else built in)
# Every option of elastic.node.options is ELASTIC_<KEY> (option(key)); the ones above are
# some of them. Packed spellings of earlier releases, read with a deprecation warning:
STRAGGLER = "ELASTIC_STRAGGLER"  # "X,K" -> ELASTIC_STRAGGLER_DROP/_RATIO/_STEPS
HANG = "ELASTIC_HANG"  # "on" or "FLOOR_S,MULTIPLE" -> ELASTIC_HANG_ENABLED/_FLOOR_S/_MULTIPLE
PROBATION = "ELASTIC_PROBATION"  # "off" or "FIRST_S,CAP_S,MAX_FAILURES" -> ELASTIC_PROBATION_*

OFF = ("0", "false", "no", "off")
ON = ("1", "true", "yes", "on")


def option(key: str) -> str:
    """The variable of option ``key`` (``straggler.ratio`` -> ``ELASTIC_STRAGGLER_RATIO``)."""
    return CONFIG_PREFIX + key.replace(".", "_").upper()


def flag(name: str, default: bool = True) -> bool:
    """An on/off environment flag: ``0``, ``false``, ``no`` or ``off`` (any case) is off;
    any other value is on; unset is ``default``. The one parse of every flag here."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in OFF
