"""GRPO's step, its pure parts (issue 50): completions laid out into micro-batches, the policy's
per-token log-probs read back from them, advantages into rows, the loss's denominator as the
micro-batches' targets (any split exact), the step's metrics from sums, and the prompt ledger's
check on resume. No Ray: the rollouts and rewards are given."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from ray_trainer import TrainingArgs
from ray_trainer._rollout.rewards import group_advantages, nanstd
from ray_trainer._rollout.types import Completion
from ray_trainer._worker.objectives.grpo import GrpoObjective
from ray_trainer._worker.objectives.grpo_batch import (
    PromptDataset,
    batch_advantages,
    completion_batch,
    flat_per_token,
    ledger_error,
    ledger_record,
    loss_targets,
    token_logps,
)
from ray_trainer._worker.objectives.grpo_loss import (
    CompletionTokens,
    grpo_loss,
    importance_ratio,
)

VOCAB = 11


def _completions() -> list[Completion]:
    specs = [([1, 2, 3], [4, 5], False), ([1, 2, 3], [6], False), ([7], [8, 9, 10], True),
             ([7], [2, 3, 4], True)]  # fmt: skip
    return [
        Completion(i // 2, p, c, [-0.1 * (k + 1) for k in range(len(c))], t, 0)
        for i, (p, c, t) in enumerate(specs)
    ]


def test_completions_are_laid_out_right_padded_with_their_rows():
    comps = _completions()
    mb = completion_batch(
        comps, [0.5, -0.5, 1.0, -1.0], pad_id=0, loss_type="dapo", max_completion_length=3,
        mask_truncated=True,
    )  # fmt: skip
    b = mb.batch
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 0], [7, 8, 9, 10, 0],
                                       [7, 2, 3, 4, 0]]  # fmt: skip
    assert b["attention_mask"].sum(1).tolist() == [5, 4, 4, 4]
    assert b["start"].tolist() == [3, 3, 1, 1] and b["length"].tolist() == [2, 1, 3, 3]
    assert b["keep"].tolist() == [1.0, 1.0, 0.0, 0.0]  # truncated ones take no loss
    assert b["advantages"].tolist() == [0.5, -0.5, 1.0, -1.0]
    # The engine's log-probs, flat in the order of the completion tokens.
    assert flat_per_token(b["sampling_logps"], b["length"]).tolist() == pytest.approx(
        [-0.1, -0.2, -0.1, -0.1, -0.2, -0.3, -0.1, -0.2, -0.3]
    )
    assert (mb.tokens, mb.positions, mb.targets) == (17, 20, 3)  # dapo: kept tokens


@pytest.mark.parametrize(
    ("loss_type", "expected"), [("dapo", 3), ("bnpo", 3), ("grpo", 4), ("dr_grpo", 12)]
)
def test_a_micro_batch_counts_its_share_of_the_losss_denominator(loss_type, expected):
    assert loss_targets(loss_type, [2, 1, 3, 3], [True, True, False, False], 3) == expected


def test_the_policys_log_probs_are_read_at_each_completion_token():
    comps = _completions()
    mb = completion_batch(comps, [0.0] * 4, pad_id=0, loss_type="dapo",
                          max_completion_length=3, mask_truncated=False)  # fmt: skip
    logits = torch.randn(4, 5, VOCAB)
    logps, rows, entropy = token_logps(logits, mb.batch, temperature=0.7, entropy=True)
    expected, expected_rows = [], []
    for i, c in enumerate(comps):
        start = len(c.prompt_ids)
        for j, token in enumerate(c.completion_ids):
            scores = (logits[i, start + j - 1] / 0.7).log_softmax(-1)
            expected.append(scores[token].item())
            expected_rows.append(i)
    assert logps.tolist() == pytest.approx(expected, abs=1e-6)
    assert rows.tolist() == expected_rows and entropy.shape == logps.shape
    assert (entropy > 0).all()


def test_batch_scaled_advantages_use_the_agreed_std():
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0, float("nan"), 1.0])
    std = nanstd(rewards).item()
    # One rank holding the whole batch: TRL's batch scaling.
    assert batch_advantages(rewards, 2, std).tolist() == pytest.approx(
        group_advantages(rewards, 2, "batch")[0].tolist()
    )
    assert batch_advantages(rewards, 2, std)[4].item() == 0.0  # unscorable: 0, not NaN


class _Toy(nn.Module):
    """A causal toy LM: logits from each token's embedding and the previous one's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        e = self.emb(input_ids)
        prev = torch.cat([torch.zeros_like(e[:, :1]), e[:, :-1]], dim=1)
        return {"logits": self.head(torch.cat([e, prev], dim=-1))}


