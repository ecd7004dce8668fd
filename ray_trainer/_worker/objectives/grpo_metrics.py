"""Training worker: what a GRPO step reports, its metrics from sums and its sampled completions.

Runs in each training worker. A step's metrics are computed where its numbers are: each rank
sums its own completions' rewards, lengths and timings (:func:`rollout_sums`,
:func:`rollout_extremes`), the step's agreement adds the sums over the ranks (the extremes are
reduced with MAX), and :func:`step_metrics` turns them into TRL 1.16's names: so ``reward`` and
``reward_std`` are over the whole step, whatever the number of workers. Rank 0 writes a few of
its completions per step to ``<run>/rollouts.jsonl`` (:func:`completion_lines`,
:func:`append_run_file`): through the run's storage, as the callback actor writes
``metrics.jsonl`` (in place on local storage; on a bucket a local working copy uploaded whole).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ray_trainer._worker.objectives.grpo_loss import metrics_from_sums

#: The rollout's sums of a step, after the loss's 7 (``grpo_loss.GrpoSums.sums``), summed over
#: the ranks; then per reward function its sum, sum of squares and count.
ROLLOUT_SUMS = (
    "completions", "completion_tokens", "truncated", "zero_std",
    "reward_sum", "reward_sq", "reward_n",
)  # fmt: skip
#: Multi-turn episodes (``tools``/``environment_factory``): after the per-function sums, these
#: sums of the episodes' counts (``types.EpisodeRecord``), then any asynchronous run's.
AGENT_SUMS = ("tool_calls", "tool_failures", "turns", "prefix_mismatch", "env_seconds", "restarts")

#: The step's extremes, reduced with MAX over the ranks (after the loss's 2).
MAXIMA = (
    "max_length", "neg_min_length", "rollout/seconds", "reward/seconds", "sync/seconds",
    "sync/bytes", "rollout/logprob_diff", "rollout/engines",
)  # fmt: skip
#: Where ``rollout/logprob_diff`` is in :data:`MAXIMA` (a posted sync's is read late).
PROBE_AT = MAXIMA.index("rollout/logprob_diff")
#: Asynchronous (``max_staleness`` >= 1): after the per-function sums, these sums ...
ASYNC_SUMS = ("rollout/stale_dropped", "age_sum")
#: ... and after :data:`MAXIMA`, these extremes (MAX over the ranks; a min as a negated max).
ASYNC_MAXIMA = (
    "rollout/queue_depth", "rollout/age_max", "neg_age_min", "rollout/wait_seconds",
    "neg_overlap_seconds",
)  # fmt: skip


def rollout_sums(scored: Any, functions: int, agents: bool = False) -> list[float]:
    """This rank's sums of :data:`ROLLOUT_SUMS` and each function's, from its scored step
    (``rewards.ScoredStep``); unscorable (NaN) rewards left out, as TRL; with `agents`, the
    episodes' :data:`AGENT_SUMS` after them."""
    lengths = [len(x.completion_ids) for x in scored.completions]
    rewards = scored.rewards
    ok = rewards[~torch.isnan(rewards)]
    zero_std = scored.metrics["frac_reward_zero_std"] * len(lengths)
    sums = [
        float(len(lengths)), float(sum(lengths)),
        float(sum(bool(x.truncated) for x in scored.completions)), float(zero_std),
        ok.sum().item(), (ok**2).sum().item(), float(ok.numel()),
    ]  # fmt: skip
    for i in range(functions):
        col = scored.per_function[:, i]
        col = col[~torch.isnan(col)]
        sums += [col.sum().item(), (col**2).sum().item(), float(col.numel())]
    if agents:
        episodes = [x.episode for x in scored.completions if x.episode is not None]
        sums += [float(sum(getattr(e, k) for e in episodes)) for k in AGENT_SUMS]
    return sums


