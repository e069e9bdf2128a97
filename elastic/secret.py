"""The per-job secret that signs checkpoint commit markers (HMAC-SHA256).

Whoever can write checkpoint storage could otherwise run code in the workers:
DCP unpickles ``.metadata``. A marker signed with this secret is trusted; the
signature is checked before anything of the step is unpickled.

Where the secret comes from, first match wins:

1. ``$ELASTIC_SECRET_FILE``: a file readable only by the job's user, the same
   file (same bytes) on every node; it must exist and be non-empty;
2. a local run (no elastic agent, every rank on this host): a secret generated
   once and stored (mode 0600) at ``$XDG_CONFIG_HOME/elastic/secret``
   (default ``~/.config/elastic/secret``);
3. none: a warning, once per process, and checkpoints are checked with CRC-32
   only (this protects against torn files, not against tampering).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from elastic import env
from elastic.errors import ConfigError

logger = logging.getLogger(__name__)

_SECRET_BYTES = 32
_DOMAIN = b"elastic-checkpoint-marker-v2\0"
_KEY_SPACE_DOMAIN = b"elastic-round-store-keys-v1\0"
_warned = False


def secret_path(environ: Mapping[str, str] | None = None) -> Path:
    """Where a local run keeps its generated secret."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "elastic" / "secret"


def is_local_run(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every rank of this job runs on this host and no elastic agent manages it."""
    environ = os.environ if environ is None else environ
    if environ.get(env.FENCE):
        return False  # our agent: nodes come and go, a per-host secret would not match
    world = environ.get(env.WORLD_SIZE)
    return world is None or environ.get(env.LOCAL_WORLD_SIZE) == world


def job_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """Return this job's signing secret, or ``None`` (with one warning) when there is none.

    Raises:
        ConfigError: ``$ELASTIC_SECRET_FILE`` names a file that is missing or empty.
    """
    environ = os.environ if environ is None else environ
    named = environ.get(env.SECRET_FILE)
    if named:
        return _read(Path(named))
    if is_local_run(environ):
        path = secret_path(environ)
        try:
            return _read_or_create(path)
        except OSError as exc:
            _warn_once(f"the local secret {path} cannot be created ({exc.strerror})")
            return None
    _warn_once(f"${env.SECRET_FILE} is not set")
    return None


def shared_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret of ``$ELASTIC_SECRET_FILE`` only (no local fallback, no warning), or None.

    For what nodes of one job must agree on (the rendezvous' records): a secret generated
    per host would differ between hosts.

    Raises:
        ConfigError: ``$ELASTIC_SECRET_FILE`` names a file that is missing or empty.
    """
    named = (os.environ if environ is None else environ).get(env.SECRET_FILE)
    return _read(Path(named)) if named else None


def key_space(address: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The prefix of the workers' own keys in the round store at ``address``
    (``host:port``), derived from ``$ELASTIC_SECRET_FILE``'s secret, or None without one.

    A round's store is torch's TCPStore, open to whoever reaches its port; with a job
    secret the workers keep their keys under a name only the job's members can compute,
    so a stranger can neither plant, read nor delete them (it can still fill the store
    until the store host's memory cap ends it, which fails that round only).

    Raises:
        ConfigError: ``$ELASTIC_SECRET_FILE`` names a file that is missing or empty.
    """
    shared = shared_secret(environ)
    if shared is None:
        return None
    return f"elastic/{sign(shared, address.encode(), _KEY_SPACE_DOMAIN)[:32]}/"


def sign(secret: bytes, content: bytes, domain: bytes = _DOMAIN) -> str:
    """HMAC-SHA256 of ``domain`` + ``content`` under ``secret``, hex (the domain keeps a
    signature of one kind of record from passing for another)."""
    return hmac.new(secret, domain + content, hashlib.sha256).hexdigest()


def verify(secret: bytes, content: bytes, signature: object, domain: bytes = _DOMAIN) -> bool:
    """Whether ``signature`` is the HMAC of ``content`` under ``secret`` (constant time)."""
    return isinstance(signature, str) and hmac.compare_digest(
        sign(secret, content, domain), signature
    )


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(
            f"Cannot read the checkpoint secret {path} named by ${env.SECRET_FILE} "
            f"({exc.strerror}); create it on every node, e.g. with "
            f"'head -c 32 /dev/urandom | base64 > {path}; chmod 600 {path}'."
        ) from exc
    if not data:
        raise ConfigError(
            f"The checkpoint secret {path} named by ${env.SECRET_FILE} is empty; write at "
            "least 32 random bytes into it (the same file on every node)."
        )
    with contextlib.suppress(OSError):
        info = path.stat()
        # Group-readable is fine when the group is this process's own (Kubernetes mounts a
        # Secret 0440 with the pod's fsGroup); anything else can be read by others.
        own_group = info.st_gid in (os.getgid(), *os.getgroups())
        if info.st_mode & 0o007 or (info.st_mode & 0o070 and not own_group):
            logger.warning(
                "The checkpoint secret %s is readable by other users; run 'chmod 600 %s'.",
                path,
                path,
            )
    return data


def _read_or_create(path: Path) -> bytes:
    """Read the local secret, creating it atomically (mode 0600) if it does not exist."""
    if not path.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_hex(_SECRET_BYTES).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it first: theirs wins
            logger.info("Generated the checkpoint signing secret %s.", path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return _read(path)


def _warn_once(why: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    logger.warning(
        "No checkpoint signing secret (%s): checkpoints are checked with CRC-32 only, so "
        "whoever can write the checkpoint storage can run code in the workers; set $%s "
        "to a secret file shared by every node.",
        why,
        env.SECRET_FILE,
    )


__all__ = ["is_local_run", "job_secret", "secret_path", "shared_secret", "sign", "verify"]
