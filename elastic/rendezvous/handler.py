"""The ``single-key`` handler: torch's own DynamicRendezvousHandler on our etcd storage.

Built with torch's public constructor (``DynamicRendezvousHandler.from_backend``) over
our :class:`~elastic.rendezvous.backend.EtcdRendezvousBackend` (the whole state in one
signed key) and :class:`~elastic.rendezvous.store.EtcdStore`. Nothing of torch is
patched or subclassed, and no private attribute is written: the join logic, heartbeats,
timeouts and ``num_nodes_waiting`` are torch's, exactly as torch's own backend tests
exercise them (tests/rendezvous/test_torch_backend_suite.py runs those on our backend).

What the ``announce`` algorithm adds (early close, sparing a late node that answers its
probe port, rejoin when dropped, planned leave, in-place re-forms, the commit fence) is
not here: the node agent sees a handler that is not a
:class:`~elastic.rendezvous.contract.MembershipHandler` and behaves as torch's
LocalElasticAgent does (it restarts the workers and re-rendezvouses when a worker fails
or ``num_nodes_waiting()`` says nodes wait).
"""

from __future__ import annotations

from torch.distributed import Store
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
)

from elastic.errors import ConfigError
from elastic.rendezvous.options import RendezvousOptions


def build_handler(
    store: Store,
    backend: RendezvousBackend,
    params: RendezvousParameters,
    options: RendezvousOptions,
) -> DynamicRendezvousHandler:
    """torch's stock handler for ``params``, with the timeouts of the parsed ``options``."""
    return DynamicRendezvousHandler.from_backend(
        params.run_id,
        store,
        backend,
        params.min_nodes,
        params.max_nodes,
        params.local_addr,
        options.timeouts(),
        keep_alive_interval=_whole_seconds(options.keep_alive_interval),
        keep_alive_max_attempt=options.keep_alive_max_attempt,
    )


def _whole_seconds(interval: float) -> int:
    """torch's constructor takes the keep-alive interval in whole seconds."""
    if not float(interval).is_integer():
        raise ConfigError(
            f"keep_alive_interval={interval:g} is not a whole number of seconds, which "
            "algorithm=single-key (torch's own handler) needs; round it, or use "
            "algorithm=announce."
        )
    return int(interval)


__all__ = ["build_handler"]