def _objective(**grpo) -> GrpoObjective:
    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[reward],
                               grpo=grpo)  # fmt: skip
    objective = GrpoObjective(args)
    objective._rollout, objective._extremes = [0.0] * 10, [0.0] * 8
    return objective


class _Workload:
    norm = 4.0


def _gradient(comps, advantages, splits, options):
    """The step's loss and gradient over micro-batches `splits` of `comps`, scaled as the loop
    scales them (by the targets agreed over the step), and the step's targets."""
    model = _Toy()
    objective = _objective(loss_type=options["loss_type"],
                           max_completion_length=options["max_completion_length"])  # fmt: skip
    total, targets = 0.0, 0
    for part in splits:
        mb = completion_batch([comps[i] for i in part], [advantages[i] for i in part], **options)
        _, loss = objective.step_loss(_Workload(), model, mb.batch, mb.targets)
        loss.backward()
        total, targets = total + loss.item(), targets + mb.targets
    scale = _Workload.norm / max(targets, 1)  # the loop's scaling by the agreed targets
    return total * scale, [p.grad * scale for p in model.parameters()], targets


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_any_split_of_the_step_gives_the_same_loss_and_gradient(loss_type):
    comps = _completions()
    advantages = [0.5, -0.5, 1.0, -1.0]
    options = dict(pad_id=0, loss_type=loss_type, max_completion_length=3, mask_truncated=True)
    whole_loss, whole, _ = _gradient(comps, advantages, [[0, 1, 2, 3]], options)
    split_loss, split, _ = _gradient(comps, advantages, [[0], [1, 2], [3]], options)
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    # One micro-batch holding the whole step: the loss of grpo_loss (TRL's parity lives there).
    model = _Toy()
    mb = completion_batch(comps, advantages, **options)
    logps, rows, _ = token_logps(model(mb.batch["input_ids"])["logits"], mb.batch, 1.0)
    sampling = flat_per_token(mb.batch["sampling_logps"], mb.batch["length"])
    tokens = CompletionTokens(logps=logps, sequence=rows, advantages=mb.batch["advantages"],
                              mask=mb.batch["keep"][rows], sampling_logps=sampling)  # fmt: skip
    ratio = importance_ratio(tokens, "sequence_mask", 3.0)  # TRL's default correction
    expected, _ = grpo_loss(tokens, loss_type=loss_type, max_completion_length=3,
                            importance_sampling_ratio=ratio)  # fmt: skip
    assert whole_loss == pytest.approx(expected.item(), abs=1e-6)


def test_the_steps_metrics_come_from_sums_over_the_ranks():
    objective = _objective()
    rewards = [[1.0, 0.0, 3.0], [2.0, float("nan"), 5.0]]  # two ranks' rewards of one function
    sums = torch.zeros(7 + 10)
    for rank_rewards in rewards:
        r = torch.tensor(rank_rewards)
        ok = r[~torch.isnan(r)]
        part = [3.0, 6.0, 1.0, 0.0, ok.sum().item(), (ok**2).sum().item(), float(ok.numel())]
        part += part[4:7]  # the one function's column is the reward itself
        sums += torch.tensor([0.0] * 7 + part)
    objective._agreed_maxima.append([-math.inf, -math.inf, 4.0, -1.0, 2.0, 0.5, 0.1, 10.0,
                                     3e-7, 2.0])  # fmt: skip
    metrics = objective.metrics_from_sums(sums.tolist(), 6.0)
    every = torch.tensor([1.0, 0.0, 3.0, 2.0, 5.0])
    assert metrics["reward"] == pytest.approx(every.mean().item())
    assert metrics["reward_std"] == pytest.approx(nanstd(every).item())
    assert metrics["rewards/reward/mean"] == pytest.approx(every.mean().item())
    assert metrics["completions/mean_length"] == 2.0
    assert metrics["completions/clipped_ratio"] == 1 / 3
    assert (metrics["completions/min_length"], metrics["completions/max_length"]) == (1.0, 4.0)
    assert metrics["rollout/tokens_per_s"] == 6.0 and metrics["rollout/logprob_diff"] == 3e-7
    assert metrics["sync/bytes"] == 10.0 and "kl" not in metrics  # beta=0: no KL, as TRL
    assert metrics["rollout/engines"] == 2.0  # the engines serving at the step


