"""The GRPO loss (issue 50, point 3): TRL 1.16 parity, and a loss that any split of a step's
completions over micro-batches and ranks adds up to exactly.

- Parity: the tiny chat model (fp32, no dropout), the same prompts and completions, advantages,
  old (and reference) log-probs; TRL's own ``GRPOTrainer._compute_loss`` on a trainer built
  once against `grpo_loss` on the per-token log-probs of a plain forward: the loss, the metrics
  and the gradients agree within 1e-5, for every loss type, at the sequence level, with the KL,
  with the importance-sampling ratio, and with truncated completions masked.
- Splits: `grpo_sums` over 1, 2 or 4 micro-batches (and two real gloo ranks) over the step's
  `denominator` gives the whole step's gradients within 1e-6 and the same metrics.
- A step whose completions are all masked trains on nothing, and its metrics say so.
"""

from __future__ import annotations

import math

import pytest
import torch
from gloo_support import run_ranks

from ray_trainer._demo.chat import make_tiny_chat_model
from ray_trainer._objectives.grpo import LOSS_METRICS, LOSS_TYPES
from ray_trainer._worker.objectives.grpo_loss import (
    CompletionTokens,
    denominator,
    grpo_loss,
    grpo_sums,
    importance_ratio,
    metrics_from_sums,
)

