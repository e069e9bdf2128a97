"""``elastic status``: a run's rendezvous (from etcd) and its newest complete checkpoint.

Also the pieces ``elastic dashboard`` shares: :func:`etcd_options` (the agent's TLS and
login options, the password from a file or ``$ELASTIC_ETCD_PASSWORD``, never from the
command line) and :func:`rendezvous_status`.

The single-key rendezvous state is a pickle: it is decoded only with the job's secret
(``$ELASTIC_SECRET_FILE``), after its HMAC verified. Without the secret nothing pickled
is decoded at all, not even through the allow-list below: status then shows what etcd
says about the key (size, revision, whether the agents sign it) and a sentence that the
details need the secret. (Single-key is torch's own handler: it publishes no commit fence
and no probe ports, so the state key is all there is.)
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from elastic import env
from elastic.errors import ConfigError, EtcdStateError
from elastic.etcd.client import EtcdClient, EtcdOptions, parse_endpoints
from elastic.etcd.credentials import password_from_env
from elastic.rendezvous.backend import _MAGIC_SIGNED, decode_state
from elastic.rendezvous.keys import RunKeys

if TYPE_CHECKING:
    from elastic.checkpoint.layout import Verify

# The etcd password when no --password-file is given (a flag would show it in `ps`).
PASSWORD_ENV = env.ETCD_PASSWORD
# How much of each checkpoint file the check reads: "size" lists it (cheap on object
# storage), "crc" reads every byte (the CRC-32 of each file; slow for remote storage).
CheckpointVerify = Literal["size", "crc"]
_LAYOUT_VERIFY: dict[str, Verify] = {"size": "size", "crc": "full"}
# Said when the rendezvous state is not decoded (no secret): what is missing, and the fix.
NEEDS_SECRET = (
    "The round and members of this run are pickled in etcd and are shown only with the "
    f"job's secret; set ${env.SECRET_FILE} to the job's secret file."
)

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


def read_password(password_file: str | os.PathLike[str] | None) -> str | None:
    """The etcd password: the content of ``password_file`` (without surrounding whitespace,
    as the agent's ``password_file=`` reads it), else ``$ELASTIC_ETCD_PASSWORD`` (None when
    neither is there)."""
    if password_file:
        try:
            password = Path(password_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"Cannot read the etcd password file {password_file} "
                f"({exc.strerror or exc}); check the path and its permissions."
            ) from exc
        if not password:
            raise ConfigError(
                f"The etcd password file {password_file} is empty; write the password in it."
            )
        return password
    return password_from_env()


def etcd_options(
    endpoints: str,
    *,
    cacert: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    user: str | None = None,
    password_file: str | os.PathLike[str] | None = None,
    request_timeout: float | None = None,
) -> EtcdOptions:
    """How to reach etcd, with the agent's TLS (``cacert``, ``cert``, ``key``) and login
    (``user`` with the password of :func:`read_password`) options."""
    parsed, https = parse_endpoints(endpoints)
    password = read_password(password_file) if user or password_file else None
    if user and not password:
        raise ConfigError(
            f"The etcd user '{user}' needs a password: pass --password-file FILE or set "
            f"${PASSWORD_ENV}."
        )
    if password and not user:
        raise ConfigError("An etcd password was given without a user; pass --user NAME too.")
    extra: dict[str, Any] = {}
    if request_timeout is not None:
        extra["request_timeout"] = request_timeout
    return EtcdOptions(
        parsed,
        tls=https,
        ca_cert=cacert,
        cert=cert,
        key=key,
        user=user,
        password=password,
        **extra,
    )


def load_state(payload: bytes) -> Any:
    """Unpickle a rendezvous state with the allow-list above."""
    return _StateUnpickler(io.BytesIO(payload)).load()


def rendezvous_status(
    client: EtcdClient, keys: RunKeys, secret: bytes | None = None
) -> dict[str, Any]:
    """The run's rendezvous state as plain data (``{"exists": False}`` when there is none),
    under either algorithm (single-key or announce).

    The announce algorithm keeps JSON only, shown in full. The single-key state is a
    pickle: with ``secret`` it is authenticated (as the agents do) and then unpickled
    through an allow-list of torch's state classes; without one it is never unpickled,
    and only what needs no decoding is returned (see :func:`_undecoded_status`).
    """
    kvs = client.range(keys.state).kvs
    if not kvs:  # no single-key state: the run may use the announce algorithm
        from elastic.rendezvous.announce import announce_status

        return announce_status(client, keys)
    if not secret:
        return _undecoded_status(keys, kvs[0])
    payload = decode_state(kvs[0].value, keys.state, secret)  # raises unless signed by us
    try:
        state = load_state(payload)
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


def _undecoded_status(keys: RunKeys, kv: Any) -> dict[str, Any]:
    """What status can say of a single-key run without unpickling anything: the state
    key's size and revision and whether the agents sign it, with :data:`NEEDS_SECRET`."""
    return {
        "exists": True,
        "decoded": False,
        "key": keys.state.decode(),
        "bytes": len(kv.value),
        "revision": int(kv.mod_revision),
        "signed": kv.value.startswith(_MAGIC_SIGNED),
        "note": NEEDS_SECRET,
    }


