"""How a Run ends: its one way out, and the last step's save at the job's end.

:func:`shutdown` is every exit of the loop (:class:`elastic.Run`'s and the step boundary's),
with an :class:`Exit` saying which; :func:`save_final` persists the last completed step, and
at the job's end never leaves it in a round a join left behind.
"""

from __future__ import annotations

import enum
import os

import torch.distributed as dist

from elastic.worker import groups
from elastic.worker.parts import Parts

END_REFORMS = 3  # re-forms at the job's end while newer rounds keep forming


class Exit(enum.Enum):
    """How a Run ends (:func:`shutdown`, its one way out)."""

    DONE = "the loop ran to its end"
    STOPPED = "the group stopped after a step"
    LEFT = "this rank left; the others go on in place with the state"
    FELL_BACK = "an in-place re-form failed; the agent restarts this worker"
    CLOSED = "close() was called"


def shutdown(
    parts: Parts,
    how: Exit,
    *,
    persist: bool = True,
    code: int | None = None,
    cause: BaseException | None = None,
) -> None:
    """End the run ``how`` says; with ``code``, exit the process with it.

    DONE and STOPPED write the last completed step to memory when this node's agent
    keeps it (a restart may use it) and persist it (``persist``); FELL_BACK writes it
    to memory only; LEFT and CLOSED write nothing. STOPPED destroys the groups (their
    C++ threads must be joined while the interpreter is alive, or the exit can end in
    std::terminate), LEFT drops this process's group, which its peers go on without.
    """
    jit, store, group = parts.jit, parts.store, parts.group
    if how is Exit.DONE:  # never end in a round that a join left behind
        parts.step_end.end_in_newest_round()
    ours = store.owner == os.getpid()
    if how in (Exit.DONE, Exit.STOPPED) and not ours:
        jit.failed("the loop stopped")
    elif how is Exit.FELL_BACK:
        jit.failed("the in-place re-form failed")
    if how is not Exit.FELL_BACK:  # (failed() waited; a second wait could raise)
        jit.wait()
    jit.close()  # no failure-time snapshot from here on
    manager = parts.checkpoints.manager
    if manager is not None and how is not Exit.FELL_BACK:
        final = how in (Exit.DONE, Exit.STOPPED) and persist
        if final and parts.train.step > 0:
            save_final(parts, at_end=how is Exit.DONE)
        parts.checkpoints.manager.close()  # (the end may have re-formed: a new manager)
    parts.signals.restore()
    if how in (Exit.DONE, Exit.STOPPED, Exit.CLOSED) and ours:  # nobody could use it
        store.remove()
    if how is not Exit.DONE:
        store.close()
    if how in (Exit.LEFT, Exit.FELL_BACK):
        group.close()
    if how is Exit.LEFT:
        groups.drop_world()
    if how is Exit.STOPPED and parts.place.distributed and dist.is_initialized():
        if group.control is not None:
            dist.barrier(group=group.control)
        dist.destroy_process_group()
        group.close()
    if code is not None:
        raise SystemExit(code) from cause


def save_final(parts: Parts, at_end: bool) -> None:
    """Persist the last completed step unless it is committed already. At the job's
    end (``at_end``), when a newer round formed meanwhile (a join; it made the fence
    refuse the save, or it formed during the save) the group re-forms into it
    (:meth:`StepEnd.end_in_newest_round`) and ends there, the joiner with it."""
    checkpoints, step = parts.checkpoints, parts.train.step
    checkpoints.manager.wait()  # the save in flight may be this step's
    for _ in range(END_REFORMS):
        refused = False
        manager = checkpoints.manager  # (a re-form made a new one)
        if manager.last_good != step:
            outcome = manager.save(step, parts.persist_state(), block=True)
            refused = outcome is not None and not outcome.ok
        if not at_end or not parts.step_end.end_in_newest_round(refused=refused):
            return


__all__ = ["END_REFORMS", "Exit", "save_final", "shutdown"]
