"""``elastic status``: a run's rendezvous (from etcd) and its newest complete checkpoint."""

from __future__ import annotations

import json
import pickle
from datetime import datetime, timezone
from typing import Any

from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient
from elastic.rendezvous.backend import decode_state
from elastic.rendezvous.keys import RunKeys


def rendezvous_status(client: EtcdClient, keys: RunKeys) -> dict[str, Any]:
    """Decode the run's rendezvous state into plain data (empty when there is none)."""
    kvs = client.range(keys.state).kvs
    if not kvs:
        return {"exists": False}
    try:
        state = pickle.loads(decode_state(kvs[0].value, keys.state))
    except (pickle.UnpicklingError, AttributeError, EOFError) as exc:
        raise EtcdStateError(
            f"The rendezvous state at '{keys.state.decode()}' cannot be decoded by this torch "
            "version; check that every node runs the same torch."
        ) from exc
    now = datetime.now(timezone.utc)
    members = []
    for node, beat in sorted(state.last_heartbeats.items(), key=lambda kv: str(kv[0])):
        if node in state.participants:
            role = f"rank {state.participants[node]}" if state.complete else "joining"
        else:
            role = "waiting" if node in state.wait_list else "spare"
        members.append(
            {
                "node": str(node),
                "addr": node.addr,
                "pid": node.pid,
                "state": role,
                "last_heartbeat_s_ago": round((now - beat).total_seconds(), 1),
            }
        )
    return {
        "exists": True,
        "round": state.round,
        "complete": state.complete,
        "closed": state.closed,
        "world_size": len(state.participants) if state.complete else 0,
        "waiting": len(state.wait_list),
        "members": members,
    }


def checkpoint_status(url: str | None, run_id: str) -> dict[str, Any] | None:
    """The newest complete checkpoint step under ``url`` (None when no URL is given)."""
    if not url:
        return None
    from elastic.checkpoint import find_latest_complete

    info = find_latest_complete(url, run_id, warn=False)
    return {"url": url, "newest_complete_step": info.step if info else None}


def format_table(run_id: str, rdzv: dict[str, Any], ckpt: dict[str, Any] | None) -> str:
    """A human-readable report."""
    lines = [f"run {run_id}"]
    if not rdzv["exists"]:
        lines.append("  no rendezvous state in etcd (never started, or expired)")
    else:
        lines.append(
            f"  round {rdzv['round']}  complete={rdzv['complete']}  closed={rdzv['closed']}  "
            f"world size {rdzv['world_size']}  waiting {rdzv['waiting']}"
        )
        lines.append(f"  {'node':<28} {'state':<10} {'heartbeat':>10}")
        for m in rdzv["members"]:
            age = f"{m['last_heartbeat_s_ago']}s ago"
            lines.append(f"  {m['node']:<28} {m['state']:<10} {age:>10}")
    if ckpt is not None:
        step = ckpt["newest_complete_step"]
        lines.append(f"  newest complete checkpoint: {'none' if step is None else f'step {step}'}")
    return "\n".join(lines)


def status_json(run_id: str, rdzv: dict[str, Any], ckpt: dict[str, Any] | None) -> str:
    return json.dumps({"run_id": run_id, "rendezvous": rdzv, "checkpoint": ckpt}, indent=2)


__all__ = ["checkpoint_status", "format_table", "rendezvous_status", "status_json"]
