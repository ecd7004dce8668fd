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

import numpy as np
import torch

from ray_trainer._worker.step.micro_batches import MicroBatch, pack_row

#: The keys of a completion micro-batch besides the model's inputs (a packed one adds
#: ``token_index`` and ``token_sequence``: each completion token's place in the row).
ROW_KEYS = ("start", "length", "advantages", "keep", "sampling_logps", "env_mask")
#: The model's inputs of a completion micro-batch: padded rows have an attention mask, a
#: packed row position ids restarting at each completion (and, with our packed attention,
#: its ``PackedLayout``).
MODEL_KEYS = ("input_ids", "attention_mask", "position_ids", "packed")


class PromptDataset:
    """A run's encoded prompts (``_data.prompts.EncodedPrompt``, in the data's order) as the
    step loader deals them: a micro-batch is the rows of its prompts (``prompt_index``), and
    counts no token until the completions are sampled. With ``packing=True`` the loader packs
    prompts into micro-batches by ``lengths``: the most tokens a prompt's ``num_generations``
    completions can take (prompt + ``max_completion_length`` each), so that a micro-batch's
    completions fit the packed row's budget (``max_tokens_per_batch``)."""

    def __init__(
        self, prompts: Sequence[Any], num_generations: int = 1, max_completion_length: int = 0
    ) -> None:
        self.prompts = list(prompts)
        self.lengths = np.array(
            [num_generations * (len(p.prompt_ids) + max_completion_length) for p in self.prompts],
            dtype=np.int64,
        )

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i: int) -> Any:
        return self.prompts[i]

    def padded(self, ids: list[int]) -> MicroBatch:
        return MicroBatch({"prompt_index": torch.tensor(ids, dtype=torch.long)}, 0, 0, len(ids))

    def packed(self, ids: list[int], pad_to: int, layout: bool) -> MicroBatch:
        """A packed micro-batch's prompts (its completions are packed once sampled:
        :func:`completion_batch`)."""
        return self.padded(ids)

    def fill_filler(self, batch: dict[str, Any]) -> None:
        """A filler micro-batch (a rank with fewer packed micro-batches at this step): no
        prompt, so no completion: a row that takes no loss."""
        batch["prompt_index"] = torch.zeros(0, dtype=torch.long)

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
    packed: bool = False,
    pad_to: int = 1,
    layout: bool = False,
) -> MicroBatch:
    """One micro-batch of completions (``Completion`` records; `advantages` one per record):
    ``input_ids``/``attention_mask`` of prompt + completion, right-padded (`packed`: one row of
    them all, as the loader packs SFT samples: ``position_ids`` restarting at each, padded to
    a multiple of `pad_to`, with `layout` its ``PackedLayout``; and each completion token's
    place in the row, ``token_index``, and its completion, ``token_sequence``); per completion
    ``start`` (its first token's position in its row), ``length``, ``advantages``, ``keep``
    (0: a truncated completion that ``mask_truncated_completions`` drops) and
    ``sampling_logps`` (the engine's, right-padded with 0), and per token ``env_mask`` (0 on
    a multi-turn episode's tool-result tokens, which take no loss and count in no
    denominator; 1 elsewhere, right-padded with 1; only where an episode has one)."""
    n = len(completions)
    seqs = [list(c.prompt_ids) + list(c.completion_ids) for c in completions]
    widest = max([len(c.completion_ids) for c in completions] + [1])
    sampling = torch.zeros((n, widest), dtype=torch.float32)
    for i, c in enumerate(completions):
        if c.logprobs:
            sampling[i, : len(c.logprobs)] = torch.tensor(c.logprobs, dtype=torch.float32)
    lengths = [len(c.completion_ids) for c in completions]
    keep = [not (mask_truncated and c.truncated) for c in completions]
    # A multi-turn episode's tool-result tokens take no loss (``Completion.env_mask``); a
    # single-turn batch carries no mask at all (nothing to multiply in its loss).
    masks = {"env_mask": _env_mask(completions, widest)} if _masked(completions) else {}
    sampled = [
        int(sum(c.env_mask)) if c.env_mask is not None else k
        for c, k in zip(completions, lengths, strict=True)
    ]
    if packed:
        rows = [(np.asarray(s, dtype=np.int64),) * 2 for s in seqs]
        batch, tokens = pack_row(rows, pad_id, pad_to, layout)
        del batch["labels"]  # the loss reads the completion tokens by their place
        offsets = np.cumsum([0] + [len(s) for s in seqs[:-1]]) if seqs else np.zeros(0)
        starts = [int(o) + len(c.prompt_ids) for o, c in zip(offsets, completions, strict=True)]
        batch["token_index"] = torch.tensor(
            [a - 1 + t for a, k in zip(starts, lengths, strict=True) for t in range(k)],
            dtype=torch.long,
        )
        batch["token_sequence"] = torch.repeat_interleave(
            torch.arange(n), torch.tensor(lengths, dtype=torch.long)
        )
        width = batch["input_ids"].shape[1]
        batch.update(
            {
                "start": torch.tensor(starts, dtype=torch.long),
                "length": torch.tensor(lengths, dtype=torch.long),
                "advantages": torch.tensor([float(a) for a in advantages], dtype=torch.float32),
                "keep": torch.tensor(keep, dtype=torch.float32),
                "sampling_logps": sampling,
                **masks,
            }
        )
        targets = loss_targets(loss_type, sampled, keep, max_completion_length)
        return MicroBatch(batch, tokens, width, targets)
    width = max([len(s) for s in seqs] + [2])
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, : len(s)] = 1
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "start": torch.tensor([len(c.prompt_ids) for c in completions], dtype=torch.long),
        "length": torch.tensor(lengths, dtype=torch.long),
        "advantages": torch.tensor([float(a) for a in advantages], dtype=torch.float32),
        "keep": torch.tensor(keep, dtype=torch.float32),
        "sampling_logps": sampling,
        **masks,
    }
    targets = loss_targets(loss_type, sampled, keep, max_completion_length)
    return MicroBatch(batch, sum(len(s) for s in seqs), n * width, targets)


def _masked(completions: Sequence[Any]) -> bool:
    return any(c.env_mask is not None for c in completions)


def _env_mask(completions: Sequence[Any], widest: int) -> torch.Tensor:
    """``[completions, widest]``: each episode's ``env_mask``, 1 elsewhere."""
    mask = torch.ones((len(completions), widest), dtype=torch.float32)
    for i, c in enumerate(completions):
        if c.env_mask is not None:
            mask[i, : len(c.env_mask)] = torch.tensor(c.env_mask, dtype=torch.float32)
    return mask


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
    TRL), flat completion by completion, each token's completion (``sequence``), and with
    `entropy` each position's entropy (no gradient). Differentiable through `logits`. A packed
    row's tokens are read at their ``token_index``."""
    if "token_index" in batch:  # one packed row: completion j's tokens at its places
        at = batch["token_index"]
        scores = logits[0, :-1].index_select(0, at).float() / temperature
        targets = batch["input_ids"][0, 1:].index_select(0, at)
        rows = batch["token_sequence"]
    else:
        where = completion_positions(batch)
        scores = logits[:, :-1][where].float() / temperature
        targets = batch["input_ids"][:, 1:][where]
        rows = torch.arange(where.shape[0], device=where.device)[:, None].expand_as(where)[where]
    logp_all = scores.log_softmax(-1)
    logps = logp_all.gather(-1, targets[:, None])[:, 0]
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
