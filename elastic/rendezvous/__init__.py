"""etcd v3 rendezvous for torch.distributed.elastic (handler name ``etcd-v3``)."""

# torch's rendezvous package loads the ``torchrun.handlers`` entry points (our handler
# module) as it initializes: let it finish before our handler module starts importing it,
# or the entry point meets a half-initialized module.
import torch.distributed.elastic.rendezvous  # noqa: F401

from elastic.rendezvous.registry import NAME, create_backend, create_rdzv_handler, handler_factory

__all__ = ["NAME", "create_backend", "create_rdzv_handler", "handler_factory"]
