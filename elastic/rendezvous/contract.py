"""The seam between the node agent and our rendezvous handlers: what each side may ask.

The agent (:class:`elastic.agent.node.NodeAgent`) drives torch's rendezvous through
``next_rendezvous()``; on top of that it asks our handler (the announce one; torch's stock
handler under ``single-key`` answers none of them, and the agent then acts as torch's) the
questions below. Everything crosses here, typed, and nothing through
``os.environ``: the commit fence of the round just joined is :meth:`MembershipHandler.fence`,
which the agent hands to its workers in their environment (and, in place, over the channel).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol, runtime_checkable

__all__ = ["ChangeKind", "MembershipChange", "MembershipHandler"]


class ChangeKind(str, Enum):
    """Why the group must re-form (see :meth:`MembershipHandler.membership_change`)."""

    REQUESTED = "requested"  # the agent asked (its workers stopped for a peer's leave)
    JOINERS = "joiners"  # nodes wait to join
    PEERS_ASKED = "peers_asked"  # a peer asked for a new round (its step failed, or it stops)
    PEERS_LOST = "peers_lost"  # a peer left the round: expired, reaped or left
    DROPPED = "dropped"  # this node is no longer a participant of its round


@dataclass(frozen=True)
class MembershipChange:
    """A reason to re-form the group, and the nodes it concerns (``JOINERS``: how many)."""

    kind: ChangeKind
    round: int | None
    nodes: tuple[str, ...] = ()
    waiting: int = 0


@runtime_checkable
class MembershipHandler(Protocol):
    """What the agent asks of our handler (announce), besides torch's own.

    ``hosts_round_store``: whether each round's bootstrap store outlives the round's first
    process group, so running workers can form the next round's group through it (the
    condition for in-place re-forms, :mod:`elastic.worker`).
    """

    hosts_round_store: bool

    def membership_change(self) -> MembershipChange | None: ...
    def request_reform(self) -> None: ...
    def leave(self, timeout: float = 10.0) -> None: ...
    def keep_open(self) -> None:
        """This node leaves the job on its own while the others go on: its ``shutdown()``
        then releases the node without closing the rendezvous (which ends the job)."""
        ...

    def record_failed_round(self) -> int | None: ...
    def get_run_id(self) -> str: ...
    def is_closed(self) -> bool: ...
    def round_view(self) -> tuple[int, int, int]: ...
    def running_in_place(self, round_: int | None) -> None:
        """The agent's word: every local worker runs round ``round_`` in place (None: not,
        or not yet). A closer whose own workers run the newest round in place lets a
        newcomer in without its last call (:func:`.announce.policy.released`)."""
        ...

    def fence(self) -> str:
        """The commit fence of the round this node joined last, as ``$ELASTIC_FENCE``
        JSON; ``""`` before the first round or where checkpoints are not fenced."""
        ...