TEMPERATURE = 0.7
MAX_COMPLETION = 7
PROMPTS = ["What color is the sky?", "Name a fruit:"]
LENGTHS = [5, 3, 7, 2]  # two completions per prompt, uneven; the third one uses every token
ADVANTAGES = [0.9, -0.9, 0.6, -0.6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    path = make_tiny_chat_model(tmp_path_factory.mktemp("grpo") / "model")
    return path, AutoTokenizer.from_pretrained(path)


def load(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def step_inputs(tokenizer, masked_rows=()) -> dict:
    """TRL's layout of one step: prompts left-padded, completions right-padded, two
    completions per prompt; `masked_rows` masked as `mask_truncated_completions` masks them."""
    g = torch.Generator().manual_seed(0)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    prompt_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.randint(10, len(tokenizer), (len(LENGTHS), MAX_COMPLETION), generator=g)
    full = torch.tensor([[1] * n + [0] * (MAX_COMPLETION - n) for n in LENGTHS])
    completion_ids = completion_ids.masked_fill(full == 0, pad)
    mask = full.clone()
    for row in masked_rows:
        mask[row] = 0
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "full_mask": full,
        "advantages": torch.tensor(ADVANTAGES),
        "num_items_in_batch": mask.sum(),
    }


def per_token(model, inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Each completion token's log-prob and entropy at TEMPERATURE, from a plain forward
    ([completions, T]; padding positions hold whatever they hold)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -MAX_COMPLETION - 1 : -1]
    logp = torch.log_softmax(logits.float() / TEMPERATURE, dim=-1)
    chosen = logp.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen, entropy.detach()


def off_policy(model, inputs, seed: int) -> torch.Tensor:
    """Log-probs a few optimizer steps away from the model's (so that ratios clip both ways)."""
    with torch.no_grad():
        logps, _ = per_token(model, inputs)
    g = torch.Generator().manual_seed(seed)
    return logps + (torch.rand(logps.shape, generator=g) - 0.5) * 1.6


@pytest.fixture(scope="module")
def trl_trainer(tiny, tmp_path_factory):
    """TRL 1.16's GRPOTrainer on the tiny model, built once; each case sets the attributes
    `_compute_loss` reads (as its __init__ sets them from GRPOConfig) and clears its grads."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    path, tokenizer = tiny
    config = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), per_device_train_batch_size=4,
        num_generations=2, max_completion_length=MAX_COMPLETION, temperature=TEMPERATURE,
        bf16=False, use_cpu=True, report_to="none", save_strategy="no", disable_dropout=True,
        gradient_checkpointing=False,
    )  # fmt: skip

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = GRPOTrainer(
        model=load(path), reward_funcs=[reward], args=config, processing_class=tokenizer,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
    )  # fmt: skip
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, before a step
    return trainer


CASES = {
    **{t: {"loss_type": t} for t in LOSS_TYPES},
    "grpo+kl": {"loss_type": "grpo", "beta": 0.04},
    "dapo+kl+sequence": {"loss_type": "dapo", "beta": 0.04, "importance_sampling_level": "sequence"},
    # Bounds that keep some completions' (tokens') ratios and zero (clamp) others.
    "bnpo+sequence_mask": {"loss_type": "bnpo", "importance_sampling": ("sequence_mask", 0.5, 2.0)},
    "dr_grpo+token_truncate": {"loss_type": "dr_grpo", "importance_sampling": ("token_truncate", 0.8, 1.3)},
    "dapo+masked_truncated": {"loss_type": "dapo", "masked_rows": (1, 2)},
}  # fmt: skip


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("case", list(CASES))
def test_loss_metrics_and_gradients_equal_trls(tiny, trl_trainer, case):
    path, tokenizer = tiny
    options = dict(CASES[case])
    masked_rows = options.pop("masked_rows", ())
    beta = options.get("beta", 0.0)
    level = options.get("importance_sampling_level", "token")
    mode, low, cap = options.pop("importance_sampling", (None, None, None))
    inputs = step_inputs(tokenizer, masked_rows)
    policy = load(path)
    old = off_policy(policy, inputs, seed=1)
    ref = off_policy(policy, inputs, seed=2)
    sampling = off_policy(policy, inputs, seed=3)

    # Ours: per-token log-probs of a plain forward, flattened to the completions' tokens.
    policy.train()
    logps, entropy = per_token(policy, inputs)
    tokens = CompletionTokens.from_padded(
        inputs["full_mask"], inputs["advantages"], logps=logps, old_logps=old,
        ref_logps=ref if beta else None, sampling_logps=sampling, entropy=entropy,
        mask=inputs["completion_mask"],
    )  # fmt: skip
    ratio = importance_ratio(tokens, mode, cap=cap, low=low)
    if mode is not None:  # the bounds bite: some weights are changed, others kept
        assert ((ratio == 0) | (ratio == low) | (ratio == cap)).any() and (ratio != 1.0).any()
    loss, metrics = grpo_loss(
        tokens, epsilon=0.2, epsilon_high=0.28, importance_sampling_ratio=ratio,
        max_completion_length=MAX_COMPLETION, **options,
    )  # fmt: skip
    loss.backward()

    # TRL's: the same inputs, its own _compute_loss (the ratio in its padded layout).
    trainer = trl_trainer
    trainer.model.load_state_dict(policy.state_dict())
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.loss_type = options["loss_type"]
    trainer.beta = beta
    trainer.importance_sampling_level = level
    trainer.epsilon_low, trainer.epsilon_high = 0.2, 0.28
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = ratio is not None
    theirs = {k: v for k, v in inputs.items() if k != "full_mask"}
    theirs["old_per_token_logps"] = old
    if beta:
        theirs["ref_per_token_logps"] = ref
    if ratio is not None:
        padded = torch.zeros(inputs["full_mask"].shape)
        padded[inputs["full_mask"].bool()] = ratio
        theirs["importance_sampling_ratio"] = padded
    trainer.model.train()
    trl_loss = trainer._compute_loss(trainer.model, theirs)
    trl_loss.backward()
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    assert abs(loss.item() - trl_loss.item()) < 1e-5, (loss.item(), trl_loss.item())
    assert set(trl_metrics) == set(metrics) - {"trained_tokens"}
    for name, value in trl_metrics.items():
        if math.isnan(value):
            assert math.isnan(metrics[name]), name
        else:
            assert metrics[name] == pytest.approx(value, abs=1e-5), name
    assert metrics["trained_tokens"] == inputs["completion_mask"].sum().item()
    if case in LOSS_TYPES:  # the ratios clip on both sides: the clipped branch is exercised
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    theirs_grads = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad, theirs_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


# -- the importance-sampling ratio ----------------------------------------------------------------


def test_the_importance_sampling_ratio_masks_or_truncates_outside_its_bounds():
    logps = torch.tensor([-1.0, -1.0, -2.0, -0.5, -0.5])
    sampling = torch.tensor([-1.5, -1.0, -2.0, -0.5, -0.6])
    seq = torch.tensor([0, 0, 1, 2, 2])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the last token takes no loss: no weight
    tokens = CompletionTokens(logps, seq, torch.zeros(3), mask=mask, sampling_logps=sampling)
    e = math.exp
    seq_ratio = torch.tensor([e(0.5), e(0.5), 1.0, 1.0, 1.0])
    torch.testing.assert_close(
        importance_ratio(tokens, "sequence_truncate", cap=1.2), seq_ratio.clamp(max=1.2)
    )
    torch.testing.assert_close(
        importance_ratio(tokens, "sequence_mask", cap=1.2), torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
    )
    tok = importance_ratio(tokens, "token_mask", cap=3.0, low=0.9)
    torch.testing.assert_close(tok, torch.tensor([e(0.5), 1.0, 1.0, 1.0, 1.0]))
    # NaN engine log-probs count as equal (TRL: no correction for an unscorable token).
    nan = CompletionTokens(logps, seq, torch.zeros(3), sampling_logps=torch.full((5,), math.nan))
    assert torch.equal(importance_ratio(nan, "token_truncate", cap=3.0), torch.ones(5))
    assert importance_ratio(tokens, None) is None
    with pytest.raises(ValueError, match=r"grpo\.importance_sampling must be one of"):
        importance_ratio(tokens, "sequence")  # fmt: skip


# -- edge cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_a_step_of_masked_completions_trains_on_nothing_and_says_so(loss_type):
    logps = torch.randn(6, requires_grad=True)
    tokens = CompletionTokens(
        logps, torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([1.0, -1.0]),
        mask=torch.zeros(6), entropy=torch.rand(6),
    )  # fmt: skip
    loss, metrics = grpo_loss(tokens, loss_type=loss_type, max_completion_length=3)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logps.grad, torch.zeros(6))
    assert metrics["trained_tokens"] == 0
    assert metrics["entropy"] == 0.0 and metrics["clip_ratio/region_mean"] == 0.0  # TRL's 0/1
    assert math.isnan(metrics["clip_ratio/low_min"])  # no completion to take a min over


def test_an_empty_micro_batch_adds_an_exact_zero_that_reaches_the_policy():
    logps = torch.zeros(0, requires_grad=True)
    tokens = CompletionTokens(logps, torch.zeros(0, dtype=torch.long), torch.zeros(0))
    sums = grpo_sums(tokens)
    sums.loss.backward()
    assert sums.loss.item() == 0.0 and logps.grad is not None
    assert sums.tokens == 0 and sums.completions == 0


def test_the_metric_names_are_trls_and_kl_needs_beta():
    sums = torch.tensor([2.0, 4.0, 1.0, 1.0, 2.0, 8.0, 2.0])
    maxima = torch.tensor([-0.25, 0.5])
    metrics = metrics_from_sums(sums, maxima, beta=0.0)
    assert set(metrics) == set(LOSS_METRICS) - {"kl"}
    assert metrics["entropy"] == 0.5 and metrics["clip_ratio/low_min"] == 0.25
    assert metrics_from_sums(sums, maxima, beta=0.1)["kl"] == 0.25
    seq = metrics_from_sums(sums, maxima, importance_sampling_level="sequence")
    assert seq["clip_ratio/region_mean"] == 1.0  # over the 2 completions, not the 8 tokens


def test_the_denominators_are_counts_of_the_whole_step():
    counts = {"tokens": 30.0, "completions": 4.0, "max_completion_length": 16}
    assert denominator("grpo", **counts) == 4.0
    assert denominator("dr_grpo", **counts) == 64.0
    assert denominator("bnpo", **counts) == 30.0
    assert denominator("dapo", **counts) == 30.0
    # A generation batch spread over two optimizer steps: TRL's num_items_in_batch / 2.
    assert denominator("dapo", **counts, generation_tokens=50.0, steps_per_generation=2) == 25.0
    assert denominator("bnpo", **{**counts, "tokens": 0.0}) == 1.0
    with pytest.raises(ValueError, match=r"grpo\.loss_type must be one of"):
        denominator("cispo", **counts)


# -- split invariance -----------------------------------------------------------------------------

# 8 completions of uneven lengths; a step cut into micro-batches (and ranks) of these sizes.
SPLIT_LENGTHS = [5, 1, 7, 3, 4, 6, 2, 5]
SPLITS = {"1x4": [8], "2x2": [4, 4], "4x1": [2, 2, 2, 2], "uneven": [3, 1, 4]}


def split_problem(seed: int = 0):
    """A tiny differentiable policy (a linear head over fixed hidden states) and a step's
    completions: tokens' targets, old, reference and engine log-probs, advantages, a mask
    (completion 2 truncated and masked)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(SPLIT_LENGTHS)
    hidden = torch.randn(n, 8, generator=g)
    head = torch.randn(16, 8, generator=g) * 0.5
    targets = torch.randint(0, 16, (n,), generator=g)
    sequence = torch.repeat_interleave(
        torch.arange(len(SPLIT_LENGTHS)), torch.tensor(SPLIT_LENGTHS)
    )
    mask = (sequence != 2).float()
    with torch.no_grad():
        base = torch.log_softmax(hidden @ head.T, -1).gather(1, targets[:, None]).squeeze(1)
    noise = [(torch.rand(n, generator=g) - 0.5) * 0.6 for _ in range(3)]
    advantages = torch.randn(len(SPLIT_LENGTHS), generator=g)
    fixed = {"old": base + noise[0], "ref": base + noise[1], "sampling": base + noise[2]}
    return hidden, head, targets, sequence, mask, advantages, fixed


def part_tokens(head, problem, first: int, count: int) -> CompletionTokens:
    """The completions [first, first + count) as one micro-batch (its own sequence numbers)."""
    hidden, _, targets, sequence, mask, advantages, fixed = problem
    keep = (sequence >= first) & (sequence < first + count)
    logp = torch.log_softmax(hidden[keep] @ head.T, -1)
    return CompletionTokens(
        logp.gather(1, targets[keep][:, None]).squeeze(1), sequence[keep] - first,
        advantages[first : first + count], mask=mask[keep], old_logps=fixed["old"][keep],
        ref_logps=fixed["ref"][keep], sampling_logps=fixed["sampling"][keep],
        entropy=-(logp.exp() * logp).sum(-1).detach(),
    )  # fmt: skip


OPTIONS = {
    **{t: {"loss_type": t, "beta": 0.05} for t in LOSS_TYPES},
    "grpo+sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
}


def split_step(problem, sizes, options):
    """One step's gradient and metrics over micro-batches of `sizes` completions: each adds
    its `grpo_sums` loss over the step's denominator (counted before backward, as the loop's
    all-reduce of counts does)."""
    head = problem[1].clone().requires_grad_(True)
    parts, first = [], 0
    for size in sizes:
        tokens = part_tokens(head, problem, first, size)
        ratio = importance_ratio(tokens, "sequence_truncate", cap=1.5)
        parts.append(grpo_sums(tokens, importance_sampling_ratio=ratio, **options))
        first += size
    sums = sum(p.sums for p in parts)
    maxima = torch.stack([p.maxima for p in parts]).max(0).values
    divisor = denominator(
        options["loss_type"], tokens=float(sums[5]), completions=float(sums[6]),
        max_completion_length=8,
    )  # fmt: skip
    for part in parts:
        (part.loss / divisor).backward(retain_graph=True)
    level = options.get("importance_sampling_level", "token")
    return head.grad, metrics_from_sums(sums, maxima, beta=1.0, importance_sampling_level=level)


@pytest.mark.parametrize("option", list(OPTIONS))
def test_gradients_and_metrics_do_not_depend_on_the_split(option):
    problem = split_problem()
    results = {name: split_step(problem, sizes, OPTIONS[option]) for name, sizes in SPLITS.items()}
    whole_grad, whole_metrics = results["1x4"]
    assert whole_grad.abs().sum() > 0
    for name, (grad, metrics) in results.items():
        torch.testing.assert_close(grad, whole_grad, atol=1e-6, rtol=0, msg=name)
        assert metrics == pytest.approx(whole_metrics, abs=1e-6, nan_ok=True), name


def _gloo_rank(rank: int, world: int, option: str) -> list[float]:
    """One gloo rank's share of a step: its completions in two micro-batches, the counts and
    metric sums all-reduced (SUM, and MAX for the extremes), the gradients all-reduced."""
    import torch.distributed as dist

    problem = split_problem()
    options = OPTIONS[option]
    head = problem[1].clone().requires_grad_(True)
    mine = [(rank * 4, 2), (rank * 4 + 2, 2)]  # rank 0: completions 0-3, rank 1: 4-7
    parts = [
        grpo_sums(
            t, importance_sampling_ratio=importance_ratio(t, "sequence_truncate", cap=1.5),
            **options,
        )
        for t in (part_tokens(head, problem, first, n) for first, n in mine)
    ]  # fmt: skip
    sums = sum(p.sums for p in parts)
    maxima = torch.stack([p.maxima for p in parts]).max(0).values
    dist.all_reduce(sums)  # all ranks reach this collective: the step's counts
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    divisor = denominator(
        options["loss_type"], tokens=float(sums[5]), completions=float(sums[6]),
        max_completion_length=8,
    )  # fmt: skip
    sum(p.loss for p in parts).div(divisor).backward()
    dist.all_reduce(head.grad)  # summed, not averaged: the divisor counts every rank
    metrics = metrics_from_sums(sums, maxima, beta=1.0)
    return [*head.grad.flatten().tolist(), metrics["kl"], metrics["clip_ratio/high_max"]]


def test_two_gloo_ranks_give_the_whole_steps_gradient():
    option = "dapo"
    grad, metrics = split_step(split_problem(), SPLITS["1x4"], OPTIONS[option])
    want = [*grad.flatten().tolist(), metrics["kl"], metrics["clip_ratio/high_max"]]
    for got in run_ranks(_gloo_rank, 2, option):
        assert got == pytest.approx(want, abs=1e-6)


# -- num_iterations > 1: passes over one rollout's completions ------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_second_pass_takes_the_first_passs_log_probs_as_old_ones_as_trl(tiny, trl_trainer):
    """``num_iterations=2`` through the worker objective's own steps: one rollout's completions
    yielded for two optimizer steps; the first pass reads the old log-probs (the policy that
    sampled them), the second's loss, clip metrics and gradients equal TRL's `_compute_loss`
    on that pass's inputs (the moved policy, those old log-probs): the ratio moves and clips."""
    from types import SimpleNamespace

    from ray_trainer import TrainingArgs
    from ray_trainer._rollout.types import Completion
    from ray_trainer._worker.objectives.grpo import GrpoObjective
    from ray_trainer._worker.objectives.grpo_batch import PromptDataset, completion_batch

    path, tokenizer = tiny
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = min(map(len, ids))  # prompts of one length: TRL's left padding is no padding
    inputs = step_inputs(tokenizer)
    inputs["prompt_ids"] = torch.tensor([p[:width] for p in ids for _ in range(2)])
    inputs["prompt_mask"] = torch.ones_like(inputs["prompt_ids"])
    comps = [
        Completion(i // 2, inputs["prompt_ids"][i].tolist(),
                   inputs["completion_ids"][i, :n].tolist(), [0.0] * n, False, 0)
        for i, n in enumerate(LENGTHS)
    ]  # fmt: skip
    micro = completion_batch(comps, ADVANTAGES, pad_id=tokenizer.pad_token_id, loss_type="dapo",
                             max_completion_length=MAX_COMPLETION, mask_truncated=False)  # fmt: skip

    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    grpo = dict(num_generations=2, max_completion_length=MAX_COMPLETION, num_iterations=2,
                temperature=TEMPERATURE, epsilon_high=0.28, importance_sampling=None)  # fmt: skip
    args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[reward],
                               grpo=grpo)  # fmt: skip
    objective = GrpoObjective(args)
    objective.prompts = PromptDataset([SimpleNamespace(prompt_ids=p) for p in ids])
    objective._start = lambda s: None  # no engines: the completions are given
    objective.rollout_step = lambda s, prompts: [micro]
    objective._rollout, objective._extremes = [0.0] * 10, [0.0] * 8
    progress = SimpleNamespace(epoch=0, step_in_epoch=0, global_step=0, extra={})
    starts = []

    def loader_steps(epoch, start):
        starts.append(start)
        return iter([["the step's prompts"]] * (1 - start))

    state = SimpleNamespace(progress=progress, loader=SimpleNamespace(steps=loader_steps,
                            left_out=lambda e: [], per_step=4), args=SimpleNamespace(seed=0))  # fmt: skip
    policy = load(path)
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = torch.optim.Adam(policy.parameters(), lr=0.05)
    workload = SimpleNamespace(norm=1.0)
    passes = []
    for batches in objective.steps(state, iter([])):  # the loop's part: a step per yield
        assert batches == [micro]
        _, loss = objective.step_loss(workload, policy, micro.batch, micro.targets)
        loss.backward()
        sums = objective.take_sums()
        metrics = objective.metrics_from_sums(sums.tolist(), micro.targets)
        grads = {n: p.grad.clone() / micro.targets for n, p in policy.named_parameters()}
        state_now = {k: v.clone() for k, v in policy.state_dict().items()}
        passes.append((loss.item() / micro.targets, metrics, grads, state_now))
        optimizer.step()
        optimizer.zero_grad()
        progress.step_in_epoch += 1
        progress.global_step += 1
    assert len(passes) == 2 and starts == [0]  # one rollout, two optimizer steps
    assert progress.extra["grpo_ledger"]["step_in_epoch"] == 2  # the ledger counts both

    # The old log-probs are the sampling policy's: a forward of the weights before any step.
    sampler = load(path)
    sampler.load_state_dict(before)
    with torch.no_grad():
        old_padded, _ = per_token(sampler, inputs)
    old_flat = objective._old[0]
    torch.testing.assert_close(old_flat, old_padded[inputs["full_mask"].bool()], atol=1e-6,
                               rtol=0)  # fmt: skip
    assert passes[0][1]["clip_ratio/region_mean"] == 0.0  # the first pass: ratio 1

    # TRL on the second pass's inputs: the moved policy, the first pass's log-probs as old.
    loss, metrics, grads, weights = passes[1]
    trainer = trl_trainer
    trainer.model.load_state_dict(weights)
    trl_loss, trl_metrics = _trl_dapo_loss(trainer, inputs, old_padded)
    assert loss == pytest.approx(trl_loss, abs=1e-5)
    _assert_same_metrics(metrics, trl_metrics)
    assert metrics["clip_ratio/region_mean"] > 0  # the ratio moved, and clipping bites
    for name, p in trainer.model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)


