"""Every process: the description of GRPO (online RL on sampled completions) and its settings.

GRPO trains on prompt-only records (``{"prompt": ...}``, ``ray_trainer/_data/prompts.py``): each
step samples ``num_generations`` completions per prompt from rollout engines, scores them with
reward functions (``ray_trainer/_rollout/rewards.py``), turns the rewards into group-relative
advantages, and takes TRL 1.16's clipped policy loss on them
(``ray_trainer/_worker/objectives/grpo_loss.py``). Its settings are one nested config,
:class:`GrpoConfig`, with the names and defaults of TRL 1.16's ``GRPOConfig``.

:data:`GRPO` is registered beside SFT and DPO (``ray_trainer/_objectives/__init__.py``); its
``TrainingArgs`` fields are ``grpo`` (validated by :meth:`GrpoConfig.coerce`), ``reward_fns``,
``reward_weights``, ``reward_resources``, ``reward_timeout_s`` and the rollout engines'
``rollout_*``; its worker module is
``ray_trainer/_worker/objectives/grpo.py`` (the step: rollouts, rewards, the loss).
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ray_trainer._errors import TrainingArgsError
from ray_trainer._objectives.base import Beside, Objective

#: The policy losses, each as TRL 1.16's ``GRPOTrainer._compute_loss`` computes it.
LOSS_TYPES = ("dapo", "grpo", "dr_grpo", "bnpo")
#: How rewards become advantages (TRL's ``scale_rewards``).
SCALE_REWARDS = ("group", "batch", "none")
#: The engine/trainer log-prob mismatch correction (TRL's ``vllm_importance_sampling_mode``).
IMPORTANCE_SAMPLING = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate")

#: The metrics of a GRPO step computed by the loss on the workers (TRL's names), in the order
#: of the worker's metric sums; ``trained_tokens`` (ours) counts the completion tokens the loss
#: was taken on, 0 when every completion was masked (``mask_truncated_completions``).
LOSS_METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "trained_tokens",
)
#: The metrics of a GRPO step computed from its completions and rewards (TRL's names), before
#: the loss; ``rewards/<fn>/mean`` and ``rewards/<fn>/std`` follow, per reward function.
ROLLOUT_METRICS = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
)
#: Timings and checks of the rollout side (ours), logged by the step.
ROLLOUT_TIMINGS = (
    "rollout/tokens_per_s",
    "rollout/seconds",
    "reward/seconds",
    "sync/seconds",
    "sync/bytes",
    "rollout/logprob_diff",
    "rollout/engines",
)
#: What an asynchronous run (``max_staleness`` >= 1) logs besides: the rollout requests
#: in flight after the step's (its queue depth, in steps), the age of the trained completions
#: (the trainer's version minus the one that sampled each), the completions dropped as too old,
#: the trainer's wait for its rollout and the generation hidden behind the previous step.
ASYNC_METRICS = (
    "rollout/queue_depth",
    "rollout/age_min",
    "rollout/age_mean",
    "rollout/age_max",
    "rollout/stale_dropped",
    "rollout/wait_seconds",
    "rollout/overlap_seconds",
)

#: What a multi-turn run (``tools`` or ``environment_factory``) logs besides: TRL's tool-call
#: frequency (calls per episode) and failure frequency (calls that raised, per call), then
#: ours: assistant turns per episode, seconds an episode waited for its environment (mean),
#: turns whose input did not come back from the engine as sent (must stay 0), and episodes
#: started again on a fresh environment after an infrastructure fault.
AGENT_METRICS = (
    "tools/call_frequency",
    "tools/failure_frequency",
    "episodes/turns_mean",
    "env/seconds",
    "rollout/prefix_mismatch",
    "episodes/restarts",
)

#: TRL ``GRPOConfig`` names that ray-trainer calls otherwise, and the name to use.
_RENAMED = {
    "vllm_importance_sampling_mode": "importance_sampling",
    "vllm_importance_sampling_correction": "importance_sampling (None turns it off)",
    "vllm_importance_sampling_cap": "importance_sampling_cap",
    "vllm_importance_sampling_clip_max": "importance_sampling_cap",
    "vllm_importance_sampling_clip_min": "importance_sampling_min",
}
#: TRL ``GRPOConfig`` names that are TrainingArgs fields here (or will be, with the loop).
_ELSEWHERE = {
    "reward_funcs": "reward_fns",
    "learning_rate": "learning_rate",
    "per_device_train_batch_size": "batch_size",
    "gradient_accumulation_steps": "grad_accum_steps",
    "max_prompt_length": "max_length (prompt + completion)",
    "use_vllm": "rollout_backend",
    "reward_weights": "reward_weights",
    "vllm_mode": "rollout_backend",
}
_TRL_UNSUPPORTED = (
    "delta", "top_entropy_quantile", "entropy_coef", "use_adaptive_entropy",
    "off_policy_mask_threshold", "multi_objective_aggregation", "sapo_temperature_neg",
    "sapo_temperature_pos", "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "num_generations_eval", "generation_batch_size", "steps_per_generation", "min_p",
    "repetition_penalty", "generation_kwargs", "use_bias_correction_kl", "cast_lm_head_to_fp32",
)  # fmt: skip


class GrpoConfig(BaseModel):
    """GRPO's settings (``TrainingArgs.grpo``), with TRL 1.16's names.

    Args:
        num_generations: completions sampled per prompt (a group); at least 2.
        max_completion_length: the most tokens a completion may have; a prompt must leave room
            for it within ``TrainingArgs.max_length``.
        temperature, top_p, top_k: sampling (``top_k=0``: off). The log-probs the loss takes
            are the policy's at ``temperature`` (logits divided by it), as TRL's.
        beta: the KL coefficient against the model as it started (0: no KL, no reference).
        epsilon, epsilon_high: the clipping range ``[1 - epsilon, 1 + epsilon_high]`` of the
            importance ratio (``epsilon_high`` None: ``epsilon``; DAPO uses 0.28).
        num_iterations: optimizer passes over each batch of completions (TRL's mu).
        loss_type: ``"dapo"`` (TRL's default), ``"grpo"``, ``"dr_grpo"`` or ``"bnpo"``.
        scale_rewards: advantages divided by the group's reward std (``"group"``), the
            batch's (``"batch"``) or not at all (``"none"``); True and False mean group and none.
        importance_sampling_level: the policy ratio per token (``"token"``) or one per
            completion, its tokens' mean log-ratio (``"sequence"``, GSPO).
        mask_truncated_completions: completions cut at ``max_completion_length`` take no loss.
        importance_sampling: the correction of the mismatch between the engine's log-probs
            and the trainer's: TRL's ``vllm_importance_sampling_mode`` (None: off).
        importance_sampling_cap, importance_sampling_min: its bounds (TRL's
            ``vllm_importance_sampling_clip_max`` and ``..._clip_min``): ``*_mask`` modes zero a
            ratio outside them, ``*_truncate`` modes clamp it.
        max_tool_calling_iterations: with ``tools`` or ``environment_factory``, the most
            rounds of tool calls an episode makes (TRL's name; None: no limit but
            ``max_completion_length``, which bounds an episode's tokens after its prompt, tool
            results included).
        sync_every: the trainer's weights reach the rollout engines every this many
            optimizer steps (1: before every rollout, on-policy; ours, not TRL's).
        log_completions: write sampled completions (prompt, completion, rewards, advantage) to
            ``<run>/rollouts.jsonl``; ``num_completions_to_print`` of each step (None: all).

    Example:
        >>> GrpoConfig(num_generations=4, max_completion_length=64).loss_type
        'dapo'
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    num_generations: int = Field(8, ge=2)
    max_completion_length: int = Field(512, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    beta: float = Field(0.0, ge=0)
    epsilon: float = Field(0.2, gt=0, lt=1)
    epsilon_high: float | None = Field(None, gt=0)
    num_iterations: int = Field(1, ge=1)
    loss_type: Literal["dapo", "grpo", "dr_grpo", "bnpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    importance_sampling_level: Literal["token", "sequence"] = "token"
    mask_truncated_completions: bool = False
    importance_sampling: (
        Literal["sequence_mask", "sequence_truncate", "token_mask", "token_truncate"] | None
    ) = "sequence_mask"
    importance_sampling_cap: float | None = Field(3.0, gt=0)
    importance_sampling_min: float | None = Field(None, ge=0)
    max_tool_calling_iterations: int | None = Field(None, ge=0)
    sync_every: int = Field(1, ge=1)
    log_completions: bool = False
    num_completions_to_print: int | None = Field(None, gt=0)

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_as_trl(cls, v: Any) -> Any:
        # TRL's __post_init__ maps the booleans of older versions.
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @field_validator(
        "num_generations",
        "max_completion_length",
        "top_k",
        "num_iterations",
        "sync_every",
        "max_tool_calling_iterations",
        mode="before",
    )
    @classmethod
    def _no_bool(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"got {v!r}: a boolean where a number goes; give a whole number")
        return v

    @model_validator(mode="after")
    def _check_combination(self) -> GrpoConfig:
        low, cap = self.importance_sampling_min, self.importance_sampling_cap
        if low is not None and cap is not None and low >= cap:
            raise ValueError(
                f"importance_sampling_min={low} must be below importance_sampling_cap={cap}; "
                "lower the min, or raise the cap"
            )
        if self.importance_sampling in ("sequence_truncate", "token_truncate") and (
            low is None and cap is None
        ):
            raise ValueError(
                f"importance_sampling={self.importance_sampling!r} clamps the ratio to "
                "[importance_sampling_min, importance_sampling_cap], and both are None; set "
                "importance_sampling_cap (TRL's default is 3.0)"
            )
        return self

    @property
    def epsilon_low(self) -> float:
        """The lower clipping bound's epsilon (TRL's ``epsilon_low``: ``epsilon``)."""
        return self.epsilon

    @property
    def upper_epsilon(self) -> float:
        """The upper clipping bound's epsilon: ``epsilon_high``, else ``epsilon``."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @classmethod
    def coerce(cls, value: Any) -> GrpoConfig:
        """A :class:`GrpoConfig` from itself or a dict of its fields; raise
        :class:`TrainingArgsError` naming each bad field as ``grpo.<field>`` with the fix
        (TRL names that are called otherwise here, or not supported, are told so)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise TrainingArgsError(
                f"grpo: got a {type(value).__name__}; pass a GrpoConfig or a dict of its "
                "fields, e.g. {'num_generations': 8, 'max_completion_length': 256}"
            )
        try:
            return cls(**value)
        except ValidationError as e:
            raise TrainingArgsError(_explain(e)) from None


def _explain(e: ValidationError) -> str:
    lines = [f"invalid grpo settings ({e.error_count()} problem(s)):"]
    for err in e.errors():
        name = ".".join(str(p) for p in err["loc"])
        field = f"grpo.{name}" if name else "grpo"
        if err["type"] == "extra_forbidden":
            lines.append(f"  - {field}: {_unknown(name)}")
            continue
        shown = repr(err.get("input"))
        shown = shown if len(shown) < 80 else shown[:77] + "..."
        message = err["msg"].removeprefix("Value error, ")
        info = GrpoConfig.model_fields.get(name)
        default = f"; TRL's default is {info.default!r}" if info and err["loc"] else ""
        lines.append(f"  - {field}: {message} (got {shown}){default}")
    return "\n".join(lines)


def _unknown(name: str) -> str:
    if name in _RENAMED:
        return f"TRL's name; here it is grpo.{_RENAMED[name]}"
    if name in _ELSEWHERE:
        return f"not a grpo setting: set TrainingArgs.{_ELSEWHERE[name]}"
    if name in _TRL_UNSUPPORTED:
        return "a TRL GRPOConfig field that ray-trainer does not support yet; drop it"
    close = difflib.get_close_matches(name, list(GrpoConfig.model_fields), n=1)
    return "unknown field" + (f"; did you mean {close[0]!r}?" if close else "")


def config_of(args: Any) -> GrpoConfig:
    """The run's GRPO settings: ``TrainingArgs.grpo``, or TRL's defaults when it is None."""
    return args.grpo if args.grpo is not None else GrpoConfig()


#: What GRPO does not compose with yet, and the fix each error names (``check_args``).
_VALIDATION = (
    "GRPO has no validation step yet (a reward on held-out prompts, eval/reward, is not built); "
    "drop {}, and score checkpoints on held-out prompts with "
    "callbacks=[EvalOnSave(GenerationEval(...))] instead"
)
_NOT_YET = (
    ("eval_every_steps", None, _VALIDATION.format("eval_every_steps")),
    ("val_data", None, _VALIDATION.format("val_data")),
)


def check_max_staleness(v: Any) -> Any:
    """``max_staleness`` (a ``TrainingArgs`` field of GRPO's): a whole number >= 0."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(
            f"max_staleness must be a whole number >= 0 (0: synchronous rollouts; 1: the "
            f"next step's rollout sampled while a step trains), got {v!r}"
        )
    return v


def check_rollout_workers(v: Any) -> Any:
    """``rollout_workers`` (a ``TrainingArgs`` field of GRPO's): a number of engines, or
    ``(min, max)`` for elastic engines (``(n, n)`` is ``n``)."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError(
                f"rollout_workers takes a number of engines or (min, max), two whole "
                f"numbers, got {v!r}"
            )
        low, high = v
        if low < 1 or low > high:
            raise ValueError(
                f"rollout_workers=({low}, {high}): elastic rollout engines need "
                "1 <= min <= max; e.g. rollout_workers=(1, 4) asks for 4 engines and "
                "starts training once 1 is up"
            )
        return (low, high) if low < high else low
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"rollout_workers must be an integer >= 1, got {v!r}")
    return v


def check_args(args: Any) -> None:
    """What GRPO refuses in the other fields, named with the fix (the registry's ``check``,
    in the driver before Ray starts): a custom loss, no prompts, reward functions that do not
    import or cannot take TRL's arguments, weights that do not match them, and what is not
    built yet (validation, an elastic worker group, a frozen reference copy under FSDP)."""
    from ray_trainer._rollout.actor import actor_options
    from ray_trainer._rollout.engines import resolve_backend
    from ray_trainer._rollout.rewards import resolve_reward_fns, reward_weights

    if args.loss_fn is not None:
        raise ValueError(
            "loss_fn with objective='grpo': the GRPO loss is computed from the completions' "
            "per-token log-probabilities and advantages (grpo.loss_type picks TRL's); drop loss_fn"
        )
    if args.data is None:
        raise ValueError(
            'objective=\'grpo\' needs data: prompt-only records such as {"prompt": "..."} or '
            '{"prompt": [messages]} (docs/rl.md)'
        )
    for name, bad, fix in _NOT_YET:
        value = getattr(args, name)
        if (value is not None) if bad is None else (value == bad):
            raise ValueError(f"{name}={value!r} with objective='grpo': {fix}")
    if args.elastic:
        raise ValueError(
            f"num_workers={list(args.num_workers)} with objective='grpo': an elastic worker "
            "group is not built for GRPO yet; give a fixed number of workers"
        )
    config = config_of(args)
    if args.max_staleness and config.num_iterations > 1:
        raise ValueError(
            f"max_staleness={args.max_staleness} with grpo.num_iterations="
            f"{config.num_iterations}: asynchronous rollouts take one optimizer step per "
            "rollout; set grpo.num_iterations=1, or max_staleness=0 (synchronous)"
        )
    if config.beta > 0 and args.strategy == "fsdp" and args.lora is None:
        raise ValueError(
            f"grpo.beta={config.beta} with strategy='fsdp' and no LoRA: the KL's reference "
            "would be a frozen copy of the whole model on every rank; add lora (the reference "
            "is the base with the adapters off), use strategy='ddp', or set grpo.beta=0"
        )
    if args.rollout_func is not None:
        _check_rollout_func(args)
    if has_agents(args):
        _check_agents(args)
    # TrainingArgsError naming the function (or its resources)
    fns = resolve_reward_fns(args.reward_fns, args.reward_resources)
    reward_weights(args.reward_weights, fns)
    actor_options(args.rollout_resources)
    try:  # a backend that is not built (or, for "auto", none here) is refused now
        resolve_backend(args.rollout_backend)
    except ValueError as e:
        raise ValueError(f"rollout_backend: {e}") from None


def _check_agents(args: Any) -> None:
    """What multi-turn episodes refuse (the tools themselves: ``_agents.tools``)."""
    from ray_trainer._agents.tools import resolve_agent_tools
    from ray_trainer._rollout.actor import actor_options

    if args.max_staleness:
        raise ValueError(
            f"max_staleness={args.max_staleness} with tools or environment_factory: "
            "asynchronous multi-turn episodes are not built yet; set max_staleness=0"
        )
    resolve_agent_tools(args.tools, args.environment_factory)
    try:
        actor_options(args.environment_resources)
    except ValueError as e:
        raise ValueError(f"environment_resources: {e}") from None


def _check_rollout_func(args: Any) -> None:
    """``rollout_func``: importable, and alone (it is the whole rollout)."""
    from ray_trainer._named import import_named

    if has_agents(args):
        raise ValueError(
            "rollout_func with tools or environment_factory: a rollout_func is the whole "
            "rollout loop (call your tools inside it); drop one or the other"
        )
    if args.max_staleness:
        raise ValueError(
            f"max_staleness={args.max_staleness} with rollout_func: asynchronous custom "
            "rollouts are not built yet; set max_staleness=0"
        )
    import_named(args.rollout_func, "rollout_func", "my_loop:rollout",
                 "a function (prompts, engines) -> dict")  # fmt: skip


def beside_workers(args: Any) -> list[Beside]:
    """The rollout engines (``rollout_resources`` each, by default one CPU: the first step waits
    for ``min`` of ``rollout_workers``, ``max`` may run) and the reward tasks: a step waits for
    one task of each resource's largest over the functions (they may run one after another),
    and each function's own task (``reward_resources``, by default one CPU) may run at once."""
    from ray_trainer._rollout.rewards import resolve_reward_fns, task_resources

    engine = dict(args.rollout_resources) if args.rollout_resources is not None else {"CPU": 1.0}
    least, most = args.rollout_range  # the others may wait for room (elastic)
    fns = resolve_reward_fns(args.reward_fns, args.reward_resources)
    largest = {k: v for k, v in task_resources(fns).items() if v > 0}
    engines = tuple(f"rollout engine {i}" for i in range(least))
    environments = []
    if has_agents(args):
        res = dict(args.environment_resources or {"CPU": 0.25})
        names = tuple(f"environment actor {i}" for i in range(args.environment_workers))
        at_once = args.environment_workers
        environments = [Beside("environment actor", res, needed=names, at_once=at_once)]
    return [
        *environments,
        Beside("rollout engine", engine, needed=engines, at_once=most),
        # What a step waits for; what runs at once is each function's own task, below.
        Beside("reward task", largest, needed=("a reward function's task",), at_once=0),
        *(Beside("reward task", {k: v for k, v in f.resources.items() if v > 0}) for f in fns),
    ]


def run_metrics(args: Any) -> tuple[str, ...]:
    """GRPO's metrics in a run: the description's, each reward function's mean and std, and
    the count of rollout engines started again after they died (and, asynchronous, its own)."""
    from ray_trainer._rollout.rewards import resolve_reward_fns

    per_fn = [f"rewards/{f.name}/{m}" for f in resolve_reward_fns(args.reward_fns)
              for m in ("mean", "std")]  # fmt: skip
    more = ASYNC_METRICS if args.max_staleness else ()
    agents = AGENT_METRICS if has_agents(args) else ()
    env_fns = ()
    if agents:
        from ray_trainer._agents.tools import resolve_agent_tools

        rewarded = resolve_agent_tools(args.tools, args.environment_factory).rewarded
        env_fns = tuple(f"rewards/{n}/{m}" for n in dict.fromkeys(rewarded.values())
                        for m in ("mean", "std"))  # fmt: skip
    return (*GRPO.metrics, *per_fn, *env_fns, "rollout/engine_restarts", *more, *agents)


def has_agents(args: Any) -> bool:
    """Whether a run's episodes are multi-turn (``tools`` or ``environment_factory`` set)."""
    return args.tools is not None or args.environment_factory is not None


def _needs_reference(args: Any) -> bool:
    # The KL's reference log-probs are taken on each step's fresh completions, in the step:
    # never precomputed into the token cache.
    return False


#: GRPO, as every process sees it (registered in ``ray_trainer/_objectives/__init__.py``).
GRPO = Objective(
    name="grpo",
    summary="online RL with group-relative advantages (GRPO)",
    worker="ray_trainer._worker.objectives.grpo",
    data_formats=("prompts",),
    data_noun="prompt-only records",
    data_example='{"prompt": "..."} or {"prompt": [messages]} (docs/rl.md)',
    fields=(
        "grpo",
        "reward_fns",
        "reward_weights",
        "reward_resources",
        "reward_timeout_s",
        "rollout_backend",
        "rollout_resources",
        "rollout_workers",
        "max_staleness",
        "tools",
        "environment_factory",
        "rollout_func",
        "environment_workers",
        "environment_resources",
        "tool_timeout_s",
    ),
    check=check_args,
    needs_reference=_needs_reference,
    beside_workers=beside_workers,
    run_metrics=run_metrics,
    # The rollout side's (rewards, completions) then the loss's; each step also logs
    # rewards/<fn>/mean and rewards/<fn>/std per reward function, named at run time.
    metrics=(*ROLLOUT_METRICS, *LOSS_METRICS, *ROLLOUT_TIMINGS),
)
