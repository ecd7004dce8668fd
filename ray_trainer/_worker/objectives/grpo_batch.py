"""Training worker: GRPO's micro-batches, laid out from sampled completions (pure, no Ray).

Runs in each training worker. A step's loader deals this rank its prompts (``PromptDataset``:
each micro-batch a list of prompt rows); once the rollout engines have sampled
``num_generations`` completions of each prompt and the rewards have become advantages, each
micro-batch of prompts becomes one of completions (:func:`completion_batch`): its prompt +
completion rows right-padded, with per row where the completion starts and how long it is, its
advantage, whether it takes the loss, and the engine's per-token log-probs. :func:`token_logps`
reads the policy's per-token log-probs of the completion tokens back out of the model's logits,
flat in the order ``grpo_loss.CompletionTokens`` takes them.

The micro-batch's ``targets`` is what it adds to the loss's denominator (TRL's normalisation of
``loss_type``, ``grpo_loss.denominator``), so that the loop's usual scaling of the gradients by
the step's summed targets makes any split over micro-batches and ranks exact.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ray_trainer._worker.step.micro_batches import MicroBatch

#: The keys of a completion micro-batch besides the model's inputs.
ROW_KEYS = ("start", "length", "advantages", "keep", "sampling_logps")


class PromptDataset:
    """A run's encoded prompts (``_data.prompts.EncodedPrompt``, in the data's order) as the
    step loader deals them: a micro-batch is the rows of its prompts (``prompt_index``), and
    counts no token until the completions are sampled."""

    def __init__(self, prompts: Sequence[Any]) -> None:
        self.prompts = list(prompts)

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Any:
        return self.prompts[i]

    def padded(self, ids: list[int]) -> MicroBatch:
        return MicroBatch({"prompt_index": torch.tensor(ids, dtype=torch.long)}, 0, 0, len(ids))

    def digest(self) -> str:
        """What identifies the prompts' tokens, in order (the ledger's check on resume)."""
        h = hashlib.sha256()
        for p in self.prompts:
            h.update(len(p.prompt_ids).to_bytes(4, "little"))
            h.update(b"".join(int(t).to_bytes(4, "little") for t in p.prompt_ids))
        return h.hexdigest()[:16]


def loss_targets(loss_type: str, lengths: Sequence[int], keep: Sequence[bool], max_len: int) -> int:
    """What a micro-batch adds to the step's loss denominator (``grpo_loss.denominator``):
    its completion tokens that take the loss (``"dapo"``, ``"bnpo"``), its completions
    (``"grpo"``), or its completions times ``max_completion_length`` (``"dr_grpo"``)."""
    if loss_type in ("dapo", "bnpo"):
        return int(sum(n for n, k in zip(lengths, keep, strict=True) if k))
    if loss_type == "grpo":
        return len(lengths)
    if loss_type == "dr_grpo":
        return len(lengths) * max_len
    raise ValueError(f"unknown grpo.loss_type {loss_type!r}")


def completion_batch(
    completions: Sequence[Any],
    advantages: Sequence[float],
    *,
    pad_id: int,
    loss_type: str,
    max_completion_length: int,
    mask_truncated: bool,
) -> MicroBatch:
    """One micro-batch of completions (``Completion`` records; `advantages` one per record):
    ``input_ids``/``attention_mask`` of prompt + completion, right-padded; per row ``start``
    (the first completion token's position), ``length``, ``advantages``, ``keep`` (0: a
    truncated completion that ``mask_truncated_completions`` drops) and ``sampling_logps``
    (the engine's, right-padded with 0)."""
    n = len(completions)
    seqs = [list(c.prompt_ids) + list(c.completion_ids) for c in completions]
    width = max([len(s) for s in seqs] + [2])
    widest = max([len(c.completion_ids) for c in completions] + [1])
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    sampling = torch.zeros((n, widest), dtype=torch.float32)
    for i, (c, s) in enumerate(zip(completions, seqs, strict=True)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
        if c.logprobs:
            sampling[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    lengths = [len(c.completion_ids) for c in completions]
    keep = [not (mask_truncated and c.truncated) for c in completions]
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "start": torch.tensor([len(c.prompt_ids) for c in completions], dtype=torch.long),
        "length": torch.tensor(lengths, dtype=torch.long),
        "advantages": torch.tensor([float(a) for a in advantages], dtype=torch.float32),
        "keep": torch.tensor(keep, dtype=torch.float32),
        "sampling_logps": sampling,
    }
    targets = loss_targets(loss_type, lengths, keep, max_completion_length)
    return MicroBatch(batch, sum(len(s) for s in seqs), n * width, targets)


def completion_positions(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows, width - 1]`` bool: where the shifted logits predict a completion token
    (position ``t`` predicts token ``t + 1``)."""
    width = batch["input_ids"].shape[1]
    t = torch.arange(width - 1, device=batch["start"].device)[None, :]
    first = batch["start"][:, None] - 1
    return (t >= first) & (t < first + batch["length"][:, None])


def token_logps(
    logits: torch.Tensor, batch: dict[str, torch.Tensor], temperature: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The completion tokens' log-probabilities at `temperature` (logits divided by it, as
    TRL), flat row by row, each token's row (``sequence``), and with `entropy` each position's
    entropy (no gradient). Differentiable through `logits`."""
    where = completion_positions(batch)
    scores = logits[:, :-1][where].float() / temperature
    targets = batch["input_ids"][:, 1:][where]
    logp_all = scores.log_softmax(-1)
    logps = logp_all.gather(-1, targets[:, None])[:, 0]
    rows = torch.arange(where.shape[0], device=where.device)[:, None].expand_as(where)[where]
    ent = None
    if entropy:
        with torch.no_grad():
            ent = -(logp_all.exp() * logp_all).sum(-1)
    return logps, rows, ent


def flat_per_token(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """A right-padded ``[rows, L]`` per-token tensor (the engine's log-probs), flat in
    :func:`token_logps`' order: each row's first ``length`` values."""
    j = torch.arange(values.shape[1], device=values.device)[None, :]
    return values[j < lengths[:, None]]


def batch_advantages(rewards: torch.Tensor, num_generations: int, std: float) -> torch.Tensor:
    """``scale_rewards="batch"``: each reward minus its group's mean, over the global batch's
    reward std (`std`, agreed over the ranks) plus 1e-4, as TRL; an unscorable (NaN) reward
    gets 0."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    return torch.nan_to_num((rewards - mean) / (std + 1e-4), nan=0.0)


def ledger_record(
    prompts: PromptDataset, seed: int, per_step: int, epoch: int, step_in_epoch: int
) -> dict[str, Any]:
    """What a checkpoint records of the prompts consumed: the prompts' identity, the order's
    seed, the prompts a step takes, and the position (epoch, steps taken in it) its training
    reached; the loader's seeded epoch order turns these into the prompts trained on."""
    return {
        "prompts": len(prompts),
        "digest": prompts.digest(),
        "seed": seed,
        "per_step": per_step,
        "epoch": epoch,
        "step_in_epoch": step_in_epoch,
    }


def ledger_error(saved: dict[str, Any] | None, now: dict[str, Any]) -> str | None:
    """Why a run resumed at `now` (its :func:`ledger_record`) would skip or repeat prompts
    against the checkpoint's `saved` one, or None when it continues exactly where it was."""
    if saved is None:
        return None
    for key, what in (
        ("digest", "the prompts (their tokens or order in the data) changed"),
        ("prompts", "the number of prompts changed"),
        ("seed", "the seed (the prompts' order) changed"),
        ("per_step", "the prompts per step (batch_size x grad_accum_steps x num_workers) changed"),
    ):
        if saved.get(key) != now.get(key):
            return (
                f"grpo: the checkpoint's prompt ledger does not match this run: {what} "
                f"({saved.get(key)!r} then, {now.get(key)!r} now), so resuming would skip or "
                "repeat prompts; resume with the data, seed and batch settings it was trained "
                "with, or start a new run_name"
            )
    if (saved["epoch"], saved["step_in_epoch"]) != (now["epoch"], now["step_in_epoch"]):
        return (
            f"grpo: the checkpoint's prompt ledger is at epoch {saved['epoch']} step "
            f"{saved['step_in_epoch']}, its trainer state at epoch {now['epoch']} step "
            f"{now['step_in_epoch']}; the checkpoint is inconsistent: resume from another one"
        )
    return None