# -- packing=True: completions packed into rows ---------------------------------------------------


def _packed_problem(tokenizer):
    """8 completions of uneven lengths, 2 per prompt of uneven lengths, with engine log-probs
    a little off the policy's and one truncated completion (masked)."""
    from ray_trainer._rollout.types import Completion

    g = torch.Generator().manual_seed(5)
    prompts = [tokenizer(p)["input_ids"] for p in (*PROMPTS, "Hi", "Say a long word please:")]
    comps = []
    for i, n in enumerate(SPLIT_LENGTHS):
        ids = torch.randint(10, len(tokenizer), (n,), generator=g).tolist()
        logprobs = (torch.rand(n, generator=g) * -3).tolist()
        comps.append(Completion(i // 2, prompts[i // 2], ids, logprobs, i == 2, 0))
    advantages = torch.randn(len(comps), generator=g).tolist()
    return comps, advantages


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_packed_completions_give_the_padded_loss_and_gradient_for_any_split(tiny, loss_type):
    """``packing=True``: each micro-batch's completions in one packed row (position ids
    restarting per completion, our packed attention) give the padded micro-batches' loss,
    gradient and metrics within 1e-6 (fp32), and the 1x4, 2x2 and 4x1 splits of the step over
    micro-batches x ranks stay exact packed (the ranks' sums added as the step's all-reduce
    adds them). With ``beta > 0``: the frozen reference reads the packed rows too."""
    import copy
    from types import SimpleNamespace

    from ray_trainer import TrainingArgs
    from ray_trainer._worker.model.packed_attention import use_packed_attention
    from ray_trainer._worker.objectives.grpo import GrpoObjective
    from ray_trainer._worker.objectives.grpo_batch import completion_batch

    path, tokenizer = tiny
    comps, advantages = _packed_problem(tokenizer)

    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    def step(sizes, packed):
        model = load(path)
        if packed:
            assert use_packed_attention(model)
        grpo = dict(num_generations=2, max_completion_length=8, temperature=TEMPERATURE,
                    beta=0.04, loss_type=loss_type, mask_truncated_completions=True,
                    importance_sampling="sequence_truncate", importance_sampling_cap=1.2)  # fmt: skip
        args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                                   reward_fns=[reward], grpo=grpo)  # fmt: skip
        objective = GrpoObjective(args)
        objective.frozen = copy.deepcopy(model).requires_grad_(False)
        g = torch.Generator().manual_seed(7)
        with torch.no_grad():  # the policy a little away from the reference: a KL
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        objective._rollout, objective._extremes = [0.0] * 10, [0.0] * 8
        parts, first, targets, widths = [], 0, 0, []
        for size in sizes:
            micro = completion_batch(
                comps[first : first + size], advantages[first : first + size],
                pad_id=tokenizer.pad_token_id, loss_type=loss_type, max_completion_length=8,
                mask_truncated=True, packed=packed, pad_to=1, layout=packed,
            )  # fmt: skip
            widths.append(micro.batch["input_ids"].shape)
            batch = {k: v.to("cpu") for k, v in micro.batch.items()}  # as the loop moves it
            _, loss = objective.step_loss(SimpleNamespace(norm=1.0), model, batch,
                                          micro.targets)  # fmt: skip
            loss.backward()
            parts.append(loss.item())
            first, targets = first + size, targets + micro.targets
        objective._agreed_maxima.append([-math.inf] * 10)
        sums = objective.take_sums()
        metrics = objective.metrics_from_sums(sums.tolist(), targets)
        grads = torch.cat([p.grad.flatten() / targets for p in model.parameters()])
        return sum(parts) / targets, grads, metrics, widths

    loss, grads, metrics, widths = step([8], packed=False)
    assert len(widths[0]) == 2 and widths[0][0] == 8  # padded: a row per completion
    assert grads.abs().sum() > 0 and metrics["kl"] > 1e-4
    for sizes in ([8], [4, 4], [2, 2, 2, 2], [8, 0]):  # [8, 0]: a rank's filler after its row
        p_loss, p_grads, p_metrics, p_widths = step(sizes, packed=True)
        assert all(w[0] == 1 for w in p_widths), p_widths  # packed: one row per micro-batch
        assert p_loss == pytest.approx(loss, abs=1e-6), sizes
        torch.testing.assert_close(p_grads, grads, atol=1e-6, rtol=0, msg=str(sizes))
        for name in ("entropy", "clip_ratio/region_mean", "trained_tokens", "kl"):
            assert p_metrics[name] == pytest.approx(metrics[name], abs=1e-6), (sizes, name)


# -- asynchronous rollouts (max_staleness >= 1, issue 51) ----- ------------------------------------


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_asynchronous_step_takes_the_engines_log_probs_as_old_ones_as_trl(tiny, trl_trainer):
    """``max_staleness=1`` through the worker objective's `step_loss`: completions sampled by an
    older policy (their engine log-probs a few steps away from the trainer's) are trained with
    those log-probs as the old ones, as TRL's ``AsyncGRPOTrainer`` does, and TRL's default
    importance-sampling correction on (``"sequence_mask"``, its weight ``exp(old - sampling)``
    then 1): the loss, metrics and gradients equal TRL's `_compute_loss` given the same old
    log-probs and TRL's own importance-sampling ratio, within 1e-5; the ratio clips."""
    from types import SimpleNamespace

    from ray_trainer import TrainingArgs
    from ray_trainer._rollout.types import Completion
    from ray_trainer._worker.objectives.grpo import GrpoObjective
    from ray_trainer._worker.objectives.grpo_batch import completion_batch

    path, tokenizer = tiny
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    width = min(map(len, ids))  # prompts of one length: TRL's left padding is no padding
    inputs = step_inputs(tokenizer)
    inputs["prompt_ids"] = torch.tensor([p[:width] for p in ids for _ in range(2)])
    inputs["prompt_mask"] = torch.ones_like(inputs["prompt_ids"])
    policy = load(path)
    sampling = off_policy(policy, inputs, seed=3)  # the engine's, by an older version
    comps = [
        Completion(i // 2, inputs["prompt_ids"][i].tolist(),
                   inputs["completion_ids"][i, :n].tolist(), sampling[i, :n].tolist(), False, 0)
        for i, n in enumerate(LENGTHS)
    ]  # fmt: skip
    micro = completion_batch(comps, ADVANTAGES, pad_id=tokenizer.pad_token_id, loss_type="dapo",
                             max_completion_length=MAX_COMPLETION, mask_truncated=False)  # fmt: skip

    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    grpo = dict(num_generations=2, max_completion_length=MAX_COMPLETION,
                temperature=TEMPERATURE, epsilon_high=0.28)  # fmt: skip
    args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[reward],
                               grpo=grpo, max_staleness=1)  # fmt: skip
    objective = GrpoObjective(args)
    assert objective.config.importance_sampling == "sequence_mask"  # on by default
    policy.train()
    _, loss = objective.step_loss(SimpleNamespace(norm=1.0), policy, micro.batch, micro.targets)
    loss.backward()
    objective._rollout, objective._extremes = [0.0] * 12, [0.0] * 13
    metrics = objective.metrics_from_sums(objective.take_sums().tolist(), micro.targets)
    loss = loss.item() / micro.targets

    # TRL: the same policy and inputs, the engine's log-probs as its old ones, and its
    # importance-sampling ratio as its _generate_and_score_completions computes it
    # (sequence_mask: exp of the completion's summed old - sampling, zeroed above the cap).
    trainer = trl_trainer
    trainer.model.load_state_dict(policy.state_dict())
    mask = inputs["completion_mask"]
    old = torch.where(mask.bool(), sampling, torch.zeros_like(sampling))
    seq_ratio = torch.exp(((old - sampling) * mask).sum(-1, keepdim=True))
    is_ratio = seq_ratio.masked_fill(seq_ratio > 3.0, 0.0).expand_as(sampling)
    assert torch.equal(is_ratio, torch.ones_like(is_ratio))  # nothing left to correct
    trl_loss, trl_metrics = _trl_dapo_loss(trainer, inputs, sampling, is_ratio)
    assert loss == pytest.approx(trl_loss, abs=1e-5)
    _assert_same_metrics(metrics, trl_metrics)
    assert metrics["clip_ratio/region_mean"] > 0  # the stale ratio moved away from 1 and clips
    theirs_grads = dict(trainer.model.named_parameters())
    for name, p in policy.named_parameters():
        torch.testing.assert_close(p.grad / micro.targets, theirs_grads[name].grad, atol=1e-5,
                                   rtol=1e-4, msg=name)  # fmt: skip


def _trl_dapo_loss(trainer, inputs, old_logps, importance_ratio=None):
    """TRL's `_compute_loss` (dapo, beta 0, token level, epsilon 0.2 / 0.28) of `inputs` with
    these old log-probs, and with `importance_ratio` its vLLM importance-sampling correction:
    its loss (backpropagated into the trainer's model) and the metrics it logged."""
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    trainer.loss_type, trainer.beta, trainer.importance_sampling_level = "dapo", 0.0, "token"
    trainer.epsilon_low, trainer.epsilon_high = 0.2, 0.28
    corrected = importance_ratio is not None
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = corrected
    theirs = {k: v for k, v in inputs.items() if k != "full_mask"}
    theirs["old_per_token_logps"] = old_logps
    if corrected:
        theirs["importance_sampling_ratio"] = importance_ratio
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, theirs)
    loss.backward()
    return loss.item(), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _assert_same_metrics(ours, theirs):
    """Every metric TRL logged, ours within 1e-5 (NaN where TRL's is NaN)."""
    for name, value in theirs.items():
        if math.isnan(value):
            assert math.isnan(ours[name]), name
        else:
            assert ours[name] == pytest.approx(value, abs=1e-5), name
