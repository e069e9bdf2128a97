"""The agent's side of in-place re-forms (:mod:`elastic.worker`): re-rank running workers.

When every local worker is a script on ``elastic.Run`` that registered on its channel, a
change of membership does not restart them: the agent runs the rendezvous and writes each
worker its rank in the new round (:meth:`InPlaceHost.reform_in_place`); a lost peer is
announced first (a pending assignment with ``abort``), so that a collective blocked on it
is released while the round forms. The worker's side reads the assignment and forms the
new group (:mod:`elastic.worker.member`).

What crosses the channel (one directory per agent, one channel per local worker,
:mod:`elastic.node.channel`): down, the assignments this class writes; up, each
worker's registration (it runs a round in place, or waits for a new one because its step
failed on a lost peer, or asks for one).

Every round number here is the round this node joined last, as its rendezvous returned
it (the fence of that round names it), never a later round the node has only seen.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerState
from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

from elastic import env, events
from elastic.agent import metrics
from elastic.node import channel
from elastic.node.channel import Assignment, Registration
from elastic.node.procs import alive
from elastic.rendezvous.contract import ChangeKind, MembershipChange, MembershipHandler
from elastic.rendezvous.fence import FenceSpec

logger = logging.getLogger(__name__)


def offered(handler: object) -> TypeGuard[MembershipHandler]:
    """Whether this agent offers in-place re-forms: ``$ELASTIC_IN_PLACE`` is on and the
    handler keeps each round's store for the next round's group."""
    return (
        env.flag(env.IN_PLACE)
        and isinstance(handler, MembershipHandler)
        and bool(handler.hosts_round_store)
    )


class InPlaceHost:
    """Writes this node's workers their assignments and reads their registrations.

    ``owner``: the agent's pid, whose private node-local directory holds the channels
    (``directory``: its base, for tests).
    """

    def __init__(
        self,
        handler: MembershipHandler,
        owner: int | None = None,
        directory: str = channel.DIRECTORY,
    ) -> None:
        self._handler = handler
        self._owner = os.getpid() if owner is None else owner
        self._directory = directory
        self._asked_round = -1  # the round in which a worker last asked for a new one
        self.left = False  # this node has left the rendezvous (SIGTERM or probation, in place)
        # The agent looks at its workers every tick (node.WAITING_TICK_S) while they train:
        # each look is a stat per worker, a file read only when the worker wrote anew.
        self._channels: dict[int, Path] = {}
        self._fence_seen: tuple[str, int] = ("", -1)
        self._worker_files: dict[int, str] = {}  # each worker's registration file
        self._regs: dict[str, tuple[tuple[int, int, int, int], Registration | None]] = {}
        self._reported: int | None = None  # the round last reported as run in place

    def channel_of(self, local_rank: int) -> Path:
        """The channel of local worker ``local_rank`` (its ``$ELASTIC_CHANNEL``); its
        private directory is made and verified once (each read verifies the file)."""
        found = self._channels.get(local_rank)
        if found is None:
            found = channel.prefix_for(self._owner, local_rank, self._directory)
            self._channels[local_rank] = found
        return found

    def joined_round(self) -> int:
        """The round this node joined last (-1 before its first): the one its fence names."""
        fence = self._handler.fence()
        if fence != self._fence_seen[0]:
            spec = FenceSpec.from_env({env.FENCE: fence})
            self._fence_seen = (fence, spec.round if spec is not None else -1)
        return self._fence_seen[1]

    def _registration(self, local_rank: int) -> Registration | None:
        """Worker ``local_rank``'s registration, read again when its file changed (a worker
        writes it whole, a new file each time) and at least once a second (a file replaced
        within one clock tick by one of the same size and a reused inode looks the same)."""
        path = self._worker_files.get(local_rank)
        if path is None:
            path = self._worker_files[local_rank] = str(
                channel.paths(self.channel_of(local_rank))[1]
            )
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            self._regs.pop(path, None)
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size, int(time.monotonic()))
        cached = self._regs.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        reg = channel.read_registration(self.channel_of(local_rank))
        self._regs[path] = (key, reg)
        return reg

    # -- down: assignments ---------------------------------------------------------------

    def prepare_start(self, worker_group: WorkerGroup) -> None:
        """Before workers start: clear what earlier workers left and write each new one its
        rank, so that its first registration is for the round it starts in."""
        for w in worker_group.workers:
            channel.remove(self.channel_of(w.local_rank))
        self._regs.clear()
        self._report(None)
        self.write_assignments(worker_group)

    def write_assignments(self, worker_group: WorkerGroup) -> None:
        """Write each local worker its rank in the round just joined."""
        round_, fence = self.joined_round(), self._handler.fence()
        for w in worker_group.workers:
            assignment = Assignment(
                round=round_,
                rank=w.global_rank,
                world_size=w.world_size,
                master_addr=str(worker_group.master_addr),
                master_port=int(worker_group.master_port or 0),
                fence=fence,
                issued=time.time(),
            )
            channel.write_assignment(self.channel_of(w.local_rank), assignment)

    def announce_next_round(self, worker_group: WorkerGroup, leave: bool = False) -> None:
        """Tell every local worker that a new round is forming and nothing of the old group
        can finish (``leave``: this node is leaving the job)."""
        note = Assignment(self.joined_round() + 1, pending=True, abort=True, leave=leave)
        for w in worker_group.workers:
            channel.write_assignment(self.channel_of(w.local_rank), note)

    # -- up: registrations ---------------------------------------------------------------

    def registrations(self, worker_group: WorkerGroup) -> list[Registration]:
        """The local workers' registrations for the round joined (or a newer one)."""
        current = self.joined_round()
        found = []
        for w in worker_group.workers:
            reg = self._registration(w.local_rank)
            if reg is not None and reg.round >= current:
                found.append(reg)
        return found

    def ready(self, worker_group: WorkerGroup) -> bool:
        """Whether every local worker runs on ``elastic.Run`` in place and is alive."""
        if not worker_group.workers:
            return False
        for w in worker_group.workers:
            reg = self._registration(w.local_rank)
            if reg is None or reg.pid != w.id or not alive(reg.pid):
                return False
        return True

    def report_round(self, worker_group: WorkerGroup) -> None:
        """Tell the handler, when it changed, the round every local worker runs in place:
        the one this node joined last, once each registered for it and none waits or asks
        for a new one (None otherwise: a restart, or a switch under way)."""
        current = self.joined_round()
        regs = [self._registration(w.local_rank) for w in worker_group.workers]
        settled = self.ready(worker_group) and all(
            r is not None and r.round == current and not (r.waiting or r.want_round) for r in regs
        )
        self._report(current if settled else None)

    def running_round(self) -> int | None:
        """The round every local worker runs in place, as last reported (None: none)."""
        return self._reported

    def _report(self, round_: int | None) -> None:
        if round_ != self._reported:
            self._reported = round_
            self._handler.running_in_place(round_)

    def ended_before_round(self, worker_group: WorkerGroup) -> bool:
        """Whether every local worker registered last for a round older than the one this
        node joined last: they ended before a round that formed as the job finished (a
        join), so its other agents would wait for ours at torch's exit barrier in vain."""
        current = self.joined_round()
        regs = [self._registration(w.local_rank) for w in worker_group.workers]
        return bool(regs) and all(r is not None and r.round < current for r in regs)

    def finished_before_join(self, worker_group: WorkerGroup) -> bool:
        """Whether the job finished before this node's workers joined it: each registered
        in place and none has formed a round yet, and the rendezvous is closed (one etcd
        read, only while they join)."""
        for w in worker_group.workers:
            reg = self._registration(w.local_rank)
            if reg is None or reg.round >= 0:
                return False
        try:
            return bool(worker_group.workers) and self._handler.is_closed()
        except Exception:  # etcd does not answer: nothing says the job finished
            return False

    def any_waiting(self, worker_group: WorkerGroup) -> bool:
        """Whether a local worker waits for a new round (its step failed on a lost peer)."""
        return any(r.waiting for r in self.registrations(worker_group))

    def ask_for_round_if_wanted(self, worker_group: WorkerGroup) -> bool:
        """If a worker asks for a new round (its step failed and no round is forming), ask
        the rendezvous for one, once per round; True when asked.

        Raises:
            RendezvousClosedError: a worker asks, but no round will form (the job finished
                or was stopped on another node): this node ends as torch's restart would.
        """
        current = self.joined_round()
        if current <= self._asked_round:
            return False
        if not any(r.want_round for r in self.registrations(worker_group)):
            return False
        if self._handler.is_closed():
            raise RendezvousClosedError(
                "A worker's step failed on a lost peer and the rendezvous is closed "
                "(the job finished or was stopped on another node); this node stops."
            )
        logger.info("A worker's step failed with no new round; forming one.")
        self._asked_round = current
        self._handler.request_reform()
        return True

    # -- the two moves ---------------------------------------------------------------------

    def reform_in_place(
        self,
        worker_group: WorkerGroup,
        change: MembershipChange | None,
        rendezvous: Callable[[WorkerGroup], None],
    ) -> None:
        """Run ``rendezvous`` (torch's, which re-ranks ``worker_group``) and hand the
        running workers their new ranks; no worker is stopped or started."""
        started = time.monotonic()
        kind = change.kind.value if change is not None else "requested"
        if change is None or change.kind is not ChangeKind.JOINERS:
            # A peer is gone or asked for a new round (its step failed, or it stops): the
            # old group's collectives may wait on it; release them while the round forms.
            self.announce_next_round(worker_group)
        pids = {w.local_rank: w.id for w in worker_group.workers}
        rendezvous(worker_group)
        for w in worker_group.workers:  # torch made new Worker objects: same processes
            w.id = pids[w.local_rank]
        self.write_assignments(worker_group)
        worker_group.state = WorkerState.HEALTHY
        seconds = time.monotonic() - started
        round_, world_size = self.joined_round(), worker_group.workers[0].world_size
        metrics.on_change("inplace")
        logger.info(
            "Re-formed in place: round %d, world size %d (%s) in %.3f s; no worker restarted.",
            round_,
            world_size,
            kind,
            seconds,
        )
        events.emit(
            "rdzv.inplace",
            round=round_,
            world_size=world_size,
            change=kind,
            seconds=round(seconds, 4),
        )

    def leave(self, worker_group: WorkerGroup) -> None:
        """SIGTERM with workers in place: leave the rendezvous now, so that the others
        re-form at once, and tell our workers to stop (their step in flight is dropped:
        the others redo it without us) instead of waiting for them to exit first."""
        if not self.ready(worker_group):
            return
        logger.warning("Leaving the rendezvous before our workers stop (they run in place).")
        try:
            self._handler.leave()
            self.left = True
        except Exception as exc:  # the others notice by heartbeat expiry
            logger.warning("Could not leave the rendezvous: %s", exc)
        self.announce_next_round(worker_group, leave=True)


__all__ = ["InPlaceHost", "offered"]
