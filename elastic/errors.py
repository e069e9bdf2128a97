"""The project's error tree.

Library errors (grpc, fsspec, pydantic) are translated into these at the module
boundary that touches the library, chained with ``raise ... from exc``. Every
message is a full sentence that names what is wrong and what to do.

Rendezvous-facing code raises torch's own rendezvous errors
(``RendezvousConnectionError``, ``RendezvousStateError``) where torch's contract
demands them; :class:`EtcdConnectionError` subclasses torch's type so both
kinds of caller catch it.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)


class ElasticError(Exception):
    """Represents the base type for errors raised by this project."""


class ConfigError(ElasticError, ValueError):
    """Represents invalid user input: a config file, a flag, an option value."""


class EtcdConnectionError(ElasticError, RendezvousConnectionError):
    """Represents a failure to reach any etcd endpoint, or a refused login."""


class EtcdStateError(ElasticError, RendezvousStateError):
    """Represents data in etcd that cannot be decoded."""


class CheckpointError(ElasticError):
    """Represents a checkpoint that cannot be written or read."""


class RecoveryError(ElasticError):
    """Represents a training state that cannot be snapshotted, exchanged or restored."""


class RequestTooLargeError(ElasticError):
    """Represents an etcd request over its ``--max-request-bytes`` limit (1.5 MiB by default)."""


class StoreError(ElasticError):
    """Represents a c10d store operation etcd refused, such as a value over its size limit."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "ElasticError",
    "EtcdConnectionError",
    "EtcdStateError",
    "RecoveryError",
    "RequestTooLargeError",
    "StoreError",
]
