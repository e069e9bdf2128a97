"""The ``etcd-v3`` rendezvous handler: torch's DynamicRendezvousHandler on our storage.

Registered through the ``torchrun.handlers`` entry-point group, so once this
package is installed ``torchrun --rdzv-backend=etcd-v3`` works. torch imports
this module whenever its registry loads, so it stays import-light: etcd and
grpc load only when a handler is created.

Options (``--rdzv-conf key=value,...``), beside torch's standard ones
(``join_timeout``, ``last_call_timeout``, ``close_timeout``,
``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``):

==================  ==========================================================
protocol            ``http`` (default) or ``https``
cacert              CA bundle (PEM) that signed the etcd server certificates
cert, key           client certificate and key (PEM) for mutual TLS
user, password      etcd user and password (etcd's auth enabled)
prefix              key prefix, default ``/elastic``; state at prefix/run_id/
ttl                 seconds an abandoned run's keys live; default 7200
connect_timeout     seconds to reach etcd the first time; default 5
request_timeout     seconds a request rides out an etcd outage; default 30
store_timeout       seconds a blocking store read waits; default 300
==================  ==========================================================

The handler is torch's DynamicRendezvousHandler with one fix (see
:mod:`elastic.rendezvous.handler`): a node dropped from its round while alive
rejoins instead of training on alone.

The agent-hosted shared TCPStore is turned off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``)
unless the user set that variable: in torch 2.14 a node joining a running job
hangs with it (the old rank 0 never republishes the store address for the new
round), and it would put a single point of failure on one training node, which
is what an etcd rendezvous exists to avoid. Workers then bootstrap their
process group from a fresh TCPStore each round.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from elastic import env

if TYPE_CHECKING:
    from elastic.etcd.client import EtcdClient, EtcdOptions
    from elastic.rendezvous.backend import EtcdRendezvousBackend
    from elastic.rendezvous.store import EtcdStore

# elastic.errors imports torch's rendezvous package, whose registry imports this
# module: import it lazily to keep that cycle open.

logger = logging.getLogger(__name__)

NAME = "etcd-v3"
# Heartbeats judged missing after interval x attempts; below this a busy node is
# declared dead while alive (a split brain seen with 1 s x 2 on a 2-core machine).
MIN_KEEP_ALIVE_ATTEMPTS = 3
MIN_KEEP_ALIVE_WINDOW_S = 3


def etcd_options(params: RendezvousParameters) -> EtcdOptions:
    """Build client options from ``--rdzv-endpoint`` and ``--rdzv-conf``."""
    from elastic.errors import ConfigError
    from elastic.etcd.client import EtcdOptions, parse_endpoints

    endpoints, https = parse_endpoints(params.endpoint or "localhost")
    protocol = str(params.get("protocol", "https" if https else "http")).lower()
    if protocol not in ("http", "https"):
        raise ConfigError(f"The etcd protocol '{protocol}' is invalid; use http or https.")
    return EtcdOptions(
        endpoints=endpoints,
        tls=protocol == "https",
        ca_cert=params.get("cacert"),
        cert=params.get("cert"),
        key=params.get("key"),
        user=params.get("user"),
        password=params.get("password"),
        connect_timeout=float(params.get("connect_timeout", 5)),
        request_timeout=float(params.get("request_timeout", 30)),
    )


def check_keep_alive(params: RendezvousParameters) -> None:
    """Refuse heartbeat settings that let a live but busy node be declared dead."""
    from elastic.errors import ConfigError

    interval = params.get_as_int("keep_alive_interval", 5) or 0
    attempts = params.get_as_int("keep_alive_max_attempt", 3) or 0
    if attempts < MIN_KEEP_ALIVE_ATTEMPTS or interval * attempts < MIN_KEEP_ALIVE_WINDOW_S:
        raise ConfigError(
            f"keep_alive_interval={interval} with keep_alive_max_attempt={attempts} declares a "
            f"node dead after {interval * attempts} s of missed heartbeats, which risks a split "
            f"brain; use at least {MIN_KEEP_ALIVE_ATTEMPTS} attempts and "
            f"{MIN_KEEP_ALIVE_WINDOW_S} s in all."
        )


def create_backend(
    params: RendezvousParameters, client: EtcdClient | None = None
) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """Create the ``(backend, store)`` pair for a run, sharing one client and lease."""
    from elastic.etcd.client import EtcdClient
    from elastic.rendezvous.backend import EtcdRendezvousBackend
    from elastic.rendezvous.keys import DEFAULT_PREFIX, RunKeys
    from elastic.rendezvous.lease import DEFAULT_TTL_S, RunLease
    from elastic.rendezvous.store import EtcdStore

    client = client or EtcdClient(etcd_options(params))
    keys = RunKeys(params.get("prefix", DEFAULT_PREFIX), params.run_id)
    lease = RunLease(client, params.get_as_int("ttl", DEFAULT_TTL_S) or DEFAULT_TTL_S)
    store_timeout = timedelta(seconds=params.get_as_int("store_timeout", 300) or 300)
    lease.id()  # grant it now, not inside the first compare-and-set of a round
    backend = EtcdRendezvousBackend(client, keys, lease)
    return backend, EtcdStore(client, keys, lease, timeout=store_timeout)


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler (the creator registered with torch)."""
    from elastic.rendezvous.handler import build_handler

    check_keep_alive(params)
    if os.environ.setdefault(env.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1") != "1":
        logger.warning(
            "%s=0: the shared agent TCPStore is on; nodes joining a running job may hang.",
            env.TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
        )
    backend, store = create_backend(params)  # fails now, naming the endpoints, if unreachable
    return build_handler(store, backend, params)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the creator."""
    return create_rdzv_handler


def register() -> None:
    """Register ``etcd-v3`` with torch's registry (for torch without entry-point discovery)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    if not rendezvous_handler_registry._registry.get(NAME):
        rendezvous_handler_registry.register(NAME, create_rdzv_handler)


__all__ = ["NAME", "create_backend", "create_rdzv_handler", "etcd_options", "handler_factory"]
