"""``elastic status``: a run's rendezvous (from etcd) and its newest complete checkpoint."""

from __future__ import annotations

import io
import json
import pickle
from datetime import datetime, timezone
from typing import Any

from elastic.errors import EtcdStateError
from elastic.etcd.client import EtcdClient
from elastic.rendezvous.backend import decode_state
from elastic.rendezvous.keys import RunKeys

# The only globals torch's rendezvous state pickles; anything else is refused unread.
_ALLOWED = {
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_RendezvousState"),
    ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "_NodeDesc"),
    ("datetime", "datetime"),
    ("datetime", "timezone"),
    ("datetime", "timedelta"),
    ("builtins", "set"),
}


class _StateUnpickler(pickle.Unpickler):
    """Unpickles torch's rendezvous state and nothing else (no code runs from etcd)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")
        return super().find_class(module, name)


def load_state(payload: bytes) -> Any:
    """Unpickle a rendezvous state with the allow-list above."""
    return _StateUnpickler(io.BytesIO(payload)).load()


def rendezvous_status(
    client: EtcdClient, keys: RunKeys, secret: bytes | None = None
) -> dict[str, Any]:
    """Decode the run's rendezvous state into plain data (empty when there is none).

    The state is authenticated with ``secret`` when one is given (as the agents do), and
    unpickled only through an allow-list of torch's state classes either way.
    """
    kvs = client.range(keys.state).kvs
    if not kvs:
        return {"exists": False}
    try:
        state = load_state(decode_state(kvs[0].value, keys.state, secret))
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as exc:
        raise EtcdStateError(
            f"The rendezvous state at '{keys.state.decode()}' cannot be decoded ({exc}); check "
            "that every node runs the same torch, and that nobody else writes that key."
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


__all__ = [
    "checkpoint_status",
    "format_table",
    "load_state",
    "rendezvous_status",
    "status_json",
]