class _Prompt:
    def __init__(self, ids):
        self.prompt_ids = ids


def test_the_ledger_refuses_a_resume_that_would_skip_or_repeat_prompts():
    prompts = PromptDataset([_Prompt([1, 2]), _Prompt([3])])
    saved = ledger_record(prompts, seed=1, per_step=4, epoch=0, step_in_epoch=3)
    assert ledger_error(None, saved) is None  # a fresh run
    assert ledger_error(saved, dict(saved)) is None
    changed = ledger_record(PromptDataset([_Prompt([1, 2]), _Prompt([4])]), 1, 4, 0, 3)
    assert "the prompts (their tokens or order in the data) changed" in ledger_error(saved, changed)
    assert "the seed" in ledger_error(saved, {**saved, "seed": 2})
    assert "prompts per step" in ledger_error(saved, {**saved, "per_step": 8})
    assert "inconsistent" in ledger_error(saved, {**saved, "step_in_epoch": 2})


def test_beta_takes_the_kl_against_the_model_as_it_started():
    import copy

    comps = _completions()
    mb = completion_batch(comps, [0.5, -0.5, 1.0, -1.0], pad_id=0, loss_type="dapo",
                          max_completion_length=3, mask_truncated=False)  # fmt: skip
    model, objective = _Toy(), _objective(beta=0.1, max_completion_length=3)
    objective.frozen = copy.deepcopy(model).requires_grad_(False)  # after_placement's copy
    objective.step_loss(_Workload(), model, mb.batch, mb.targets)
    sums = objective._sums.tolist()
    assert sums[0] == pytest.approx(0.0, abs=1e-7)  # the same weights: no KL
    with torch.no_grad():
        model.head.bias += 0.5 * torch.arange(VOCAB, dtype=torch.float32)  # the policy moved
    objective._sums = None
    objective.step_loss(_Workload(), model, mb.batch, mb.targets)
    objective._agreed_maxima.append([-math.inf] * 10)
    metrics = objective.metrics_from_sums(objective._sums.tolist() + [0.0] * 10, 9.0)
    assert metrics["kl"] > 1e-3  # beta > 0: TRL's kl, a mean over the completion tokens


def test_num_iterations_repeats_a_rollout_and_a_resume_inside_it_takes_the_rest():
    from types import SimpleNamespace

    from ray_trainer._worker.objectives.grpo import iteration_start

    assert [iteration_start(s, 3) for s in (0, 2, 3, 7)] == [(0, 0), (0, 2), (1, 0), (2, 1)]
    objective = _objective(num_iterations=3, max_completion_length=3)
    objective.prompts = PromptDataset([_Prompt([1, 2]), _Prompt([7])])
    rollouts = []

    def rollout_step(s, prompts):  # a new rollout each loader step (the engines' part)
        rollouts.append(prompts)
        return [completion_batch(_completions(), [0.5, -0.5, 1.0, -1.0], pad_id=0,
                                 loss_type="dapo", max_completion_length=3,
                                 mask_truncated=False)]  # fmt: skip

    objective._start, objective.rollout_step = (lambda s: None), rollout_step
    progress = SimpleNamespace(epoch=0, step_in_epoch=5, global_step=5, extra={})
    starts = []

    def loader_steps(epoch, start):  # 3 loader steps an epoch: 9 optimizer steps
        starts.append(start)
        return iter([[f"prompts of step {i}"] for i in range(start, 3)])

    state = SimpleNamespace(progress=progress, loader=SimpleNamespace(steps=loader_steps,
                            left_out=lambda e: [], per_step=2), args=SimpleNamespace(seed=0))  # fmt: skip
    model, passes = _Toy(), []
    for batches in objective.steps(state, iter([])):  # resumed at step 5: loader step 1, pass 2
        objective.step_loss(_Workload(), model, batches[0].batch, batches[0].targets)
        passes.append((len(rollouts), objective._pass, len(objective._old)))
        objective.take_sums()
        progress.step_in_epoch += 1
        assert progress.extra["grpo_ledger"]["step_in_epoch"] == progress.step_in_epoch
    assert starts == [1] and rollouts == [["prompts of step 1"], ["prompts of step 2"]]
    # Step 1's prompts rolled out again by the restored policy for its last pass (whose old
    # log-probs are then its own), then step 2's three passes: 9 optimizer steps in the epoch.
    assert passes == [(1, 0, 1), (2, 0, 1), (2, 1, 1), (2, 2, 1)]
    assert progress.step_in_epoch == 9


