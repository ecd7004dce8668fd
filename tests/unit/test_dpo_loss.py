"""The DPO objective (issue 35, points 2, 5 and 6): TRL 1.16 parity, ln 2 at the start, and a
loss that is the mean over the global batch's pairs whatever the split.

- Parity: the same tiny chat model (fp32, no dropout), the same pairs, beta and tokenization,
  no truncation; TRL's ``DPOTrainer.compute_loss`` on its own collated batch against
  `dpo_loss` on the per-sequence sums of ``chunked_loss.sequence_logprobs``: the loss, the
  metrics and the gradients agree within 1e-5, for ``"sigmoid"`` and ``"ipo"``.
- With the policy equal to the reference, the sigmoid loss is ln 2.
- `dpo_sums` over any split of a global batch into micro-batches (and two gloo ranks), divided by
  the global pair count, gives the gradients and metrics of the whole batch at once.
"""

from __future__ import annotations

import math

import pytest
import torch
from gloo_support import run_ranks
from preference_support import uneven_pairs

from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._data.preference import PairEncoder, encode_pairs
from ray_trainer._demo.chat import make_tiny_chat_model
from ray_trainer._worker.model.chunked_loss import sequence_logprobs, shifted_targets
from ray_trainer._worker.objectives.dpo_loss import (
    METRICS,
    PairLogps,
    check_dpo_options,
    dpo_loss,
    dpo_sums,
    metrics_from_sums,
    pair_losses,
    split_pairs,
)

BETA = 0.1
THINGS = ("sky", "grass", "sea", "sun")


def pairs_records() -> list[dict]:
    """Conversational pairs with answers of uneven lengths."""
    return uneven_pairs(THINGS)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny model's path, its tokenizer, and the pairs encoded (no truncation)."""
    from transformers import AutoTokenizer

    path = make_tiny_chat_model(tmp_path_factory.mktemp("dpo") / "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    encoded = encode_pairs(pairs_records(), PairEncoder(tokenizer, max_length=None))
    return path, tokenizer, encoded.pairs


def load(path, perturb: int | None = None):
    """The tiny model in fp32, dropout off; with `perturb`, its weights moved by a seeded noise
    (a reference that differs from the policy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if perturb is not None:
        g = torch.Generator().manual_seed(perturb)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def logps(model, pairs, pad_id: int, chunk: int = 7) -> torch.Tensor:
    """Each sequence's summed answer log-prob, pairs laid out chosen, rejected, chosen, ...:
    the model's body on a right-padded batch, then `sequence_logprobs` on its hidden states."""
    rows = [seq for pair in pairs for seq in pair.sequences()]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([i + [pad_id] * (width - len(i)) for i, _ in rows])
    labels = torch.tensor([lab + [IGNORE_INDEX] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in rows])
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    sequence = torch.arange(len(rows))[:, None].expand(len(rows), width)
    head = model.get_output_embeddings()
    return sequence_logprobs(hidden, shifted_targets(labels), sequence, len(rows), head, chunk)


def token_counts(pairs) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([p.chosen_tokens for p in pairs]),
        torch.tensor([p.rejected_tokens for p in pairs]),
    )


# -- parity with TRL ------------------------------------------------------------------------------


