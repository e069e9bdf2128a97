"""InPlaceGroup.start: a joiner's first agreement on the state, cut short, re-forms in place."""

from __future__ import annotations

from typing import Any

import pytest

from elastic.worker.exchange import Interrupted
from elastic.worker.guard import StepGuard
from elastic.worker.reformer import InPlaceGroup


class _Resumer:
    def __init__(self, failures: list[BaseException]) -> None:
        self.failures = failures
        self.calls: list[bool] = []

    def sync(self, live: bool) -> str:
        self.calls.append(live)
        if self.failures:
            raise self.failures.pop(0)
        return "peer"


class _Member:
    guard = StepGuard()
    round = 4


def _group(failures: list[BaseException]) -> tuple[InPlaceGroup, list[str], _Resumer]:
    resumer = _Resumer(failures)
    parts: Any = type("FakeParts", (), {"resumer": resumer})()
    group = InPlaceGroup(parts, _Member())  # type: ignore[arg-type]
    done: list[str] = []
    group._on_new_group = lambda broken=False: done.append("group")  # type: ignore[method-assign]
    group.reform = lambda: done.append("reform")  # type: ignore[method-assign]
    return group, done, resumer


def test_a_first_sync_cut_short_re_forms_in_place_instead_of_raising() -> None:
    group, done, resumer = _group([Interrupted("rank 0 moved on to round 5")])
    group.start()
    assert resumer.calls == [False]
    assert done == ["group", "reform"]


def test_a_first_sync_that_completes_does_not_re_form() -> None:
    group, done, _ = _group([])
    group.start()
    assert done == ["group"]


def test_other_errors_of_the_first_sync_still_raise() -> None:
    group, done, _ = _group([RuntimeError("an impossible offer")])
    with pytest.raises(RuntimeError):
        group.start()
    assert done == ["group"]