def rollout_extremes(
    scored: Any, rollout_s: float, reward_s: float, sync: dict[str, float], engines: int = -1
) -> list[float]:
    """This rank's :data:`MAXIMA` (``-inf``: none this step, e.g. no sync); `engines`: the
    rollout engines serving after the step's rollout (-1: unknown)."""
    lengths = [len(x.completion_ids) for x in scored.completions]
    return [
        float(max(lengths, default=0)), -float(min(lengths, default=0)), rollout_s, reward_s,
        sync.get("sync/seconds", -math.inf), sync.get("sync/bytes", -math.inf),
        sync.get("rollout/logprob_diff", -math.inf),
        float(engines) if engines >= 0 else -math.inf,
    ]  # fmt: skip


def async_sums(
    ages: Sequence[int], taken: Any, wait_s: float, in_flight: int
) -> tuple[list[float], list[float]]:
    """This rank's :data:`ASYNC_SUMS` and :data:`ASYNC_MAXIMA` of an asynchronous step: the
    ages of its trained completions, what its request gave (``_rollout/queue.Taken``), the
    trainer's wait for it and the requests left in flight after the step's."""
    sums = [float(taken.dropped), float(sum(ages))]
    extremes = [
        float(in_flight), float(max(ages, default=0)), -float(min(ages, default=0)), wait_s,
        -taken.overlap_s,
    ]  # fmt: skip
    return sums, extremes


def step_metrics(
    values: Sequence[float],
    extremes: Sequence[float],
    functions: Sequence[str],
    config: Any,
    restarts: int = 0,
    asynchronous: bool = False,
    agents: bool = False,
) -> dict[str, float]:
    """The step's metrics, with TRL's names, from its sums over the ranks (the loss's 7, then
    :data:`ROLLOUT_SUMS`, then 3 per reward function) and its extremes (the loss's 2, then
    :data:`MAXIMA`); `restarts`: rollout engines started again so far; `asynchronous`
    (``max_staleness`` >= 1): the queue's sums and extremes follow; `agents`: multi-turn
    episodes, :data:`AGENT_METRICS` added."""
    out = metrics_from_sums(
        list(values[:7]), list(extremes[:2]), beta=config.beta,
        importance_sampling_level=config.importance_sampling_level,
    )  # fmt: skip
    r = dict(zip(ROLLOUT_SUMS, values[7 : 7 + len(ROLLOUT_SUMS)], strict=True))
    n = max(r["completions"], 1.0)
    mx = dict(zip(MAXIMA, extremes[2 : 2 + len(MAXIMA)], strict=True))
    out.update(
        {
            "reward": _mean(r["reward_sum"], r["reward_n"]),
            "reward_std": _std(r["reward_sum"], r["reward_sq"], r["reward_n"]),
            "frac_reward_zero_std": r["zero_std"] / n,
            "completions/mean_length": r["completion_tokens"] / n,
            "completions/min_length": -mx["neg_min_length"],
            "completions/max_length": mx["max_length"],
            "completions/clipped_ratio": r["truncated"] / n,
        }
    )
    at = 7 + len(ROLLOUT_SUMS)
    for i, name in enumerate(functions):
        total, sq, count = values[at + 3 * i : at + 3 * i + 3]
        out[f"rewards/{name}/mean"] = _mean(total, count)
        out[f"rewards/{name}/std"] = _std(total, sq, count)
    at += 3 * len(functions)
    if agents:
        out.update(_agent_metrics(values[at : at + len(AGENT_SUMS)], n))
        at += len(AGENT_SUMS)
    out["rollout/seconds"] = mx["rollout/seconds"]
    out["rollout/tokens_per_s"] = r["completion_tokens"] / max(mx["rollout/seconds"], 1e-9)
    out["reward/seconds"] = mx["reward/seconds"]
    for name in ("sync/seconds", "sync/bytes", "rollout/logprob_diff", "rollout/engines"):
        if mx[name] != -math.inf:  # a step without a sync has none
            out[name] = mx[name]
    if restarts:
        out["rollout/engine_restarts"] = float(restarts)
    if asynchronous:
        out.update(_async_metrics(values[at:], extremes[2 + len(MAXIMA) :], n))
    return out


