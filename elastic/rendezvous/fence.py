"""Fenced checkpoint commits: only the current rendezvous round may publish a checkpoint.

Each completed round is published at ``<prefix>/<run_id>/fence`` (zero-padded,
so etcd's byte-wise comparison is numeric). Next to it ``fence-high`` records
the newest round ever published. Neither key lives on a lease: an agent's lease
expiring must not make the fence vanish (every commit would be refused) nor let
an older round take it back. Both only move forward; when the fence is missing
(deleted by hand, or published on a lease by an older agent) the current round
puts it back, but never a round below ``fence-high``.

Before rank 0 writes a checkpoint's commit marker it runs :class:`RoundFence`:
one transaction that *compares* the fence with the writers' round and, only if
it still matches, *records* the commit at ``<prefix>/<run_id>/commits/step-N``
(JSON: round, checkpoint run, attempt, and the SHA-256 of the marker). That
record is the source of truth the loader checks markers against. Purges check
the fence right before deleting, and drop the records of the steps they delete.

The agent hands the worker what it needs through ``$ELASTIC_FENCE`` (JSON). The
etcd password never travels there: the spec names a file (mode 0600, in a
private temporary directory) that holds it.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable
from dataclasses import InitVar, asdict, dataclass
from pathlib import Path
from typing import Any

from elastic import env
from elastic.errors import CheckpointError, ConfigError
from elastic.etcd import credentials
from elastic.etcd.client import (
    EtcdClient,
    EtcdOptions,
    compare_absent,
    compare_less,
    compare_value,
    op_delete,
    op_get,
    op_put,
    parse_endpoints,
)
from elastic.rendezvous.keys import RunKeys

logger = logging.getLogger(__name__)

_password_files: dict[str, str] = {}
_password_lock = threading.Lock()


def _round_bytes(round_: int) -> bytes:
    return f"{round_:012d}".encode()


def high_key(keys: RunKeys) -> bytes:
    """The newest round ever published (never on a lease, never moves backwards)."""
    return keys.root + b"fence-high"


def commit_key(keys: RunKeys, step: int) -> bytes:
    """Where the commit record of ``step`` lives."""
    return keys.root + f"commits/step-{step}".encode()


def _advance(client: EtcdClient, key: bytes, value: bytes, *also: Any) -> bool:
    """Put ``value`` at ``key`` if it is absent or lower (and every ``also`` compare holds)."""
    put = [op_put(key, value)]
    if client.txn([compare_absent(key), *also], put, []).succeeded:
        return True
    return bool(client.txn([compare_less(key, value), *also], put, []).succeeded)


def publish_round(client: EtcdClient, keys: RunKeys, round_: int, lease: int = 0) -> None:
    """Advance the fence to ``round_`` (never backwards, never below ``fence-high``).

    ``lease`` is accepted for older callers and ignored: the fence must outlive
    the agent that published it.
    """
    del lease
    value = _round_bytes(round_)
    _advance(client, high_key(keys), value)
    # Only while round_ is the newest ever published; atomically with that check.
    _advance(client, keys.fence, value, compare_value(high_key(keys), value))


def _password_file(password: str) -> str:
    """A file the workers read ``password`` from: a sealed memory file of this process (gone
    with it, even after a kill -9; :func:`elastic.etcd.credentials.password_file`), else a 0600
    file in a private temporary directory (once per process), removed at exit."""
    try:
        return credentials.password_file(password)
    except OSError:  # no memfd_create here
        return _password_temp_file(password)


def _password_temp_file(password: str) -> str:
    with _password_lock:
        path = _password_files.get(password)
        if path is not None and os.path.exists(path):
            return path
        directory = tempfile.mkdtemp(prefix="elastic-fence-")  # mode 0700
        path = os.path.join(directory, "etcd-password")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, password.encode())
        finally:
            os.close(fd)
        _password_files[password] = path
        owner = os.getpid()

        def cleanup() -> None:
            if os.getpid() == owner:  # not in forked children that inherit the handler
                shutil.rmtree(directory, ignore_errors=True)

        atexit.register(cleanup)
        return path


def _read_password(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise ConfigError(
            f"Cannot read the etcd password file {path} named by ${env.FENCE} "
            f"({exc.strerror}); the agent that started this worker must still be running."
        ) from exc


@dataclass(frozen=True)
class FenceSpec:
    """What a worker needs to check the fence (passed as JSON in ``$ELASTIC_FENCE``).

    Holds no secret: an etcd password given as ``password`` is moved into a
    private file at construction, and only that file's path is kept.
    """

    endpoints: str
    prefix: str
    run_id: str
    round: int
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    tls: bool = False
    password: InitVar[str | None] = None

    def __post_init__(self, password: str | None) -> None:
        if password and not self.password_file:
            object.__setattr__(self, "password_file", _password_file(password))

    @classmethod
    def for_run(cls, options: EtcdOptions, keys: RunKeys, round_: int) -> FenceSpec:
        """The spec for the workers of ``round_`` of the run at ``keys``."""
        o = options
        password_file = getattr(o, "password_file", None)
        return cls(
            endpoints=",".join(str(e) for e in o.endpoints),
            prefix=keys.prefix,
            run_id=keys.run_id,
            round=round_,
            cacert=o.ca_cert,
            cert=o.cert,
            key=o.key,
            user=o.user,
            password_file=password_file,
            tls=o.tls,
            password=None if password_file else o.password,
        )

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> FenceSpec | None:
        raw = (environ if environ is not None else os.environ).get(env.FENCE)
        return cls(**json.loads(raw)) if raw else None


class RoundFence:
    """The commit fence for one round: raises ``CheckpointError`` once the round is stale."""

    def __init__(self, spec: FenceSpec) -> None:
        self.spec = spec
        endpoints, https = parse_endpoints(spec.endpoints)
        self._client = EtcdClient(
            EtcdOptions(
                endpoints,
                tls=spec.tls or https,
                ca_cert=spec.cacert,
                cert=spec.cert,
                key=spec.key,
                user=spec.user,
                password=_read_password(spec.password_file) if spec.password_file else None,
            )
        )
        self._keys = RunKeys(spec.prefix, spec.run_id)
        self._mine = compare_value(self._keys.fence, _round_bytes(spec.round))

    @property
    def round(self) -> int:
        """The writers' rendezvous round."""
        return self.spec.round

    @property
    def job(self) -> str:
        """The rendezvous run id (the job) whose fence this is."""
        return self.spec.run_id

    def __call__(self, step: int) -> None:
        self.commit(step)

    def commit(self, step: int, record: dict[str, Any] | None = None) -> None:
        """Record the commit of ``step`` if this round is still current; raise otherwise."""
        value = json.dumps({**(record or {}), "round": self.spec.round}, sort_keys=True)
        put = op_put(commit_key(self._keys, step), value.encode())
        self._fenced(f"commit step {step}", [put])

    def check(self) -> None:
        """Raise unless this round is still current (before writing or deleting anything)."""
        self._fenced("touch the checkpoints", [])

    def records(self) -> dict[int, dict[str, Any]]:
        """Every commit record of the run: step -> record."""
        prefix = self._keys.root + b"commits/step-"
        records: dict[int, dict[str, Any]] = {}
        for kv in self._client.range(prefix, prefix=True).kvs:
            try:
                step = int(kv.key[len(prefix) :])
                value = json.loads(kv.value)
            except ValueError:
                logger.warning("Ignoring the malformed commit record %r.", kv.key)
                continue
            records[step] = value if isinstance(value, dict) else {"round": value}
        return records

    def forget(self, steps: Iterable[int]) -> None:
        """Delete the commit records of purged steps (only while this round is current)."""
        deletes = [op_delete(commit_key(self._keys, s)) for s in steps]
        if deletes:
            self._fenced("forget purged steps", deletes)

    def _fenced(self, what: str, ops: list[Any]) -> None:
        for attempt in range(2):
            response = self._client.txn(
                [self._mine], ops, [op_get(self._keys.fence), op_get(high_key(self._keys))]
            )
            if response.succeeded:
                return
            current = _int_value(response.responses[0].response_range.kvs)
            if current is None and attempt == 0:
                logger.warning(
                    "The checkpoint fence of run %s is missing; republishing round %d.",
                    self._keys.run_id,
                    self.spec.round,
                )
                publish_round(self._client, self._keys, self.spec.round)
                continue
            newest = _int_value(response.responses[1].response_range.kvs)
            where = current if current is not None else f"{current} (newest ever: {newest})"
            raise CheckpointError(
                f"Refusing to {what}: the writers are in rendezvous round "
                f"{self.spec.round}, but the current round in etcd is {where}; this group "
                "is no longer the job."
            )

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()


def _int_value(kvs: Any) -> int | None:
    try:
        return int(kvs[0].value) if kvs else None
    except ValueError:
        return None


__all__ = ["FenceSpec", "RoundFence", "commit_key", "high_key", "publish_round"]
