"""``elastic.init_process_group``: in-place re-forms, where survivors keep their processes.

For a script on :class:`elastic.Run` that forms its group with
:func:`elastic.init_process_group` (gloo), a join, a planned leave, a crash or a frozen node
re-forms the process group inside the running workers: the agent runs the rendezvous and
hands each worker its new rank over a local channel (:mod:`.channel`); the workers swap in
the new round's group (:mod:`.groups`) and go on, model, optimizer and data loader
untouched. A failed or hung collective never raises into the loop (:mod:`.guard`). Only a
new node starts a process; it receives the state from a peer before the next step.

Everything else (a plain torchrun script, NCCL, a re-form that fails) takes the restart
path with memory or peer resume.
"""

from __future__ import annotations

from typing import Any

from elastic.worker.member import mark_alone, offered


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for a script on :class:`elastic.Run`.

    Under an agent that offers in-place re-forms, with gloo (``backend`` None or
    ``"gloo"``, no other argument than ``timeout``: every in-place group's, and how long a
    worker waits for the agent's next round), the process starts in a group of its own, so that
    ``DistributedDataParallel(model)`` can be built before the job's group exists;
    :class:`elastic.Run` then joins the job (rank and world size are known from there).
    Otherwise it is torch's own call, and membership changes restart the workers.
    """
    import torch.distributed as dist

    if offered() and backend in (None, "gloo") and set(kwargs) <= {"timeout"}:
        from elastic.worker import groups

        groups.init_alone("gloo", kwargs.get("timeout"))
        mark_alone()
        return
    dist.init_process_group(backend, **kwargs)


__all__ = ["init_process_group"]