def test_packed_steps_deal_prompts_by_their_completions_budget_and_fillers_take_none():
    from ray_trainer._worker.step.micro_batches import StepLoader

    # 6 prompts; each takes num_generations x (prompt + max_completion_length) tokens packed.
    prompts = PromptDataset([_Prompt([1] * n) for n in (2, 6, 3, 9, 1, 4)], 2, 5)
    assert prompts.lengths.tolist() == [14, 22, 16, 28, 12, 18]
    plans = []
    for rank in (0, 1):
        loader = StepLoader(prompts, world=2, rank=rank, batch_size=3, grad_accum=1, seed=0,
                            pad_id=0, max_tokens=40)  # fmt: skip
        plans.append(next(iter(loader.steps(0))))
    dealt = [[m.batch["prompt_index"].tolist() for m in step] for step in plans]
    every = sorted(i for step in dealt for m in step for i in m)
    assert every == list(range(6))  # each prompt once, over both ranks
    for step in dealt:
        for m in step:  # a micro-batch's completions fit the budget (or a prompt alone)
            assert len(m) == 1 or sum(prompts.lengths[m]) <= 40, m
    assert len(dealt[0]) == len(dealt[1])  # the ranks take as many micro-batches: fillers
    fillers = [m for step in dealt for m in step if not m]
    assert len(fillers) == 1  # 3 rows over 2 ranks: a filler, which holds no prompt (no loss)
    empty = completion_batch([], [], pad_id=0, loss_type="dapo", max_completion_length=5,
                             mask_truncated=False, packed=True)  # fmt: skip
    assert empty.targets == 0 and empty.batch["token_index"].numel() == 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "bnpo"])
def test_tool_result_tokens_take_no_loss_and_any_split_is_exact(loss_type):
    """Multi-turn episodes: ``env_mask`` 0 on tool-result tokens. Any split gives the same loss
    and gradient (1e-6, fp32), the loss is TRL's with ``completion_mask * tool_mask``, and the
    denominator counts sampled tokens only."""
    specs = [([1, 2], [4, 5, 6, 7, 8], [1, 1, 0, 0, 1]), ([1, 2], [6, 3], [1, 1]),
             ([7], [8, 9, 1, 2], [1, 0, 0, 1]), ([7], [2, 3, 4], [1, 1, 1])]  # fmt: skip

    def episodes():
        return [
            Completion(i // 2, p, c, [-0.2 * (k + 1) * m for k, m in enumerate(mask)], False, 0,
                       env_mask=mask)
            for i, (p, c, mask) in enumerate(specs)
        ]  # fmt: skip

    advantages = [0.5, -0.5, 1.0, -1.0]
    options = dict(pad_id=0, loss_type=loss_type, max_completion_length=5, mask_truncated=False)

    whole_loss, whole, targets = _gradient(episodes(), advantages, [[0, 1, 2, 3]], options)
    split_loss, split, _ = _gradient(episodes(), advantages, [[0], [1, 2], [3]], options)
    assert split_loss == pytest.approx(whole_loss, abs=1e-6)
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    if loss_type in ("dapo", "bnpo"):
        assert targets == sum(sum(m) for _, _, m in specs)  # sampled tokens only
    # TRL's loss on the same tokens with its mask: completion_mask * tool_mask.
    model = _Toy()
    mb = completion_batch(episodes(), advantages, **options)
    logps, rows, _ = token_logps(model(mb.batch["input_ids"])["logits"], mb.batch, 1.0)
    mask = mb.batch["keep"][rows] * flat_per_token(mb.batch["env_mask"], mb.batch["length"])
    sampling = flat_per_token(mb.batch["sampling_logps"], mb.batch["length"])
    tokens = CompletionTokens(logps=logps, sequence=rows, advantages=mb.batch["advantages"],
                              mask=mask, sampling_logps=sampling)  # fmt: skip
    ratio = importance_ratio(tokens, "sequence_mask", 3.0)
    expected, _ = grpo_loss(tokens, loss_type=loss_type, max_completion_length=5,
                            importance_sampling_ratio=ratio)  # fmt: skip
    assert whole_loss == pytest.approx(expected.item(), abs=1e-6)
