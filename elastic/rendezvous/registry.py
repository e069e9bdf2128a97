"""Where the ``etcd-v3`` handler is built: the factory and torch's registry entry point.

Registered through the ``torchrun.handlers`` entry-point group, so once this
package is installed ``torchrun --rdzv-backend=etcd-v3`` works. torch imports
this module whenever its registry loads, so it stays import-light: etcd and
grpc load only when a handler is created.

Options (``--rdzv-conf key=value,...``): see :mod:`elastic.rendezvous.options`.

With ``algorithm=announce`` (the default) the handler is :mod:`elastic.rendezvous.announce`
(one key per node; rank 0's agent hosts each round's bootstrap store,
:mod:`elastic.rendezvous.bootstrap`). With ``single-key`` it is torch's stock
DynamicRendezvousHandler (:mod:`elastic.rendezvous.handler`) on our storage
(:mod:`~elastic.rendezvous.backend`, :mod:`~elastic.rendezvous.store`), both on one etcd
client and lease.

For ``single-key``, torch's agent-hosted shared TCPStore is turned off
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) unless the user set that variable: in torch
2.14 a node joining a running job hangs with it (the old rank 0 never republishes the
store address for the new round). Workers then bootstrap their process group from a
fresh TCPStore that rank 0's worker hosts each round.
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
    from elastic.etcd.client import EtcdClient
    from elastic.rendezvous.backend import EtcdRendezvousBackend
    from elastic.rendezvous.options import RendezvousOptions
    from elastic.rendezvous.store import EtcdStore

# elastic.errors imports torch's rendezvous package, whose registry imports this
# module: import our modules lazily to keep that cycle open.

logger = logging.getLogger(__name__)

NAME = "etcd-v3"


def create_backend(
    params: RendezvousParameters,
    client: EtcdClient | None = None,
    options: RendezvousOptions | None = None,
) -> tuple[EtcdRendezvousBackend, EtcdStore]:
    """The run's ``(backend, store)`` pair, sharing one etcd client and lease."""
    from elastic.etcd.client import EtcdClient
    from elastic.rendezvous.backend import EtcdRendezvousBackend
    from elastic.rendezvous.keys import RunKeys
    from elastic.rendezvous.lease import RunLease
    from elastic.rendezvous.options import RendezvousOptions
    from elastic.rendezvous.store import EtcdStore

    options = options or RendezvousOptions.from_params(params)
    client = client or EtcdClient(options.etcd_options(params.endpoint))
    keys = RunKeys(options.prefix, params.run_id)
    lease = RunLease(client, options.ttl)
    lease.id()  # grant it now, not inside the first compare-and-set of a round
    store = EtcdStore(client, keys, lease, timeout=timedelta(seconds=options.store_timeout))
    return EtcdRendezvousBackend(client, keys, lease, state_secret()), store


def state_secret() -> bytes | None:
    """The job's secret that signs the rendezvous state: ``$ELASTIC_SECRET_FILE``.

    Without one the state is framed with a CRC-32 only (one warning): whoever can write
    etcd could then run code in the agents, which unpickle the state.
    """
    from elastic.secret import job_secret

    if os.environ.get(env.SECRET_FILE):
        return job_secret()
    logger.warning(
        "No $%s: the rendezvous state in etcd is not signed, so whoever can write etcd can "
        "run code in the agents; give every agent the same secret file (see docs/operations.md).",
        env.SECRET_FILE,
    )
    return None


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Create the ``etcd-v3`` handler (the creator registered with torch)."""
    from elastic.rendezvous.handler import build_handler
    from elastic.rendezvous.options import ANNOUNCE, RendezvousOptions

    options = RendezvousOptions.from_params(params)  # bad options fail here, in a sentence
    if options.algorithm == ANNOUNCE:
        from elastic.rendezvous.announce import build_announce_handler

        # Rank 0's agent hosts each round's bootstrap store (elastic.rendezvous.bootstrap).
        return build_announce_handler(params, options)  # fails now if unreachable
    if os.environ.setdefault(env.TORCH_DISABLE_SHARE_RDZV_TCP_STORE, "1") != "1":
        logger.warning(
            "%s=0: the shared agent TCPStore is on; nodes joining a running job may hang.",
            env.TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
        )
    backend, store = create_backend(params, options=options)  # fails now if unreachable
    return build_handler(store, backend, params, options)


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: returns the creator."""
    return create_rdzv_handler


__all__ = [
    "NAME",
    "create_backend",
    "create_rdzv_handler",
    "handler_factory",
    "state_secret",
]
