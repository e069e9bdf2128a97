"""The run's announce rendezvous as ``elastic status`` reports it (one read, no lock)."""

from __future__ import annotations

from typing import Any

from elastic.etcd.client import EtcdClient, op_get, op_range, txn_kvs
from elastic.rendezvous.announce.records import (
    NO_ROUND,
    Member,
    Round,
    Trust,
    decode_members,
    round_of,
)
from elastic.rendezvous.keys import RunKeys
from elastic.secret import shared_secret


def announce_status(client: EtcdClient, keys: RunKeys) -> dict[str, Any]:
    """The run's announce rendezvous in the shape of
    :func:`elastic_tools.status.rendezvous_status` (which reads the single-key state only):
    the round key and every member key in one read, and each member's lease for how long
    ago it was renewed (its heartbeat). ``{"exists": False}`` when neither key exists.

    With ``$ELASTIC_SECRET_FILE`` the records are checked as the agents check them: a round
    or member key not signed by the job is not shown (``untrusted`` counts those members)."""
    response = client.txn([], [op_get(keys.round), op_range(keys.members, prefix=True)], [])
    round_kvs, member_kvs = txn_kvs(response, 0), txn_kvs(response, 1)
    if not round_kvs and not member_kvs:
        return {"exists": False}
    secret = shared_secret()
    trust = Trust(secret, keys.round, keys.run_id) if secret is not None else None
    round_ = round_of(round_kvs[0], trust) if round_kvs else NO_ROUND
    leases = {kv.key[len(keys.members) :].decode(errors="replace"): kv.lease for kv in member_kvs}
    trusted = decode_members(member_kvs, keys.members, trust)
    members = [
        {
            "node": member.name,
            "addr": member.addr,
            "pid": member.pid,
            "state": _member_state(round_, member),
            "last_heartbeat_s_ago": client.renewed_s_ago(leases[member.name]),
        }
        for member in trusted
    ]
    return {
        "exists": True,
        "algorithm": "announce",
        "round": round_.round,
        "complete": bool(round_.members),
        "closed": round_.closed,
        "world_size": len(round_.members),
        "waiting": round_.waiting,
        "members": members,
        "untrusted": len(member_kvs) - len(trusted),
    }


def _member_state(round_: Round, member: Member) -> str:
    """ "rank N" in the round, "stale" (left out while running the one before) or "joining"."""
    if member.name in round_.members and member.after < round_.round:
        return f"rank {round_.members[member.name]}"
    if round_.stale.get(member.name) == member.mod_revision:
        return "stale"
    return "joining"


__all__ = ["announce_status"]
