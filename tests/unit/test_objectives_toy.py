"""Adding an objective adds a module on each side and one registry entry (issue 47, point 1).

A toy third objective, SFT with a label-smoothed loss (``tests/support/toy_objective.py``, its
description, and ``toy_objective_worker.py``, its worker side), registered without editing any
other module: ``TrainingArgs`` takes it and refuses its field under SFT, the driver's data plan
encodes its data, and a few steps train through the code the loop runs (the workload built
around the objective its registry entry names, the step loader's micro-batches,
``Workload.forward``), its loss SFT's plus exactly the smoothing, its gradients flowing. No Ray.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from data_support import encode_here
from torch import nn
from toy_objective import SMOOTHED_SFT, registered

from ray_trainer import TrainingArgs
from ray_trainer._objectives import names
from ray_trainer._worker.objectives import worker_objective
from ray_trainer._worker.objectives.sft import SftObjective
from ray_trainer._worker.step.micro_batches import StepLoader
from ray_trainer._worker.workload import build_workload

SMOOTHING = 0.2


class TinyForCausalLM(nn.Module):
    """A byte-level causal LM (its name says so): logits, and with labels its own mean loss."""

    def __init__(self, vocab: int = 258, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, labels=None, **_):
        logits = self.head(torch.tanh(self.mix(self.embed(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            scored, targets = logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten()
            out["loss"] = F.cross_entropy(scored, targets, ignore_index=-100)
        return out


@pytest.fixture
def toy():
    with registered() as objective:
        yield objective


def _args(tmp_path, **fields) -> TrainingArgs:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(f'{{"text": "the {w} is {c}"}}\n' for w, c in _WORDS))
    return TrainingArgs(
        model=TinyForCausalLM, data=str(data), max_length=32, batch_size=2,
        grad_accum_steps=2, storage_path=str(tmp_path / "s"), **fields,
    )  # fmt: skip


_WORDS = [("sky", "blue"), ("grass", "green"), ("sea", "deep"), ("sun", "hot")] * 4


def test_the_toy_registers_and_owns_its_field(toy, tmp_path):
    assert names()[-1] == "smoothed_sft" and names()[:2] == ("sft", "dpo")
    args = TrainingArgs(objective="smoothed_sft", label_smoothing=SMOOTHING)
    assert args.label_smoothing == SMOOTHING
    assert args.to_public_dict()["objective_metrics"] == []
    with pytest.raises(ValueError) as info:  # its field, under SFT: named, with the fix
        TrainingArgs(objective="sft", label_smoothing=SMOOTHING)
    text = str(info.value)
    assert "label_smoothing set with objective='sft'" in text
    assert "objective='dpo' or objective='smoothed_sft' too, or drop them" in text
    with pytest.raises(ValueError, match="dpo_beta set with objective='smoothed_sft'"):
        TrainingArgs(objective="smoothed_sft", dpo_beta=0.3)  # DPO's own field stays DPO's


def test_an_unregistered_objective_is_refused_with_the_registered_names(tmp_path):
    with pytest.raises(ValueError) as info:
        TrainingArgs(objective="smoothed_sft")
    assert "objective='smoothed_sft' is not an objective; one of 'sft', 'dpo'" in str(info.value)


def test_the_toy_trains_through_the_loops_code_its_loss_sft_plus_the_smoothing(toy, tmp_path):
    args = _args(tmp_path, objective="smoothed_sft", label_smoothing=SMOOTHING)
    objective = worker_objective(args)  # from its registry entry's module name
    assert type(objective).__module__ == "toy_objective_worker"
    assert objective.description is SMOOTHED_SFT
    torch.manual_seed(0)
    wl = build_workload(args, objective, encode_here(args))
    assert wl.objective is objective and wl.norm == 2 * 2 * 32  # as SFT's: max_length a sample
    loader = StepLoader(
        wl.train_dataset, world=1, rank=0, batch_size=2, grad_accum=2, seed=0, pad_id=wl.pad_id
    )
    model = wl.model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    sft = SftObjective()
    losses = []
    for micro_batches in list(loader.steps(epoch=0))[:3]:
        step_loss = 0.0
        for micro in micro_batches:
            batch = micro.batch
            outputs, loss = wl.forward(model, batch, micro.targets)  # what train_step calls
            measured = float(loss.detach())
            # Plain SFT on the same batch and weights: the model's own mean, by target count.
            plain = float(sft.step_loss(wl, model, batch, micro.targets)[1].detach())
            logits, labels = outputs["logits"][:, :-1].detach(), batch["labels"][:, 1:]
            keep = labels != -100
            logp = logits.log_softmax(-1)[keep]
            ce = -logp.gather(-1, labels[keep][:, None]).sum()
            uniform = -logp.mean(-1).sum()  # the smoothing's target: every token alike
            assert keep.sum() == micro.targets > 0
            assert plain * wl.norm == pytest.approx(float(ce), rel=1e-5)
            want = (1 - SMOOTHING) * ce + SMOOTHING * uniform
            assert measured * wl.norm == pytest.approx(float(want), rel=1e-5)
            difference = (measured - plain) * wl.norm
            assert difference == pytest.approx(float(SMOOTHING * (uniform - ce)), rel=1e-4)
            assert abs(difference) > 1e-3  # the smoothing changes the loss
            loss.backward()
            step_loss += measured
        grads = [p.grad for p in model.parameters()]
        assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
        assert all(float(g.abs().sum()) > 0 for g in grads)  # every parameter is trained
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    assert len(losses) == 3 and losses[-1] < losses[0]  # it learns

    # Its validation step (what `validation.evaluate` asks): the same sum, no gradient.
    batch = next(iter(loader.steps(epoch=0)))[0].batch
    with torch.no_grad():
        total, sums = objective.val_sums(wl, model, batch, objective.val_targets(wl, batch))
        _, loss = wl.forward(model, batch, 1)
    assert sums is None and float(total) == pytest.approx(float(loss) * wl.norm, rel=1e-5)
