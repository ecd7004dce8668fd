"""The step loader on a plain torch Dataset without labels or tokens: no filler where every rank
has its share (issue 47: 1 worker failed at its first step), and on an elastic run short of
workers a filler that repeats real samples, counted as no target and no token."""

from __future__ import annotations

import torch
from plain_torch_support import PlainPairs

from ray_trainer._worker.step.micro_batches import StepLoader, count_targets


def loader(world: int, rank: int, logical: int | None = None, batch_size: int = 4, accum: int = 2):
    return StepLoader(
        PlainPairs(64), world=world, rank=rank, batch_size=batch_size, grad_accum=accum, seed=3,
        pad_id=0, logical_world=logical,
    )  # fmt: skip


def test_labels_less_steps_take_no_filler_when_no_rank_is_short():
    for world in (1, 2):
        for rank in range(world):
            steps = list(loader(world, rank).steps(0))
            assert len(steps) == 64 // (4 * 2 * world)
            for micro in (m for step in steps for m in step):
                assert set(micro.batch) == {"x", "y"} and micro.batch["x"].shape == (4, 4)
                assert micro.targets == 4  # no labels: every sample is a target
                assert micro.tokens == 0 and micro.positions == 0  # no input_ids: no token


def test_an_elastic_step_short_of_workers_repeats_real_samples_as_no_target():
    # 2 workers left of a max of 3: a step is still 3 samples (batch 1, no accumulation),
    # dealt round-robin: rank 0 takes 2, rank 1 one and a filler (the same collectives).
    steps = [next(loader(2, rank, logical=3, batch_size=1, accum=1).steps(0)) for rank in (0, 1)]
    assert [len(s) for s in steps] == [2, 2]
    real = [m for s in steps for m in s if m.targets]
    assert [m.targets for m in steps[0]] == [1, 1] and [m.targets for m in steps[1]] == [1, 0]
    full = [next(loader(3, rank, batch_size=1, accum=1).steps(0)) for rank in range(3)]
    seen = sorted(float(m.batch["y"]) for m in real)
    assert seen == sorted(float(m.batch["y"]) for s in full for m in s)  # the same step
    filler = steps[1][1]
    assert filler.tokens == 0 and set(filler.batch) == {"x", "y"}
    assert torch.equal(filler.batch["y"], steps[1][0].batch["y"])  # the real sample again
    assert count_targets(filler.batch, True) == 1  # counted as none by the loader alone


def test_a_regressions_float_labels_are_kept_in_its_filler():
    class Regression(PlainPairs):
        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    micro = StepLoader(
        Regression(64), world=2, rank=1, batch_size=1, grad_accum=1, seed=0, pad_id=0,
        logical_world=3,
    ).micro_batches([0, 1, 2])  # fmt: skip
    assert [m.targets for m in micro] == [1, 0]
    assert torch.equal(micro[1].batch["labels"], micro[0].batch["labels"])  # not -100.0
