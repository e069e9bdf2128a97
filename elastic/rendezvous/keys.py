"""Where a run's data lives in etcd: ``<prefix>/<run_id>/...``."""

from __future__ import annotations

from dataclasses import dataclass

from elastic.errors import ConfigError

DEFAULT_PREFIX = "/elastic"


@dataclass(frozen=True)
class RunKeys:
    """The etcd key layout of one run."""

    prefix: str
    run_id: str

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise ConfigError(
                f"The run id '{self.run_id}' is invalid; use a non-empty name without '/'."
            )
        if not self.prefix.startswith("/"):
            raise ConfigError(f"The etcd key prefix '{self.prefix}' must start with '/'.")

    @property
    def root(self) -> bytes:
        return f"{self.prefix.rstrip('/')}/{self.run_id}/".encode()

    @property
    def state(self) -> bytes:
        """The rendezvous state (DynamicRendezvousHandler's pickled state)."""
        return self.root + b"rdzv/state"

    @property
    def fence(self) -> bytes:
        """The newest completed round: only it may commit checkpoints."""
        return self.root + b"fence"

    @property
    def restarts(self) -> bytes:
        """Prefix of the job-wide restart ledger: one key per failed round."""
        return self.root + b"restarts/"

    @property
    def members(self) -> bytes:
        """Prefix of the ``announce`` rendezvous's member keys: one per node, on its own lease."""
        return self.root + b"announce/members/"

    @property
    def round(self) -> bytes:
        """The ``announce`` rendezvous's newest round assignment (JSON), written by the closer."""
        return self.root + b"announce/round"

    @property
    def store(self) -> bytes:
        """Prefix of the c10d store's keys."""
        return self.root + b"store/"


__all__ = ["DEFAULT_PREFIX", "RunKeys"]