def trl_first_step(path, tokenizer, loss_type: str, tmp_path):
    """TRL 1.16's DPO computation of the first step on the four pairs: its loss, its logged
    metrics, the policy's gradients, and the ids it trained on (batch: chosen..., rejected...)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    policy, ref = load(path), load(path, perturb=1)
    config = DPOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(THINGS), beta=BETA,
        loss_type=[loss_type], max_length=None, bf16=False, use_cpu=True, report_to="none",
        gradient_checkpointing=False, disable_dropout=True, precompute_ref_log_probs=False,
        dataset_num_proc=None, save_strategy="no",
    )  # fmt: skip
    trainer = DPOTrainer(
        model=policy, ref_model=ref, args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list(pairs_records()),
    )  # fmt: skip
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(THINGS))])
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items() if k in METRICS}
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return loss.detach().item(), metrics, grads, batch


# TRL's config and trainer call transformers names that transformers 5 renamed.
@pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")
@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_first_step_equals_trls(tiny, loss_type, tmp_path):
    path, tokenizer, pairs = tiny
    trl_loss, trl_metrics, trl_grads, batch = trl_first_step(path, tokenizer, loss_type, tmp_path)

    # The same sequences: TRL's batch rows are ours, in its order.
    rows = [s for pair in pairs for s in pair.sequences()]
    for (ids, _), got in zip(rows[0::2] + rows[1::2], batch["input_ids"], strict=True):
        assert got[: len(ids)].tolist() == ids

    policy, ref = load(path), load(path, perturb=1)
    policy.train()
    with torch.no_grad():
        ref_chosen, ref_rejected = split_pairs(logps(ref, pairs, tokenizer.pad_token_id))
    chosen, rejected = split_pairs(logps(policy, pairs, tokenizer.pad_token_id))
    chosen_tokens, rejected_tokens = token_counts(pairs)
    both = PairLogps(chosen, rejected, ref_chosen, ref_rejected, chosen_tokens, rejected_tokens)
    loss, metrics = dpo_loss(both, beta=BETA, loss=loss_type)
    loss.backward()

    assert abs(loss.detach().item() - trl_loss) < 1e-5, (loss.detach().item(), trl_loss)
    assert set(trl_metrics) == set(METRICS) == set(metrics)
    assert metrics == pytest.approx(trl_metrics, rel=0, abs=1e-5)
    assert metrics["rewards/margins"] != 0  # the reference differs from the policy
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, trl_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_policy_equal_to_reference_gives_ln2(tiny):
    path, tokenizer, pairs = tiny
    model = load(path)
    chosen, rejected = split_pairs(logps(model, pairs, tokenizer.pad_token_id))
    with torch.no_grad():
        ref_chosen, ref_rejected = split_pairs(logps(model, pairs, tokenizer.pad_token_id))
    loss, metrics = dpo_loss(PairLogps(chosen, rejected, ref_chosen, ref_rejected), beta=BETA)
    assert abs(loss.detach().item() - math.log(2)) < 1e-6
    assert metrics["rewards/margins"] == 0.0 and metrics["rewards/accuracies"] == 0.0
    assert metrics["logps/chosen"] == pytest.approx(chosen.detach().mean().item(), rel=1e-6)


# -- the formulas ---------------------------------------------------------------------------------


def test_label_smoothing_is_conservative_dpo_and_zero_is_trls_sigmoid():
    g = torch.Generator().manual_seed(0)
    pc, pr, rc, rr = (torch.randn(5, generator=g) * 10 for _ in range(4))
    z = BETA * ((pc - rc) - (pr - rr))
    plain = pair_losses(PairLogps(pc, pr, rc, rr), beta=BETA)
    assert torch.equal(plain, -torch.nn.functional.logsigmoid(z))
    smooth = pair_losses(PairLogps(pc, pr, rc, rr), beta=BETA, label_smoothing=0.2)
    want = -0.8 * torch.nn.functional.logsigmoid(z) - 0.2 * torch.nn.functional.logsigmoid(-z)
    torch.testing.assert_close(smooth, want)


def test_ipo_averages_the_log_ratios_over_each_answers_tokens():
    pc, pr = torch.tensor([-4.0, -9.0]), torch.tensor([-6.0, -3.0])
    rc, rr = torch.tensor([-5.0, -8.0]), torch.tensor([-5.0, -4.0])
    nc, nr = torch.tensor([2, 3]), torch.tensor([4, 1])
    got = pair_losses(PairLogps(pc, pr, rc, rr, nc, nr), beta=0.5, loss="ipo")
    want = ((pc - rc) / nc - (pr - rr) / nr - 1 / (2 * 0.5)) ** 2
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="chosen_tokens and rejected_tokens"):
        pair_losses(PairLogps(pc, pr, rc, rr), beta=0.5, loss="ipo")


@pytest.mark.parametrize(
    "options, words",
    [
        (("hinge", 0.1, 0.0), "dpo_loss must be one of 'sigmoid', 'ipo'"),
        (("sigmoid", 0.0, 0.0), "dpo_beta must be positive"),
        (("sigmoid", 0.1, 0.5), "label_smoothing must be in [0, 0.5)"),
        (("ipo", 0.1, 0.1), "set label_smoothing=0, or use dpo_loss='sigmoid'"),
    ],
)
def test_options_trl_does_not_define_are_refused(options, words):
    with pytest.raises(ValueError) as info:
        check_dpo_options(*options)
    assert words in str(info.value)


def test_pairs_are_laid_out_chosen_then_rejected():
    chosen, rejected = split_pairs(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert chosen.tolist() == [1.0, 3.0] and rejected.tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="even number of sequences"):
        split_pairs(torch.tensor([1.0, 2.0, 3.0]))


def test_metrics_need_pairs():
    assert metrics_from_sums(torch.zeros(len(METRICS)), 0) == {}
    with pytest.raises(ValueError, match="expected 6 metric sums"):
        metrics_from_sums([1.0], 1)


def test_an_empty_micro_batch_adds_an_exact_zero_that_reaches_the_policy():
    policy = torch.zeros(0, requires_grad=True)
    sums = dpo_sums(PairLogps(policy, policy, torch.zeros(0), torch.zeros(0)), beta=BETA)
    assert sums.pairs == 0 and sums.loss.item() == 0.0
    sums.loss.backward()
    assert policy.grad is not None


# -- split invariance -----------------------------------------------------------------------------

# Global batches of 4 pairs: one micro-batch of 4, two of 2, four of 1, or uneven (3 + 1).
SPLITS = {"1x4": [4], "2x2": [2, 2], "4x1": [1] * 4, "3+1": [3, 1]}


def step_grads(model, pairs, refs, sizes, pad_id, loss_type):
    """The gradients of one step over `pairs` cut into micro-batches of `sizes`: each adds its
    `dpo_sums` loss over the global pair count (a constant known before the step)."""
    model.zero_grad()
    total = torch.zeros(len(METRICS))
    start = 0
    for size in sizes:
        part = pairs[start : start + size]
        chosen, rejected = split_pairs(logps(model, part, pad_id))
        ref_chosen, ref_rejected = (r[start : start + size] for r in refs)
        nc, nr = token_counts(part)
        both = PairLogps(chosen, rejected, ref_chosen, ref_rejected, nc, nr)
        sums = dpo_sums(both, beta=BETA, loss=loss_type)
        (sums.loss / len(pairs)).backward()
        total += sums.metrics
        start += size
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, metrics_from_sums(total, len(pairs))


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_gradients_and_metrics_do_not_depend_on_the_split(tiny, loss_type):
    path, tokenizer, pairs = tiny
    model, ref = load(path), load(path, perturb=2)
    with torch.no_grad():
        refs = split_pairs(logps(ref, pairs, tokenizer.pad_token_id))
    results = {
        name: step_grads(model, pairs, refs, sizes, tokenizer.pad_token_id, loss_type)
        for name, sizes in SPLITS.items()
    }
    whole_grads, whole_metrics = results.pop("1x4")
    assert any(g.abs().max() > 0 for g in whole_grads.values())
    for name, (grads, metrics) in results.items():
        for param, g in grads.items():
            torch.testing.assert_close(
                g, whole_grads[param], atol=1e-6, rtol=1e-5, msg=f"{name} {param}"
            )
        for key in METRICS:
            assert metrics[key] == pytest.approx(whole_metrics[key], abs=1e-5), (name, key)


def _rank_step(rank: int, world: int) -> dict:
    """On each of two gloo ranks: two of four pairs (one micro-batch each), the summed loss over
    the global count (4), the gradients and metric sums all-reduced with the pair count."""
    import torch.distributed as dist

    torch.manual_seed(0)
    table = torch.nn.Embedding(8, 1)  # each sequence's log-prob: one parameter per sequence
    seq = torch.arange(8)
    ref = torch.linspace(-3.0, -1.0, 8)
    every = table(seq).squeeze(1) - 5.0
    counts = torch.tensor([3, 5, 2, 4])

    def sums_of(lo, hi):
        chosen, rejected = split_pairs(every[2 * lo : 2 * hi])
        ref_chosen, ref_rejected = split_pairs(ref[2 * lo : 2 * hi])
        logps = PairLogps(
            chosen, rejected, ref_chosen, ref_rejected, counts[lo:hi], counts[lo:hi] + 1
        )
        return dpo_sums(logps, beta=BETA, loss="ipo")

    mine = [sums_of(i, i + 1) for i in (2 * rank, 2 * rank + 1)]
    loss = sum(s.loss for s in mine) / 4
    loss.backward(retain_graph=True)
    grad = table.weight.grad.clone()
    metric = sum(s.metrics for s in mine)
    pairs = torch.tensor([float(sum(s.pairs for s in mine))])
    for t in (grad, metric, pairs):
        dist.all_reduce(t)  # all ranks reach each collective, in order
    table.weight.grad = None
    one = sums_of(0, 4)  # the whole global batch in this one process, for comparison
    (one.loss / one.pairs).backward()
    return {
        "grad": grad,
        "metrics": metrics_from_sums(metric, float(pairs)),
        "whole_grad": table.weight.grad.clone(),
        "whole_metrics": metrics_from_sums(one.metrics, one.pairs),
    }


def test_two_gloo_ranks_give_the_whole_batchs_gradients_and_metrics():
    results = run_ranks(_rank_step, 2)
    for out in results:
        torch.testing.assert_close(out["grad"], out["whole_grad"], atol=1e-7, rtol=1e-6)
        for key in METRICS:
            assert out["metrics"][key] == pytest.approx(out["whole_metrics"][key], abs=1e-6)