def _agent_metrics(values: Sequence[float], n: float) -> dict[str, float]:
    """A multi-turn step's metrics (``_objectives.grpo.AGENT_METRICS``) from its sums over the
    ranks (`n`: the step's episodes)."""
    a = dict(zip(AGENT_SUMS, values, strict=True))
    calls = a["tool_calls"]
    return {
        "tools/call_frequency": calls / n,
        "tools/failure_frequency": a["tool_failures"] / calls if calls else 0.0,
        "episodes/turns_mean": a["turns"] / n,
        "env/seconds": a["env_seconds"] / n,
        "rollout/prefix_mismatch": a["prefix_mismatch"],
        "episodes/restarts": a["restarts"],
    }


def _async_metrics(values: Sequence[float], extremes: Sequence[float], n: float) -> dict:
    """The queue's metrics of an asynchronous step, from its sums and extremes over the ranks
    (`n`: the step's trained completions)."""
    a = dict(zip(ASYNC_SUMS, values, strict=True))
    mx = dict(zip(ASYNC_MAXIMA, extremes, strict=True))
    return {
        "rollout/queue_depth": mx["rollout/queue_depth"],
        "rollout/age_min": -mx["neg_age_min"],
        "rollout/age_mean": a["age_sum"] / n,
        "rollout/age_max": mx["rollout/age_max"],
        "rollout/stale_dropped": a["rollout/stale_dropped"],
        "rollout/wait_seconds": mx["rollout/wait_seconds"],
        "rollout/overlap_seconds": -mx["neg_overlap_seconds"],
    }


def completion_lines(
    scored: Any,
    advantages: torch.Tensor,
    step: int,
    prompts: Any,
    decode: Callable[[list[int]], str],
    functions: Sequence[str],
    keep: int,
) -> list[str]:
    """The first `keep` completions of a scored step as ``rollouts.jsonl`` lines: the step
    (1-based, as the logs count it), the policy version that sampled it (its first token's, and
    ``[position, version]`` where newer weights took over during its decoding), the prompt, the
    completion's text, each function's reward (None: it abstained), the reward, the advantage;
    a multi-turn episode's messages (its turns with their tool calls, the tool results), turns,
    tool calls, failed calls and restarts after faults."""
    lines = []
    for i, comp in enumerate(scored.completions[:keep]):
        record = {
            "step": step + 1,
            "version": comp.version,
            "newer_versions": [list(change) for change in comp.newer_versions],
            "prompt_index": comp.prompt_index,
            "prompt": prompts[comp.prompt_index].prompt,
            "completion": decode(list(comp.completion_ids)),
            "rewards": {
                name: _finite(scored.per_function[i, j].item()) for j, name in enumerate(functions)
            },
            "reward": _finite(scored.rewards[i].item()),
            "advantage": float(advantages[i]),
            "truncated": bool(comp.truncated),
        }
        if comp.episode is not None:  # a multi-turn episode: its whole conversation
            e = comp.episode
            record.update(
                messages=e.messages, turns=e.turns, tool_calls=e.tool_calls,
                tool_failures=e.tool_failures, restarts=e.restarts,
            )  # fmt: skip
        lines.append(json.dumps(record, default=str))
    return lines


def append_run_file(target: Any, lines: list[str], work_dir: str | None) -> str | None:
    """Append `lines` to `target` (a ``Location`` in the run folder): in place on local
    storage; on a bucket to a local working copy in `work_dir` (made on first use), uploaded
    whole (an object store cannot append). Returns the working folder (None: local)."""
    if target.is_local:
        os.makedirs(os.path.dirname(target.path), exist_ok=True)
        path = target.path
    else:
        work_dir = work_dir or tempfile.mkdtemp(prefix="ray_trainer_run_files_")
        path = os.path.join(work_dir, target.basename)
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))
    if not target.is_local:
        target.upload(path)
    return work_dir


def _mean(total: float, count: float) -> float:
    return total / count if count else math.nan


def _std(total: float, sq: float, count: float) -> float:
    """The std with Bessel's correction from sums (NaN with fewer than two), as TRL's."""
    if count < 2:
        return math.nan
    return math.sqrt(max(sq - total * total / count, 0.0) / (count - 1))


def _finite(x: float) -> float | None:
    return None if math.isnan(x) else x
