"""How a Run ends: its one way out, and the last step's save at the job's end.

:func:`shutdown` is :meth:`elastic.Run._shutdown` (every exit of the loop comes here, with
an :class:`~elastic.worker.agreement.Exit` saying which); :func:`save_final` persists the
last completed step, and at the job's end never leaves it in a round a join left behind.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch.distributed as dist

from elastic.worker import groups
from elastic.worker.agreement import END_REFORMS, Exit

if TYPE_CHECKING:
    from elastic.worker.session import Run


def shutdown(
    run: Run,
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
    if how is Exit.DONE:  # never end in a round that a join left behind
        run._step_end.end_in_newest_round()
    ours = run._store.owner == os.getpid()
    if how in (Exit.DONE, Exit.STOPPED) and not ours:
        run._jit.failed("the loop stopped")
    elif how is Exit.FELL_BACK:
        run._jit.failed("the in-place re-form failed")
    if how is not Exit.FELL_BACK:  # (failed() waited; a second wait could raise)
        run._jit.wait()
    run._jit.close()  # no failure-time snapshot from here on
    if run._checkpoints is not None and how is not Exit.FELL_BACK:
        final = how in (Exit.DONE, Exit.STOPPED) and persist
        if final and run.step > 0:
            run._save_final(at_end=how is Exit.DONE)
        run._checkpoints.close()
    run._signals.restore()
    if how in (Exit.DONE, Exit.STOPPED, Exit.CLOSED) and ours:  # nobody could use it
        run._store.remove()
    if how is not Exit.DONE:
        run._store.close()
    if how in (Exit.LEFT, Exit.FELL_BACK):
        run._group.close()
    if how is Exit.LEFT:
        groups.drop_world()
    if how is Exit.STOPPED and run.distributed and dist.is_initialized():
        if run._group.control is not None:
            dist.barrier(group=run._group.control)
        dist.destroy_process_group()
        run._group.close()
    if code is not None:
        raise SystemExit(code) from cause


def save_final(run: Run, at_end: bool) -> None:
    """Persist the last completed step unless it is committed already. At the job's
    end (``at_end``), when a newer round formed meanwhile (a join; it made the fence
    refuse the save, or it formed during the save) the group re-forms into it
    (:meth:`StepEnd.end_in_newest_round`) and ends there, the joiner with it."""
    run._checkpoints.wait()  # the save in flight may be this step's
    for _ in range(END_REFORMS):
        refused = False
        if run._checkpoints.last_good != run.step:
            outcome = run._checkpoints.save(run.step, run._persist_state(), block=True)
            run._last_saved = run.step
            refused = outcome is not None and not outcome.ok
        if not at_end or not run._step_end.end_in_newest_round(refused=refused):
            return


__all__ = ["save_final", "shutdown"]
