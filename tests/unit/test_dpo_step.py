"""A DPO micro-batch from the token cache to its loss (issue 35, points 2, 3 and 4), no Ray.

The pairs of a cache laid out chosen, rejected, ... (as the preparation tasks write it) go
through DPO's `PairDataset` (padded and packed), the reference pass of
``ray_trainer._reference`` and `DpoObjective` on the tiny chat model:

- the policy equal to its precomputed reference gives ln 2 (the reference pass and the step
  compute the same sums);
- packed and padded micro-batches give the same loss and gradients (fp32, 1e-5), and so does
  any split of the step's pairs over micro-batches and ranks;
- the chunked head and the full logits give the same log-probs;
- LoRA's in-step reference (the adapters off) is the precomputed reference of the base;
- a filler micro-batch (no pair) adds an exact zero that reaches every parameter;
- the step's metric sums and the validation's match `dpo_loss` on the whole batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from preference_support import uneven_pairs

from ray_trainer._data.cache import PieceResult, write_meta, write_piece
from ray_trainer._data.preference import PairEncoder, encode_pairs
from ray_trainer._demo.chat import make_tiny_chat_model
from ray_trainer._model.spec import ModelSpec
from ray_trainer._reference import reference_model, sequence_logps, slices
from ray_trainer._storage import locate
from ray_trainer._worker.model.chunked_loss import use_chunked_loss
from ray_trainer._worker.model.packed_attention import use_packed_attention
from ray_trainer._worker.objectives.dpo import DpoObjective, disable_dropout
from ray_trainer._worker.objectives.dpo_loss import (
    PairLogps,
    dpo_loss,
    metrics_from_sums,
    split_pairs,
)
from ray_trainer._worker.objectives.dpo_pairs import PairDataset
from ray_trainer._worker.step.micro_batches import CachedDataset, StepLoader

THINGS = ("sky", "grass", "sea", "sun", "moon", "tree", "road", "snow")
BETA = 0.1


def records() -> list[dict]:
    return uneven_pairs(THINGS)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """The tiny model's path, its pad id, and the pairs' cache (as the preparation tasks
    write it: chosen 2i, rejected 2i + 1) with the base model's reference log-probs."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("dpo_step")
    path = str(make_tiny_chat_model(root / "model"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = encode_pairs(records(), PairEncoder(tokenizer, max_length=None))
    samples = [s for pair in encoded.pairs for s in pair.sequences()]
    cache = locate(str(root / "cache"))
    write_piece(cache, 0, samples)
    lengths = np.array([len(a) for a, _ in samples], np.int32)
    targets = np.array([sum(x != -100 for x in b[1:]) for _, b in samples], np.int32)
    write_meta(
        cache, {"pairs": len(encoded.pairs)}, [PieceResult(0, lengths, targets, 8, 0, 0, [])]
    )
    pad = tokenizer.pad_token_id
    sequences = CachedDataset.open(cache, pad)
    base = reference_model(ModelSpec(model=path), torch.device("cpu"), seed=0)
    reference = sequence_logps(
        base, sequences.cache.samples(list(range(len(sequences)))), pad, "cpu"
    )
    return path, pad, sequences, reference


def policy(path: str, chunked: bool = True, packed: bool = False, lora: bool = False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(model, config)
    disable_dropout(model)
    if chunked:
        assert use_chunked_loss(model, 7) is None
    if packed:
        assert use_packed_attention(model)
    return model


def step(model, dataset, objective, micro_batches) -> tuple[float, dict, dict]:
    """Every micro-batch's forward and backward (the loop's, without ranks): the summed pair
    losses over the step's pairs, the gradients, and the metrics."""
    total, pairs = 0.0, 0
    for micro in micro_batches:
        batch = {k: v.to("cpu") for k, v in micro.batch.items()}
        _, loss = objective.forward(model, batch, micro.targets)
        loss.backward()
        total += float(loss)
        pairs += micro.targets
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total / pairs, grads, metrics_from_sums(objective.take_sums(), pairs)


def loader(dataset, world=1, rank=0, batch_size=2, grad_accum=4, packed=False) -> StepLoader:
    return StepLoader(
        dataset, world=world, rank=rank, batch_size=batch_size, grad_accum=grad_accum, seed=0,
        pad_id=dataset.pad_id, max_tokens=160 if packed else None, layout=packed,
    )  # fmt: skip


def test_the_policy_equal_to_its_precomputed_reference_gives_ln2(pairs):
    path, _, sequences, reference = pairs
    dataset = PairDataset(sequences, reference)
    objective = DpoObjective(BETA, "sigmoid", chunked=True)
    loss, _, metrics = step(
        policy(path), dataset, objective, loader(dataset).micro_batches(list(range(8)))
    )
    assert abs(loss - math.log(2)) < 1e-6
    assert abs(metrics["rewards/margins"]) < 1e-6
    assert metrics["logps/chosen"] < 0


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_packed_padded_and_any_split_give_the_same_loss_and_gradients(pairs, loss_type):
    path, _, sequences, reference = pairs
    # A reference that differs from the policy: the loss and its gradients are not trivial.
    shifted = reference + np.linspace(-3, 3, len(reference)).astype(np.float32)
    dataset = PairDataset(sequences, shifted)
    order = list(range(8))
    runs = {}
    for name, packed, world, batch_size, accum in (
        ("padded, 1 rank, 4 x 2", False, 1, 2, 4),
        ("padded, 2 ranks, 1 x 4", False, 2, 4, 1),
        ("packed, 1 rank", True, 1, 2, 4),
        ("packed, 2 ranks", True, 2, 2, 2),
    ):
        model = policy(path, packed=packed)
        objective = DpoObjective(BETA, loss_type, chunked=True)
        micro = [
            m
            for rank in range(world)
            for m in loader(dataset, world, rank, batch_size, accum, packed).micro_batches(order)
        ]
        assert all(m.targets % 1 == 0 for m in micro)
        assert sum(m.targets for m in micro) == 8  # every pair once, whole
        runs[name] = step(model, dataset, objective, micro)
    first_loss, first_grads, first_metrics = runs["padded, 1 rank, 4 x 2"]
    assert first_loss > 0
    for name, (loss, grads, metrics) in runs.items():
        assert abs(loss - first_loss) < 1e-5, name
        assert metrics == pytest.approx(first_metrics, abs=1e-5), name
        for key, grad in first_grads.items():
            torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=f"{name}: {key}")


def test_a_micro_batch_is_the_same_pairs_chosen_then_rejected(pairs):
    _, _, sequences, reference = pairs
    dataset = PairDataset(sequences, reference)
    for packed in (False, True):
        for micro in loader(dataset, packed=packed).micro_batches(list(range(8))):
            refs = micro.batch["ref_logps"]
            assert len(refs) == 2 * micro.targets
            rows = dataset.rows(list(range(8)))
            assert rows[:4] == [0, 1, 2, 3]
            # The reference travels with its sequences: chosen 2i, rejected 2i + 1.
            found = [int(np.flatnonzero(np.isclose(reference, r))[0]) for r in refs.tolist()]
            assert all(found[k] // 2 == found[k + 1] // 2 for k in range(0, len(found), 2))


def test_the_chunked_head_and_full_logits_give_the_same_logps(pairs):
    path, _, sequences, reference = pairs
    dataset = PairDataset(sequences, reference)
    micro = loader(dataset).micro_batches(list(range(8)))[0]
    batch = dict(micro.batch)
    inputs = {k: v for k, v in batch.items() if k not in ("sequence", "ref_logps", "answer_tokens")}
    chunked = DpoObjective(BETA, "sigmoid", chunked=True).logps(
        policy(path), inputs, batch["sequence"], 4
    )
    full = DpoObjective(BETA, "sigmoid", chunked=False).logps(
        policy(path, chunked=False), inputs, batch["sequence"], 4
    )
    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=1e-5)
    # ... and the reference pass computed the same sums (its own batching and padding).
    expected = torch.from_numpy(reference[dataset.rows(micro_ids(dataset))])
    torch.testing.assert_close(chunked.detach(), expected, atol=1e-5, rtol=1e-5)


def micro_ids(dataset) -> list[int]:
    """The pairs of the first padded micro-batch of `micro_batches(range(8))`, batch_size 2."""
    return [0, 1]


def test_lora_in_step_reference_is_the_base_with_adapters_off(pairs):
    pytest.importorskip("peft")
    from ray_trainer._worker.objectives.dpo import in_step_reference

    path, _, sequences, reference = pairs
    model = policy(path, lora=True)
    with torch.no_grad():  # adapters that change the model (B starts at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)

    class Lora:
        def disabled(self, module):
            return module.disable_adapter()

    objective = DpoObjective(BETA, "sigmoid", chunked=True)
    objective.reference = in_step_reference(objective, model, Lora(), None)
    dataset = PairDataset(sequences, None)  # no precomputed values: the step computes them
    micro = loader(dataset).micro_batches(list(range(8)))[0]
    batch = {k: v for k, v in micro.batch.items()}
    assert "ref_logps" not in batch
    outputs, loss = objective.forward(model, batch, micro.targets)
    expected = torch.from_numpy(reference[dataset.rows(micro_ids(dataset))])
    torch.testing.assert_close(outputs.ref_logps, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs.logps.detach(), expected, atol=1e-3)  # adapters on
    loss.backward()
    trained = [n for n, p in model.named_parameters() if p.grad is not None]
    assert trained and all("lora_" in n for n in trained)


def test_a_filler_micro_batch_adds_a_zero_that_reaches_every_parameter(pairs):
    path, _, sequences, reference = pairs
    dataset = PairDataset(sequences, reference)
    model = policy(path, packed=True)
    filler = loader(dataset, packed=True)._filler()
    batch = {k: v.to("cpu") for k, v in filler.batch.items()}
    assert filler.targets == 0
    _, loss = DpoObjective(BETA, "sigmoid", chunked=True).forward(model, batch, 0)
    assert float(loss) == 0.0
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_the_step_metrics_are_those_of_the_whole_batch(pairs):
    path, _, sequences, reference = pairs
    shifted = reference + np.linspace(-2, 3, len(reference)).astype(np.float32) ** 2
    dataset = PairDataset(sequences, shifted)
    objective = DpoObjective(BETA, "sigmoid", chunked=True)
    loss, _, metrics = step(
        policy(path), dataset, objective, loader(dataset).micro_batches(list(range(8)))
    )
    # The whole batch at once, in the order of the cache.
    model = policy(path)
    micro = loader(dataset, batch_size=8, grad_accum=1).micro_batches(list(range(8)))[0]
    batch = {k: v for k, v in micro.batch.items()}
    inputs = {k: v for k, v in batch.items() if k not in ("sequence", "ref_logps", "answer_tokens")}
    logps = objective.logps(model, inputs, batch["sequence"], 16)
    whole_batch = PairLogps(*split_pairs(logps), *split_pairs(batch["ref_logps"]))
    whole, expected = dpo_loss(whole_batch, beta=BETA, loss="sigmoid")
    assert abs(float(whole) - loss) < 1e-6
    assert metrics == pytest.approx(expected, abs=1e-5)
    assert metrics["rewards/accuracies"] in {k / 8 for k in range(9)}


def test_reference_slices_keep_pairs_whole():
    assert slices(10, 3) == [(0, 2), (2, 6), (6, 10)]
    assert slices(4, 8) == [(0, 2), (2, 4)]
    assert slices(2, 1) == [(0, 2)]
    for n, parts in ((100, 7), (6, 2), (18, 16)):
        cut = slices(n, parts)
        assert cut[0][0] == 0 and cut[-1][1] == n
        assert all(a % 2 == 0 and b % 2 == 0 for a, b in cut)


def test_an_elastic_runs_filler_takes_no_pair_and_the_step_still_counts_them_all(pairs):
    from ray_trainer._worker.step.micro_batches import _no_loss

    path, _, sequences, reference = pairs
    dataset = PairDataset(sequences, reference)
    # Two workers left of an elastic max of 3: a step is still 3 x 1 x 2 = 6 pairs.
    steps = [
        StepLoader(
            dataset, world=2, rank=rank, batch_size=1, grad_accum=2, seed=0, pad_id=dataset.pad_id,
            logical_world=3,
        ).micro_batches(list(range(6)))
        for rank in range(2)
    ]  # fmt: skip
    assert len(steps[0]) == len(steps[1]) == 3
    assert sum(m.targets for step in steps for m in step) == 6
    filler = _no_loss(steps[0][0])
    batch = {k: v.to("cpu") for k, v in filler.batch.items()}
    model = policy(path)
    _, loss = DpoObjective(BETA, "sigmoid", chunked=True).forward(model, batch, filler.targets)
    assert filler.targets == 0 and float(loss) == 0.0
    loss.backward()
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0 for p in model.parameters())


def test_without_lora_the_in_step_reference_is_a_frozen_copy(pairs):
    from ray_trainer._worker.model.adaptation import WholeModel
    from ray_trainer._worker.objectives.dpo import in_step_reference
    from ray_trainer._worker.objectives.dpo_reference import frozen_copy

    path, _, sequences, reference = pairs
    model = policy(path)
    frozen = [frozen_copy(model)]
    assert all(not p.requires_grad for p in frozen[0].parameters()) and not frozen[0].training
    with torch.no_grad():  # the policy moves on; the copy does not
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    objective = DpoObjective(BETA, "sigmoid", chunked=True)
    objective.reference = in_step_reference(objective, model, WholeModel(), frozen)
    dataset = PairDataset(sequences, None)
    micro = loader(dataset).micro_batches(list(range(8)))[0]
    outputs, loss = objective.forward(model, dict(micro.batch), micro.targets)
    expected = torch.from_numpy(reference[dataset.rows(micro_ids(dataset))])
    torch.testing.assert_close(outputs.ref_logps, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(outputs.logps.detach(), expected, atol=1e-3)
    loss.backward()
    assert all(p.grad is None for p in frozen[0].parameters())


def test_reference_tasks_are_one_per_device_with_enough_sequences_each():
    from ray_trainer._driver.reference import MAX_TASKS, tasks_for

    assert tasks_for(100, 8) == 1  # too few to spread: one task pays the start-up once
    assert tasks_for(2048, 2) == 2  # one per CPU (or GPU)
    assert tasks_for(2048, 64) == 8  # at least 256 sequences each
    assert tasks_for(10**6, 64) == MAX_TASKS


def test_the_reference_pass_gives_each_sample_its_own_value_whatever_the_batching(pairs):
    path, pad, sequences, reference = pairs
    base = reference_model(ModelSpec(model=path), torch.device("cpu"), seed=0)
    samples = sequences.cache.samples(list(range(len(sequences))))
    one_by_one = sequence_logps(base, samples, pad, "cpu", rows_per_batch=1)
    np.testing.assert_allclose(reference, one_by_one, atol=1e-5, rtol=1e-5)
    assert len(set(np.round(reference, 3))) == len(reference)  # not a constant: each its own


def workers_batch_logps(objective):
    """The training workers' reference pass's `batch_logps` (`dpo_reference._compute`): each
    sequence's sums through the policy's own forward."""

    def batch_logps(model, ids, labels, mask):
        rows = ids.shape[0]
        sequence = torch.arange(rows)[:, None].expand_as(ids)
        inputs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        return objective.logps(model, inputs, sequence, rows)

    return batch_logps


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_compiled_policy_gives_the_eager_reference_pass_loss_and_gradients(
    pairs, strategy, monkeypatch
):
    """`compile=True` as the runner applies it (`parallel._compile`: the body under DDP with the
    chunked loss, each block under FSDP), with "aot_eager" (dynamo's and AOTAutograd's graphs,
    without inductor's code generation: inductor runs in `tests/integration/test_compile.py`):
    the workers' forward-only reference pass, then padded DPO steps of changing lengths, give
    eager's values, loss, metrics and gradients, with no graph break."""
    from torch._dynamo.utils import counters

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.model.parallel import _compile

    path, pad, sequences, reference = pairs
    shifted = reference + np.linspace(-3, 3, len(reference)).astype(np.float32)
    dataset = PairDataset(sequences, shifted)
    samples = sequences.cache.samples(list(range(len(sequences))))
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(
        torch.nn.Module, "compile",
        lambda m, *a, **k: compile_module(m, *a, **{**k, "backend": "aot_eager"}),
    )  # fmt: skip
    found = {}
    torch._dynamo.reset()
    counters.clear()
    try:
        for name in ("eager", "compiled"):
            model = policy(path)
            if name == "compiled":
                _compile(model, TrainingArgs(model=path, strategy=strategy, compile=True))
            objective = DpoObjective(BETA, "sigmoid", chunked=True)
            model.eval()
            values = sequence_logps(model, samples, pad, "cpu", batch_logps=workers_batch_logps(objective))  # fmt: skip
            model.train()
            micro = loader(dataset).micro_batches(list(range(8)))
            assert len({m.batch["input_ids"].shape[1] for m in micro}) > 1  # lengths change
            found[name] = (values, *step(model, dataset, objective, micro))
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert graphs >= 1 and breaks == {}
    (values, loss, grads, metrics), eager = found["compiled"], found["eager"]
    np.testing.assert_allclose(values, eager[0], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(values, reference, atol=1e-5, rtol=1e-5)
    assert loss == pytest.approx(eager[1], abs=1e-5) and loss > 0
    assert metrics == pytest.approx(eager[3], abs=1e-5)
    assert set(grads) == set(eager[2])
    for key, grad in eager[2].items():
        torch.testing.assert_close(grads[key], grad, atol=1e-5, rtol=1e-4, msg=key)
