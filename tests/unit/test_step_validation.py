"""The in-loop validation pass on two gloo ranks: a validation set that does not split evenly
over the ranks is counted once per sample (torch's ``DistributedSampler`` pads the last ranks
with repeats of the first samples: those run, as the collectives need, and count nothing)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from gloo_support import run_ranks

from ray_trainer._worker.objectives.sft import SftObjective
from ray_trainer._worker.step.validation import evaluate
from ray_trainer._worker.workload import Workload, model_loss


class Valued(torch.nn.Module):
    """Each sample's loss is its own value (the first input id): val_loss shows who counted."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids=None, labels=None):
        return {"loss": (input_ids[:, 0].float() * self.w).mean()}


class Values(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        # Labels [-100, x]: one target per sample after the causal shift.
        return {"input_ids": torch.tensor([i + 1, 0]), "labels": torch.tensor([-100, 1])}


def _evaluate(rank: int, world: int, n: int, batch_size: int) -> dict:
    model = Valued()
    fired = {}
    state = SimpleNamespace(
        workload=Workload(model, Values(n), Values(n), None, model_loss, objective=SftObjective()),
        accelerator=SimpleNamespace(device=torch.device("cpu"), autocast=contextlib.nullcontext),
        parallel=SimpleNamespace(module=lambda: model, sharded=False),
        args=SimpleNamespace(batch_size=batch_size, eval_max_batches=None),
        rank=rank,
        world_size=world,
        ctx=SimpleNamespace(val_metrics=None),
        hooks=SimpleNamespace(fire=lambda event, **kw: fired.update(kw)),
        progress=SimpleNamespace(global_step=3),
    )
    evaluate(state)
    return fired["val_metrics"]


@pytest.mark.parametrize(("n", "batch_size"), [(5, 2), (3, 4)])
def test_each_validation_sample_counts_once_whatever_the_split(n, batch_size):
    results = run_ranks(_evaluate, 2, n, batch_size)
    expected = sum(range(1, n + 1)) / n  # the mean of the values 1..n, no repeat counted
    for metrics in results:
        assert metrics["val_loss"] == pytest.approx(expected, abs=1e-9)
