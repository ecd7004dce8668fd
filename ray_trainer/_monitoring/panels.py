"""Anywhere (pure data): the panels of a ray-trainer run, one list for every place that draws them.

The Grafana dashboard (`dashboard.py`), `ray-trainer plot` and the Prometheus integration test
all read `PANELS`: a panel's PromQL is what Grafana runs and what the test evaluates against a
real Prometheus; its `jsonl` fields are what `ray-trainer plot` draws from a run's
``metrics.jsonl`` when it has no Prometheus. A metric renamed in `RayMetrics` but not here fails
that test (and, for the RL row's panels, the unit test of the names a GRPO run exports).

A panel on a row of its own (`Panel.row`: GRPO's, `RL_ROW`) shows what only some runs log: the
dashboard draws those panels under that row's header, and `plot` leaves a row's panels out of a
run that has none of their data.

Exported names (``RayMetrics``' default prefix ``ray_trainer``; every series has a ``run``
label), following Prometheus's naming: counters end in ``_total``, units are base units in the
name (``_seconds``, ``_per_second``, ``_ratio``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "EVAL_PREFIX", "EVAL_VARIABLE", "PANELS", "RL_ROW", "RUN_VARIABLE", "Panel", "Series",
    "jsonl_fields", "promql_string", "substitute",
]  # fmt: skip

#: The dashboard variable holding the run (a Grafana multi-value variable, hence ``=~``).
RUN_VARIABLE = "run"
#: The variable the evaluation panel repeats over: one metric name ``ray_trainer_eval_*`` each.
EVAL_VARIABLE = "eval_metric"
#: Every evaluation metric is exported under this name prefix (``ray_trainer_eval_accuracy``).
EVAL_PREFIX = "ray_trainer_eval_"

_RUN = f'run=~"${RUN_VARIABLE}"'
#: One evaluation metric of the run: the repeating panel's query, one copy per metric name.
_EVAL_SELECTOR = f'{{__name__=~"${EVAL_VARIABLE}", {_RUN}}}'


@dataclass(frozen=True)
class Series:
    """One line of a panel: its legend, its PromQL (with ``$run``), and the ``metrics.jsonl``
    field that holds the same figure (None: only Prometheus has it), read from the records of
    `event`. A field with ``*`` (``rewards/*/mean``) is a pattern: one line per field that
    matches it, ``*`` standing for one name without ``/`` (a reward function's)."""

    legend: str
    expr: str
    jsonl: str | None = None
    event: str = "on_log"


@dataclass(frozen=True)
class Panel:
    """One panel: title, Grafana unit id, description, its series; `repeat` names the variable
    it repeats over (one copy of the panel per value); `row` is the title of the dashboard row
    it sits under (None: the rows on top, which every run fills)."""

    title: str
    unit: str
    description: str
    series: tuple[Series, ...]
    repeat: str | None = None
    row: str | None = None


def _gauge(name: str) -> str:
    return f"ray_trainer_{name}{{{_RUN}}}"


#: The row of GRPO's panels: what only an ``objective="grpo"`` run logs.
RL_ROW = 'RL: GRPO (objective="grpo")'


def _gauges(pattern: str) -> str:
    """Every gauge whose name matches `pattern` (a PromQL regex after the prefix)."""
    return f'{{__name__=~"ray_trainer_{pattern}", {_RUN}}}'


def _counter(name: str, by: str | None = None) -> str:
    total = f"ray_trainer_{name}_total{{{_RUN}}}"
    return f"sum by (run, {by}) ({total})" if by else f"sum by (run) ({total})"


PANELS: tuple[Panel, ...] = (
    Panel(
        "Step",
        "none",
        "The global optimizer step.",
        (Series("step", _gauge("step"), "step"),),
    ),
    Panel(
        "Loss",
        "none",
        "Training loss (cross-rank average) at each log, and the validation loss at each "
        "in-loop evaluation.",
        (
            Series("loss", _gauge("loss"), "loss"),
            Series("validation loss", _gauge("val_loss"), "val_loss", "on_evaluate"),
        ),
    ),
    Panel(
        "Learning rate",
        "none",
        "The learning rate at each log.",
        (Series("learning rate", _gauge("learning_rate"), "learning_rate"),),
    ),
    Panel(
        "Tokens/s",
        "none",
        "Training throughput over the steps since the last log: tokens that are not padding, "
        "every rank together.",
        (Series("tokens/s", _gauge("tokens_per_second"), "tokens_per_s"),),
    ),
    Panel(
        "MFU",
        "percentunit",
        "Model FLOPs utilisation over the steps since the last log (where the device's peak is "
        "known: a known GPU, or peak_flops set).",
        (Series("MFU", _gauge("mfu_ratio"), "mfu"),),
    ),
    Panel(
        "Gradient norm",
        "none",
        "The global gradient norm before clipping, at each log.",
        (Series("grad norm", _gauge("grad_norm"), "grad_norm"),),
    ),
    Panel(
        "Evaluation: $eval_metric",
        "none",
        "Each evaluation metric (in-loop validation, EvalOnSave, LmEval, GenerationEval), one "
        "panel per metric name.",
        (Series("{{__name__}}", _EVAL_SELECTOR, "val_metrics", "on_evaluate"),),
        repeat=EVAL_VARIABLE,
    ),
    Panel(
        "Save to evaluation result",
        "s",
        "Seconds from an EvalOnSave checkpoint's save to its metrics.",
        (
            Series(
                "seconds after save",
                _gauge("save_to_eval_seconds"),
                "seconds_after_save",
                "on_evaluate",
            ),
        ),
    ),
    Panel(
        "Workers",
        "none",
        "Training workers of the current attempt: an elastic run's size over time.",
        (Series("workers", _gauge("workers"), "world_size"),),
    ),
    Panel(
        "Callback events",
        "none",
        "Events the callbacks handled and dropped (low-value events dropped when the queue to "
        "the callback actor is full), and callback errors.",
        (
            Series("handled {{event}}", _counter("events_handled", "event")),
            Series("dropped {{event}}", _counter("events_dropped", "event")),
            Series("callback errors", _counter("callback_errors")),
        ),
    ),
    Panel(
        "Checkpoints saved",
        "none",
        "Checkpoints saved so far (complete on storage).",
        (Series("checkpoints", _counter("checkpoints_saved"), "checkpoint_path", "on_save"),),
    ),
    # ---- GRPO (objective="grpo"): RayMetrics exports the objective's metrics, "/" as "_" ----
    Panel(
        "Reward",
        "none",
        "GRPO: the mean reward of each step's completions (the reward functions' weighted "
        "sum), its standard deviation, and each reward function's mean.",
        (
            Series("reward", _gauge("reward"), "reward"),
            Series("reward std", _gauge("reward_std"), "reward_std"),
            Series("{{__name__}}", _gauges("rewards_.+_mean"), "rewards/*/mean"),
        ),
        row=RL_ROW,
    ),
    Panel(
        "Completion length",
        "none",
        "GRPO: the mean length in tokens of each step's sampled completions.",
        (Series("mean length", _gauge("completions_mean_length"), "completions/mean_length"),),
        row=RL_ROW,
    ),
    Panel(
        "Truncated completions",
        "percentunit",
        "GRPO: the share of each step's completions cut at max_completion_length without an "
        "end token (TRL's completions/clipped_ratio).",
        (
            Series(
                "clipped ratio", _gauge("completions_clipped_ratio"), "completions/clipped_ratio"
            ),
        ),
        row=RL_ROW,
    ),
    Panel(
        "KL",
        "none",
        "GRPO with beta > 0: the KL of the policy against the model as it started, over the "
        "step's completion tokens.",
        (Series("kl", _gauge("kl"), "kl"),),
        row=RL_ROW,
    ),
    Panel(
        "Rollout tokens/s",
        "none",
        "GRPO: completion tokens sampled per second of the step's rollout (its slowest worker's).",
        (Series("rollout tokens/s", _gauge("rollout_tokens_per_s"), "rollout/tokens_per_s"),),
        row=RL_ROW,
    ),
    Panel(
        "Rollout, reward and sync seconds",
        "s",
        "GRPO: each step's seconds sampling completions (the slowest worker's), scoring them "
        "(the reward tasks) and syncing the weights into the engines (a step with a sync).",
        (
            Series("rollout", _gauge("rollout_seconds"), "rollout/seconds"),
            Series("reward", _gauge("reward_seconds"), "reward/seconds"),
            Series("sync", _gauge("sync_seconds"), "sync/seconds"),
        ),
        row=RL_ROW,
    ),
    Panel(
        "Engine against trainer log-probs",
        "none",
        "GRPO: after each weight sync, the largest per-token difference between the engine's "
        "log-probs of a fixed probe completion and the trainer's (0 for hf in fp32; a jump "
        "means a sync missed a weight or the engine's numbers drifted).",
        (Series("logprob diff", _gauge("rollout_logprob_diff"), "rollout/logprob_diff"),),
        row=RL_ROW,
    ),
    Panel(
        "Rollout engines",
        "none",
        "GRPO: the rollout engines serving at each step (rollout_workers=(min, max): a lost "
        "engine leaves at once and its replacement joins once placed and loaded).",
        (Series("engines", _gauge("rollout_engines"), "rollout/engines"),),
        row=RL_ROW,
    ),
    Panel(
        "Rollout queue (asynchronous)",
        "none",
        "GRPO with max_staleness >= 1: the rollout requests still in flight after each step "
        "(its slowest worker's queue, in steps), and the completions dropped as more than "
        "max_staleness versions old (their prompts sampled again).",
        (
            Series("queue depth", _gauge("rollout_queue_depth"), "rollout/queue_depth"),
            Series("stale dropped", _gauge("rollout_stale_dropped"), "rollout/stale_dropped"),
        ),
        row=RL_ROW,
    ),
    Panel(
        "Completion age (asynchronous)",
        "none",
        "GRPO with max_staleness >= 1: how many policy versions the step's trained completions "
        "lag the trainer (least, mean, most; at most max_staleness).",
        (
            Series("age min", _gauge("rollout_age_min"), "rollout/age_min"),
            Series("age mean", _gauge("rollout_age_mean"), "rollout/age_mean"),
            Series("age max", _gauge("rollout_age_max"), "rollout/age_max"),
        ),
        row=RL_ROW,
    ),
    Panel(
        "Trainer wait and hidden generation (asynchronous)",
        "s",
        "GRPO with max_staleness >= 1: the seconds the trainer waited for the step's rollout, "
        "and the seconds of its generation that ran while the step before trained.",
        (
            Series("wait", _gauge("rollout_wait_seconds"), "rollout/wait_seconds"),
            Series("hidden", _gauge("rollout_overlap_seconds"), "rollout/overlap_seconds"),
        ),
        row=RL_ROW,
    ),
)


def jsonl_fields(series: Series, fields: set[str] | list[str]) -> list[str]:
    """The ``metrics.jsonl`` fields among `fields` that `series` draws: its field, or each that
    matches its pattern (sorted)."""
    if series.jsonl is None:
        return []
    if "*" not in series.jsonl:
        return [series.jsonl] if series.jsonl in fields else []
    pattern = re.compile("[^/]+".join(re.escape(p) for p in series.jsonl.split("*")))
    return sorted(f for f in fields if pattern.fullmatch(f))


def promql_string(text: str) -> str:
    """``text`` as an exact match inside a PromQL ``=~"..."`` (regex characters escaped)."""
    return re.sub(r"([.+*?()\[\]{}|^$\\])", r"\\\\\1", text)


def substitute(expr: str, run: str, eval_metric: str | None = None) -> str:
    """A panel's PromQL with the dashboard's variables replaced for one run."""
    expr = expr.replace(f"${RUN_VARIABLE}", promql_string(run))
    if eval_metric is not None:
        expr = expr.replace(f"${EVAL_VARIABLE}", promql_string(eval_metric))
    return expr
