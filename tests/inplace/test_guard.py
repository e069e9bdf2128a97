"""elastic.worker.guard without a process group: futures, aborts and skipped steps."""

from __future__ import annotations

import threading

import torch

from elastic.worker.guard import StepGuard


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched


def _grads(model: torch.nn.Module) -> None:
    model(torch.ones(1, 2)).sum().backward()


def test_a_failed_step_skips_the_optimizer_and_the_schedule() -> None:
    model, opt, sched = _model()
    guard = StepGuard()
    guard.install(model, opt, sched)
    before = [p.detach().clone() for p in model.parameters()]
    _grads(model)
    guard.fail("a peer died")
    opt.step()
    sched.step()  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert opt.param_groups[0]["lr"] == 0.1
    assert not guard.committed
    assert "step" not in sched.state_dict()  # the class swap left its state alone  # type: ignore[attr-defined]


def test_a_failure_after_the_optimizer_stepped_keeps_the_step() -> None:
    model, opt, sched = _model()
    guard = StepGuard()
    guard.install(model, opt, sched)
    _grads(model)
    opt.step()
    guard.fail("the agreement after the step failed")
    sched.step()  # type: ignore[attr-defined]
    assert guard.committed
    assert opt.param_groups[0]["lr"] == 0.05  # the schedule moved with the step


def test_abort_releases_a_pending_collective_with_its_input() -> None:
    guard = StepGuard()
    never: torch.futures.Future[torch.Tensor] = torch.futures.Future()  # a frozen peer
    fallback = torch.zeros(3)
    out = guard.watch(never, fallback)
    threading.Timer(0.05, guard.abort, ("the agent says a peer is gone",)).start()
    assert out.wait() is fallback
    assert guard.failure == "the agent says a peer is gone"
    # after an abort nothing new is started
    assert not guard.run(lambda: (_ for _ in ()).throw(AssertionError("started")))


def test_a_failed_future_fails_the_step() -> None:
    guard = StepGuard()
    broken: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    out = guard.watch(broken, torch.ones(1))
    broken.set_exception(RuntimeError("Connection closed by peer"))
    assert torch.equal(out.wait(), torch.ones(1))
    assert guard.failure is not None and "Connection closed by peer" in guard.failure
    guard.reset()
    assert guard.failure is None and guard.aborted is None


def test_a_late_failure_of_an_older_group_does_not_fail_the_new_step() -> None:
    guard = StepGuard()
    old: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    guard.watch(old, torch.ones(1))
    guard.reset()  # the group re-formed; the old collective is still pending
    old.set_exception(RuntimeError("Connection closed by peer"))
    assert guard.failure is None
