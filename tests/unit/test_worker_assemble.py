"""What a worker's setup builds besides the model: the learning-rate schedule."""

from __future__ import annotations

import pytest

from ray_trainer._worker.assemble import lr_lambda as _lr_lambda


@pytest.mark.parametrize(
    ("kind", "at_end"),
    [("linear", 0.0), ("cosine", 0.0), ("constant", 1.0)],
)
def test_lr_schedule_warmup_then_decay(kind, at_end):
    f = _lr_lambda(kind, warmup=10, total=110)
    assert f(0) == pytest.approx(0.1)
    assert f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(110) == pytest.approx(at_end, abs=1e-9)
    if kind != "constant":
        assert f(60) < 1.0
