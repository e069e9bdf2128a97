"""The epoch loop never skips or ends early on its own (issue 25): a state kept at the last
boundary of an epoch, applied inside the next one, is that epoch's start; a newer one stands
(a thawed rank catches up); an older one is refused; a Run alone trains every step."""

from __future__ import annotations

import pytest
import torch

from elastic.errors import RecoveryError
from elastic.worker.session import Run
from elastic.worker.state import rolled_over


def test_a_state_of_the_previous_epochs_end_is_this_epochs_start() -> None:
    assert rolled_over(1, 240, 2, 40) == (2, 0)
    assert rolled_over(2, 36, 2, 43) == (2, 36)
    assert rolled_over(12, 36, 0, 244) == (12, 36)  # a thawed rank catches up
    with pytest.raises(RecoveryError, match="epoch 0"):
        rolled_over(0, 12, 2, 40)


def _run(tmp_path, **kw) -> Run:  # type: ignore[no-untyped-def]
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Run(model, opt, snapshot_every=0, snapshot_dir=str(tmp_path), run_id="t", **kw)


def test_every_epoch_and_step_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = _run(tmp_path)
    seen = []
    for epoch in run.epochs(3):
        for _ in run.batches([1, 2, 3]):
            seen.append((epoch, run.step))
    assert seen == [(e, s) for e, s in zip([0] * 3 + [1] * 3 + [2] * 3, range(9), strict=True)]
    assert (run.epoch, run.step) == (3, 9)


def test_an_epoch_left_on_the_wrong_counter_is_an_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run = _run(tmp_path)
    with pytest.raises(RecoveryError, match="skip epochs"):
        for _ in run.epochs(3):
            for _ in run.batches([1]):
                pass
            run.train.begin_epoch(run.epoch - 1)  # as the rewound state did (the bug)
    run.close()