def checkpoint_status(
    url: str | None,
    run_id: str,
    verify: CheckpointVerify = "size",
    secret: bytes | None = None,
) -> dict[str, Any] | None:
    """The newest complete checkpoint step under ``url`` (None when no URL is given).

    ``verify="size"`` (the default) checks that every file the commit marker lists exists
    with its recorded size: a listing, cheap on object storage. ``"crc"`` also reads every
    byte to compare CRC-32s. ``secret`` (the job's) makes unsigned or foreign markers count
    as incomplete, as the workers' resume does.
    """
    if not url:
        return None
    if verify not in _LAYOUT_VERIFY:
        raise ConfigError(f"The checkpoint check '{verify}' is not one of size, crc.")
    from elastic.checkpoint import find_latest_complete

    info = find_latest_complete(
        url, run_id, verify=_LAYOUT_VERIFY[verify], warn=False, secret=secret
    )
    return {"url": url, "verify": verify, "newest_complete_step": info.step if info else None}


STRAGGLER_KINDS = ("train.step", "straggler.detected", "straggler.dropped", "worker.hang")
MAX_LOG_READ = 4 << 20  # the newest bytes of the event log that status reads


def straggler_status(event_log: str | os.PathLike[str] | None) -> dict[str, Any] | None:
    """The slowest ranks of the newest measured step (their compute time over the ranks'
    median, from rank 0's ``train.step``: :mod:`elastic.worker.timing`) and the newest
    slow, dropped and stuck ranks, from the newest :data:`MAX_LOG_READ` bytes of the event
    log (default ``$ELASTIC_EVENT_LOG``); None without a log."""
    event_log = event_log or os.environ.get(env.EVENT_LOG)
    if not event_log:
        return None
    from elastic.events import Tail

    tail = Tail(event_log, kinds=STRAGGLER_KINDS, max_backlog=MAX_LOG_READ)
    newest: dict[str, Any] | None = None
    named: list[dict[str, Any]] = []
    for event in tail.read():
        if event.get("kind") == "train.step":
            if "slowest" in event:
                newest = event
        else:
            named.append(event)
    out: dict[str, Any] = {"event_log": str(event_log), "step": None, "slowest": []}
    if newest is not None:
        out["step"] = newest.get("step")
        out["slowest"] = [{"rank": r, "ratio": ratio} for r, ratio in newest["slowest"]]
    keep = ("kind", "ts", "step", "rank", "ranks", "ratio", "steps", "seconds")
    out["events"] = [{k: e[k] for k in keep if k in e} for e in named[-5:]]
    return out


def _straggler_lines(ranks: dict[str, Any]) -> list[str]:
    if ranks["step"] is None:
        return [f"  slowest ranks: no measured step in {ranks['event_log']}"]
    slowest = ", ".join(f"rank {s['rank']} {s['ratio']:.2f}x" for s in ranks["slowest"])
    lines = [f"  slowest ranks at step {ranks['step']} (to the median): {slowest}"]
    for e in ranks["events"]:
        when = datetime.fromtimestamp(float(e.get("ts", 0)), timezone.utc).strftime("%H:%M:%S")
        if e["kind"] == "worker.hang":
            what = f"rank {e.get('rank')} stuck {e.get('seconds')} s in step {e.get('step')}"
        else:
            verb = "dropped" if e["kind"] == "straggler.dropped" else "slow"
            what = f"ranks {e.get('ranks')} {verb} at {e.get('ratio')}x (step {e.get('step')})"
        lines.append(f"  {when} {e['kind']}: {what}")
    return lines


def format_table(
    run_id: str,
    rdzv: dict[str, Any],
    ckpt: dict[str, Any] | None,
    ranks: dict[str, Any] | None = None,
) -> str:
    """A human-readable report."""
    lines = [f"run {run_id}"]
    if not rdzv["exists"]:
        lines.append("  no rendezvous state in etcd (never started, or expired)")
    elif rdzv.get("decoded") is False:
        signed = "signed" if rdzv["signed"] else "not signed"
        lines.append(
            f"  rendezvous state: {rdzv['bytes']} bytes at revision {rdzv['revision']}, "
            f"{signed} (not decoded)"
        )
        lines.append(f"  {rdzv['note']}")
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
        found = "none" if step is None else f"step {step}"
        lines.append(f"  newest complete checkpoint: {found} ({ckpt.get('verify', 'size')} check)")
    if ranks is not None:
        lines.extend(_straggler_lines(ranks))
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def strict_json(body: Any, **options: Any) -> str:
    """``json.dumps(body, **options)`` that every JSON parser reads: a non-finite float (a
    diverged loss, a ratio to a zero median) is written as the string JavaScript shows for
    it, ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, not as Python's bare ``NaN``, which a
    browser's ``JSON.parse`` refuses."""
    return json.dumps(_finite(body), allow_nan=False, **options)


def status_json(
    run_id: str,
    rdzv: dict[str, Any],
    ckpt: dict[str, Any] | None,
    ranks: dict[str, Any] | None = None,
) -> str:
    body = {"run_id": run_id, "rendezvous": rdzv, "checkpoint": ckpt}
    if ranks is not None:
        body["ranks"] = ranks
    return strict_json(body, indent=2)


__all__ = [
    "NEEDS_SECRET",
    "PASSWORD_ENV",
    "CheckpointVerify",
    "checkpoint_status",
    "etcd_options",
    "format_table",
    "load_state",
    "read_password",
    "rendezvous_status",
    "status_json",
    "straggler_status",
    "strict_json",
]
