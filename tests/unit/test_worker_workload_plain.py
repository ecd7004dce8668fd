"""A plain PyTorch model's loss: a ``forward`` that returns its loss as a 0-dim tensor, batches
without labels weighted by their samples, and a zero from the model's own loss on an elastic
filler that repeats real samples (no labels to ignore)."""

from __future__ import annotations

import pytest
import torch
from plain_torch_support import LossModel, PlainPairs, PredictModel, mse
from torch.utils.data import default_collate

from ray_trainer._worker.objectives.sft import SftObjective
from ray_trainer._worker.step.micro_batches import count_targets
from ray_trainer._worker.workload import Workload, model_loss, zero_loss


def batch(n: int, start: int = 0) -> dict[str, torch.Tensor]:
    data = PlainPairs(64)
    return default_collate([data[i] for i in range(start, start + n)])


def test_a_0_dim_floating_tensor_is_the_loss():
    torch.manual_seed(0)
    b = batch(8)
    loss = LossModel()(**b)
    assert model_loss(loss, b) is loss
    assert model_loss({"loss": loss}, b) is loss  # HF style, as before


@pytest.mark.parametrize(
    ("outputs", "said"),
    [
        (torch.zeros(8), r"shape \(8,\)"),
        (torch.zeros(2, 3), r"shape \(2, 3\)"),
        (torch.tensor(3), r"shape \(\) \(torch.int64\)"),
        ({"logits": torch.zeros(2)}, "dict without 'loss'"),
    ],
)
def test_what_is_not_a_loss_is_refused_saying_what_it_is(outputs, said):
    with pytest.raises(ValueError, match=said) as e:
        model_loss(outputs, batch(2))
    assert "loss_fn" in str(e.value)


def test_a_step_of_labels_less_micro_batches_weighs_each_sample_once():
    # Micro-batches of 8 and 3 samples: each contributes its mean times its count over `norm`,
    # so the sum over the step, times norm over the samples, is the mean over all 11.
    torch.manual_seed(0)
    big, small = batch(8), batch(3, start=8)
    for model, loss_fn in ((LossModel(), model_loss), (PredictModel(), mse)):
        wl = Workload(
            model, [], None, None, loss_fn, sums_itself=False, norm=16.0, objective=SftObjective()
        )
        total = 0.0
        for b in (big, small):
            targets = count_targets(b, shifts_labels=True)
            assert targets == len(b["y"])  # no labels: every sample is a target
            total += wl.forward(model, b, targets)[1].item()
        whole = batch(11)
        every = model.linear(whole["x"]).squeeze(-1)
        expected = float(((every - whole["y"]) ** 2).mean())
        assert total * wl.norm / 11 == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("model", [LossModel(), PredictModel()], ids=["own-loss", "loss-fn"])
def test_a_filler_without_labels_adds_zero_and_zero_gradients_to_every_parameter(model):
    # An elastic filler of labels-less batches is real samples counted as no target.
    loss_fn = mse if isinstance(model, PredictModel) else model_loss
    wl = Workload(
        model, [], None, None, loss_fn, sums_itself=False, norm=8.0, objective=SftObjective()
    )
    _, loss = wl.forward(model, batch(4), targets=0)
    assert loss.item() == 0.0
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)), name


class SumsItself(torch.nn.Module):
    """A model that sums its own loss over ``num_items_in_batch`` (no labels: over samples)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y, num_items_in_batch=None):
        errors = (self.linear(x).squeeze(-1) - y) ** 2
        return errors.sum() / (num_items_in_batch or len(y))


def test_a_model_summing_its_own_loss_takes_no_loss_from_a_labels_less_filler():
    model = SumsItself()
    wl = Workload(
        model, [], None, None, model_loss, sums_itself=True, norm=8.0, objective=SftObjective()
    )
    b = batch(4)
    assert wl.forward(model, b, targets=4)[1].item() > 0
    _, loss = wl.forward(model, b, targets=0)  # the same samples again: a filler
    assert loss.item() == 0.0


def test_the_zero_is_never_taken_from_a_loss_over_ignored_labels():
    # Integer labels all ignored: the model's own loss is a mean over nothing (NaN here).
    b = {"input_ids": torch.tensor([[1, 2]]), "labels": torch.full((1, 2), -100)}
    with pytest.raises(ValueError, match="return the logits too"):
        zero_loss(torch.tensor(float("nan"), requires_grad=True), b)
    # Without labels to ignore (an elastic filler of real samples) it is finite: taken.
    loss = torch.tensor(2.5, requires_grad=True)
    zero = zero_loss(loss, batch(2))
    zero.backward()
    assert zero.item() == 0.0 and loss.grad.item() == 0.0
