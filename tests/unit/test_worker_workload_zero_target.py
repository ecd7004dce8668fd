"""A micro-batch with no target token (a rank's filler micro-batch, a chat row truncated before
its answer) adds an exact zero to the loss and finite, zero gradients, also with a `loss_fn`
that takes the mean over the micro-batch's targets (a mean over nothing is NaN)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from ray_trainer._worker.objectives.sft import SftObjective
from ray_trainer._worker.workload import Workload, zero_loss


class Tiny(nn.Module):
    def __init__(self, returns: str = "dict") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)
        self.returns = returns

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids))
        if self.returns == "tensor":
            return logits
        loss = F.cross_entropy(logits.view(-1, 16), labels.view(-1), ignore_index=-100)
        if self.returns == "tuple":
            return (loss, logits)
        return {"loss": loss, "logits": logits}


def mean_ce(outputs, batch):
    logits = outputs if torch.is_tensor(outputs) else outputs["logits"]
    return F.cross_entropy(logits.view(-1, 16), batch["labels"].view(-1), ignore_index=-100)


def workload(model: nn.Module) -> Workload:
    return Workload(
        model, [], None, None, mean_ce, sums_itself=False, norm=8.0, objective=SftObjective()
    )


def test_a_micro_batch_without_targets_adds_zero_and_finite_gradients():
    model = Tiny()
    wl = workload(model)
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.full((1, 4), -100)}
    assert torch.isnan(mean_ce(model(**batch), batch))  # what the loop must not backpropagate
    _, loss = wl.forward(model, batch, targets=0)
    assert loss.item() == 0.0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient: a DDP or FSDP reducer would wait"
        assert torch.equal(p.grad, torch.zeros_like(p)), name
    assert wl.objective.val_sums(wl, model, batch, targets=0)[0] == 0.0


def test_a_micro_batch_with_targets_is_weighted_by_their_count():
    model = Tiny()
    wl = workload(model)
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4]]), "labels": torch.tensor([[-100, 2, 3, 4]])}
    expected = mean_ce(model(**batch), batch).item()
    _, loss = wl.forward(model, batch, targets=3)
    assert loss.item() == pytest.approx(expected * 3 / 8.0)
    assert float(wl.objective.val_sums(wl, model, batch, 3)[0]) == pytest.approx(expected * 3)


@pytest.mark.parametrize("returns", ["dict", "tuple", "tensor"])
def test_the_zero_comes_from_the_logits_never_from_the_nan_loss(returns):
    model = Tiny(returns)
    batch = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.full((1, 2), -100)}
    loss = zero_loss(model(**batch))
    loss.backward()
    assert loss.item() == 0.0
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_outputs_without_a_float_tensor_are_refused_with_what_to_return():
    with pytest.raises(ValueError, match="return the logits"):
        zero_loss({"loss": torch.tensor(float("nan")), "ids": torch.tensor([1])})
