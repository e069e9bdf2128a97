"""Exit codes, and the re-form protocol that the worker, the agent and the handler share.

A *re-form* is the group forming again after a change of membership that is not a failure: it
spends none of the job's restarts (docs/design.md, "In-place re-forms": one word, two paths).
This module is its restart path: the workers are stopped and started again in the new round;
in place (:mod:`elastic.worker`) they keep their processes.

1. **A planned leave.** SIGTERM reaches one node's agent. torch forwards it to that node's
   workers; ours finish the current step, save with their peers and exit :data:`OK`
   (:mod:`elastic_tools.training.worker`). Their peers see the group stop early and exit
   :data:`EXIT_CODE`. The leaving agent removes its node from the rendezvous at once
   (:meth:`elastic.rendezvous.contract.MembershipHandler.leave`).
2. **A changed round.** The surviving agents ask their handler for a
   :meth:`~elastic.rendezvous.contract.MembershipHandler.membership_change` every
   monitor tick: a joiner waiting, a peer gone (crash, cut link, left), or this node dropped.
3. **Restart without spending the budget.** A worker group whose every failure is
   :data:`EXIT_CODE` re-runs the rendezvous without counting a failure
   (:class:`elastic.agent.node.NodeAgent`). A warm (forked) worker stopped by a signal also exits
   :data:`EXIT_CODE` (:func:`elastic.agent.warm.run_worker`), since torch would otherwise wait for
   its return value.
4. **A lost peer.** Workers blocked in a collective with a vanished peer cannot hear a stop
   request: the agent gives them :data:`elastic.agent.node.LOST_PEER_GRACE_S`, then kills them.
5. **No checkpoint for a re-form.** Before an agent stops its workers to re-form (its node
   stays), it leaves a marker (:func:`marking`), the file ``reform`` in its private directory
   beside the node's snapshots (:mod:`elastic.node.nodelocal`: only this uid may enter it, so no
   other user can plant one, nor make the agent write through a symlink); a worker stopped
   while the marker exists writes its memory snapshot and skips the persisted save, unless a
   peer's stop was a real one (its node leaving, the job ending): the group agrees on that
   with the stop flag. A missing or unwritable marker means "persist", the safe side.
"""

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from elastic import env
from elastic.node import nodelocal

MARKER_DIR = nodelocal.DEFAULT_BASE  # beside the snapshots (elastic.worker.snapshot)
MARKER = "reform"


def marker(owner: int, directory: str = MARKER_DIR) -> Path | None:
    """The file that says: agent ``owner`` is stopping its workers to re-form (None: the
    agent has no private directory under ``directory``)."""
    folder = nodelocal.find(owner, directory)
    return folder / MARKER if folder is not None else None


@contextlib.contextmanager
def marking(owner: int, directory: str = MARKER_DIR) -> Iterator[None]:
    """Hold the re-form marker of agent ``owner`` while its workers stop (created exclusively,
    never through a symlink; if it cannot be, the workers persist)."""
    path: Path | None = None
    with contextlib.suppress(OSError):
        path = nodelocal.directory(owner, directory) / MARKER
        with contextlib.suppress(FileExistsError):  # left by a stop that was killed
            os.close(nodelocal.open_file(path, create=True))
    try:
        yield
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink()


def stopping_for_reform(directory: str = MARKER_DIR) -> bool:
    """Whether this worker's agent is stopping it to re-form (the node stays, and so do its
    memory snapshots); False without an agent that owns the snapshots, or when the marker
    is not a regular file of this uid in the agent's private directory."""
    owner = os.environ.get(env.SNAPSHOT_OWNER, "")
    path = marker(int(owner), directory) if owner.isdigit() else None
    try:
        st = os.lstat(path) if path is not None else None
    except OSError:
        return False
    return st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


OK = 0
FAILED = 1  # a runtime or checkpoint failure; also "etcd unreachable" for the CLIs
USAGE = 2  # bad input: a config file, a flag, an option value
# A worker that stopped because a *peer* asked the group to stop (a planned leave
# elsewhere). Its agent re-forms the group instead of counting a failure (EX_TEMPFAIL).
EXIT_CODE = 75
# A worker stuck inside a step ended itself (elastic.worker.hang): its node leaves its round at
# once, so that the others go on without it, and rejoins as a joiner (elastic.agent.node).
HUNG = 76

__all__ = ["EXIT_CODE", "FAILED", "OK", "USAGE", "marker", "marking", "stopping_for_reform"]
