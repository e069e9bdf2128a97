"""etcd v3 rendezvous for torch.distributed.elastic (handler name ``etcd-v3``)."""

from elastic.rendezvous.handler import NAME, create_backend, create_rdzv_handler, handler_factory

__all__ = ["NAME", "create_backend", "create_rdzv_handler", "handler_factory"]
