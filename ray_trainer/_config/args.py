"""Every process: `TrainingArgs`, validated in the driver before any Ray resource is taken.

Runs in the driver. The validated args travel to the workers (and to the callback actor) as a
plain dict; the objects in them (model factories, datasets, callbacks) travel cloudpickled.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from callbacks import ALIASES, EVENTS
from ray_trainer._config import rules
from ray_trainer._errors import TrainingArgsError
from ray_trainer._objectives import check_fields, grpo, objective_of

HookSpec = Callable[..., Any] | list[Callable[..., Any]] | None

#: An elastic run's default `max_failures`: Ray Train counts a node lost without a preemption
#: notice as a worker-group failure, and each lost spot node costs one.
ELASTIC_MAX_FAILURES = 10


class TrainingArgs(BaseModel):
    """Arguments of one training run.

    Args:
        model: ``None`` or ``"tiny-lm"`` for the built-in demo transformer; a callable returning
            an ``nn.Module``; or a Hugging Face causal LM name, local path or bucket URI
            (``ray-trainer[hf]``).
        data: ``None`` for the built-in addition task; a JSONL file of text; a torch ``Dataset``;
            or a callable returning one.
        max_steps: optimizer steps to train for (``None``: ``num_epochs`` passes over the data).
        batch_size: micro-batch size per worker; the global batch is
            ``batch_size * grad_accum_steps * num_workers`` (with an elastic
            ``num_workers=(min, max)``, of ``max`` at every size).
        callbacks: callback instances or functions; ``on_<event>`` fields take a function or a list.

    Example:
        >>> args = TrainingArgs(max_steps=200, num_workers=2, save_every_steps=50)
        >>> args.batch_size
        32
    """

    # allow_inf_nan=False: an infinite learning rate or timeout passes `gt=0`; refuse it.
    model_config = ConfigDict(
        extra="forbid", arbitrary_types_allowed=True, frozen=False, allow_inf_nan=False
    )

    # What to train.
    model: str | Callable[..., Any] | None = None
    data: str | Any | None = None
    val_data: str | Any | None = None
    loss_fn: Callable[..., Any] | None = None
    tokenizer: str | None = None
    # Hugging Face names are loaded from a local folder or the HF cache only, unless this is set.
    allow_download: bool = False
    text_field: str = "text"
    max_length: int = Field(128, gt=0)
    demo: dict[str, Any] = Field(default_factory=dict)
    # Chat data and packing (docs/chat.md). A Jinja chat template, or the path of a file with
    # one: it overrides the tokenizer's own.
    chat_template: str | None = None
    # Which tokens take the loss in chat records: every assistant turn (and the token that ends
    # it), the last assistant turn only, or every token.
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    # Pack samples into micro-batches of at most `max_tokens_per_batch` tokens, without padding
    # (default: batch_size x max_length).
    packing: bool = False
    max_tokens_per_batch: int | None = Field(None, gt=0)
    # A Hugging Face causal LM of a checked family computes its loss over the positions that
    # have a target only, `loss_chunk_size` positions at a time, never holding the full logits
    # (docs/large-models.md); default: a chunk's fp32 logits near 32 MiB, at least 256 positions.
    chunked_loss: bool = True
    loss_chunk_size: int | None = Field(None, gt=0)
    # liger-kernel (ray-trainer[gpu]) on GPU workers: its RMSNorm, RoPE, SwiGLU and fused linear
    # cross-entropy (in place of the chunked loss) on a Llama, Mistral, Qwen2/3 or Phi-3 model
    # (docs/gpu.md). None: on where it runs and was measured faster (off until then).
    liger_kernel: bool | None = None
    # What the run trains for: one of the registered objectives (`ray_trainer._objectives`):
    # "sft" (the next-token loss), or "dpo" (docs/preference.md): pairs {prompt, chosen,
    # rejected} against a reference (the model as DPO starts), with TRL 1.16's losses. The
    # fields below belong to DPO.
    objective: str = "sft"
    dpo_beta: float = Field(0.1, gt=0)
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    # Conservative DPO (sigmoid only): the probability that a pair's preference is flipped.
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    # The reference's log-probs computed once before training, by Ray tasks, into the token
    # cache; False: in each step (LoRA: the base with the adapters off; else a frozen copy).
    precompute_reference: bool = True
    # GRPO (docs/rl.md): online RL on completions sampled by rollout engines. Its settings, one
    # nested config with TRL 1.16's GRPOConfig names (a GrpoConfig or a dict; None: defaults);
    # the reward functions (callables with TRL's signature, or "module:function" strings) and
    # one weight per function (None: 1.0 each); the resources of each function's Ray task (one
    # dict for all, or one per function name; None: one CPU each); how long a step waits for
    # its reward functions before it fails naming them (None: no limit); the rollout engines:
    # backend, the resources of each engine's Ray actor (None: one CPU) and how many engines;
    # how many policy versions a trained completion may lag the trainer (0: synchronous, the
    # engines generate while the trainer waits; k >= 1: the next k steps' rollouts are sampled
    # while a step trains, older completions dropped and their prompts sampled again).
    grpo: Any = None
    reward_fns: Any = None
    reward_weights: list[float] | None = None
    reward_resources: dict[str, Any] | None = None
    reward_timeout_s: float | None = Field(600.0, gt=0, allow_inf_nan=False)
    rollout_backend: Literal["hf", "vllm", "auto"] = "auto"
    rollout_resources: dict[str, float] | None = None
    rollout_workers: int | tuple[int, int] = 1
    max_staleness: int = 0
    # GRPO agents (docs/rl.md "Tools and environments"), TRL 1.16's names: tool functions
    # (type hints and a docstring; or "module:function"), an environment factory (a callable or
    # "module:Class"; a dict of them picks by the row's `environment` field) whose instances'
    # public methods are tools; the environment actors (how many, the resources of each: None
    # is a quarter of a CPU) and the longest one tool call may take before its episode starts
    # again on a fresh environment.
    tools: Any = None
    environment_factory: Any = None
    # TRL's rollout_func (a callable or "module:function"): your own rollout loop,
    # fn(prompts, engines) -> {prompt_ids, completion_ids, logprobs, [env_mask], ...}, with
    # `engines.generate(...)` sampling on the run's rollout engines (docs/rl.md).
    rollout_func: Any = None
    environment_workers: int = Field(1, ge=1)
    environment_resources: dict[str, float] | None = None
    tool_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False)

    # How long and how.
    max_steps: int | None = Field(None, gt=0)
    num_epochs: int = Field(1, gt=0)
    batch_size: int = Field(32, gt=0)
    grad_accum_steps: int = Field(1, gt=0)
    learning_rate: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    warmup_steps: int = Field(0, ge=0)
    lr_schedule: Literal["linear", "cosine", "constant"] = "linear"
    max_grad_norm: float | None = Field(1.0, gt=0)
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    seed: int = 42  # 0 <= seed <= SEED_MAX

    # Parallelism (docs/large-models.md).
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # Class names of the blocks FSDP shards one by one (default: the model's _no_split_modules,
    # else the children of its nn.ModuleLists); each is also the unit of activation checkpointing.
    fsdp_shard_modules: list[str] | None = None
    fsdp_reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    # Move what forward saves for backward to pinned host memory (a GPU only; with activation
    # checkpointing, the checkpointed blocks' inputs), and back for backward.
    offload_activations: bool = False
    # Every checkpoint of a Hugging Face model holds <checkpoint>/hf/ (from_pretrained loads it).
    save_hf_format: bool = True
    # torch.compile the model: each block under FSDP, the whole model under DDP.
    compile: bool = False
    # LoRA (docs/lora.md, ray-trainer[lora]): a peft.LoraConfig or a dict of its fields; the
    # base is frozen, only the adapters train. What each checkpoint's hf/ holds: the PEFT
    # adapter, the merged model, or both (merged in hf/, adapter in hf_adapter/).
    lora: Any = None
    lora_export: Literal["adapter", "merged", "both"] = "adapter"
    # The peak FLOP/s of one device, for MFU in the logs (default: a table of known GPUs).
    peak_flops: float | None = Field(None, gt=0)

    # Scaling. A fixed size, or elastic: (min, max) workers, as many as the cluster can place
    # (docs/cluster.md, "Elastic training"); the global batch is always that of `max`.
    num_workers: int | tuple[int, int] = 2
    # Elastic runs: how often Ray Train looks for room to grow the worker group.
    elastic_resize_interval_s: float = Field(60.0, gt=0)
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    # Checkpoints, evaluation, logging.
    save_every_steps: int | None = Field(None, gt=0)
    save_at_end: bool = True
    # Write checkpoints in the background: training pauses only to copy the state to host
    # memory (docs/large-models.md, "Asynchronous checkpoints").
    async_checkpoint: bool = False
    num_checkpoints_to_keep: int | None = Field(None, gt=0)
    # Rank checkpoints by this metric (from on_evaluate, else the logs), best first; with
    # num_checkpoints_to_keep the N best are kept, plus the newest (docs/evaluation.md).
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: Literal["max", "min"] = "max"
    eval_every_steps: int | None = Field(None, gt=0)
    eval_max_batches: int | None = Field(None, gt=0)
    log_every_steps: int = Field(10, gt=0)
    storage_path: str = "~/ray_trainer_runs"  # a local or shared path, or a URI (s3://...)
    storage_filesystem: Any = None  # a pyarrow.fs.FileSystem: storage_path is a path on it
    run_name: str | None = None
    resume_from: str | None = None

    # Callback machinery (docs/behaviour.md, "Forwarding to the callback actor").
    callback_timeout_s: float = Field(60.0, gt=0)
    eval_timeout_s: float = Field(600.0, gt=0)
    actor_queue_size: int = Field(10_000, gt=0)
    event_batch_size: int = Field(256, gt=0)
    event_flush_interval_s: float = Field(0.25, gt=0)
    event_max_in_flight: int = Field(4, gt=0)

    # Cluster and faults.
    # Worker-group failures to recover from (None: 0 for a fixed size; for an elastic size,
    # ELASTIC_MAX_FAILURES, so that losing a node does not end the run).
    max_failures: int | None = Field(None, ge=-1)
    # Starting a worker group that cannot be placed (a node was lost, the cluster shrank) fails
    # after this long, and is retried `max_start_retries` times, then the run fails clearly
    # (None: 2 for a fixed size; for an elastic size ELASTIC_MAX_FAILURES, since Ray Train's
    # first start after a node loss may still count the lost node, and fail once).
    worker_start_timeout_s: float = Field(60.0, gt=0)
    max_start_retries: int | None = Field(None, ge=-1)
    ray_address: str | None = None
    # The embedded local Ray starts its dashboard on 127.0.0.1 (its URL is printed at the start).
    dashboard: bool = True
    # RayMetrics added when the run has none (None: where the run joins a cluster by address
    # and its nodes export metrics; see _driver/metrics.py).
    ray_metrics: bool | None = None

    # Callbacks: instances or functions, and one flat field per event and alias.
    callbacks: list[Any] = Field(default_factory=list)
    on_init_end: HookSpec = None
    on_train_begin: HookSpec = None
    on_epoch_begin: HookSpec = None
    on_step_begin: HookSpec = None
    on_before_forward: HookSpec = None
    on_after_forward: HookSpec = None
    on_before_backward: HookSpec = None
    on_after_backward: HookSpec = None
    on_before_optimizer_step: HookSpec = None
    on_after_optimizer_step: HookSpec = None
    on_log: HookSpec = None
    on_evaluate: HookSpec = None
    on_save: HookSpec = None
    on_load_checkpoint: HookSpec = None
    on_step_end: HookSpec = None
    on_epoch_end: HookSpec = None
    on_train_end: HookSpec = None
    on_exception: HookSpec = None
    on_pre_optimizer_step: HookSpec = None
    on_optimizer_step: HookSpec = None
    on_checkpoint: HookSpec = None
    on_validation_loss: HookSpec = None

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name not in _number_fields():
            return v
        return rules.no_bool_as_number(v)

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, v: int) -> int:
        return rules.seed(v)

    @field_validator("objective")
    @classmethod
    def _registered_objective(cls, value: str) -> str:
        return objective_of(value).name

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, v: str | None) -> str | None:
        return rules.run_name(v)

    @field_validator("ray_address")
    @classmethod
    def _check_ray_address(cls, v: str | None) -> str | None:
        return rules.ray_address(v)

    @field_validator("num_workers", mode="before")
    @classmethod
    def _check_num_workers(cls, v: Any) -> Any:
        return rules.num_workers(v)

    @field_validator("data", "val_data")
    @classmethod
    def _check_data(cls, v: Any) -> Any:
        return rules.data(v)

    @field_validator("resources_per_worker")
    @classmethod
    def _check_resources(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        return rules.resources(v)

    @field_validator("grpo")
    @classmethod
    def _check_grpo(cls, v: Any) -> Any:
        return None if v is None else grpo.GrpoConfig.coerce(v)

    @field_validator("max_staleness", mode="before")
    @classmethod
    def _check_max_staleness(cls, v: Any) -> Any:
        return grpo.check_max_staleness(v)

    @field_validator("rollout_workers", mode="before")
    @classmethod
    def _check_rollout_workers(cls, v: Any) -> Any:
        return grpo.check_rollout_workers(v)

    @field_validator("lora")
    @classmethod
    def _check_lora(cls, v: Any) -> Any:
        if v is None:
            return None
        from ray_trainer._lora.config import normalise_lora

        return normalise_lora(v)

    @field_validator("storage_filesystem")
    @classmethod
    def _check_filesystem(cls, v: Any) -> Any:
        return rules.filesystem(v)

    @field_validator("callbacks", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return v if isinstance(v, (list, tuple)) else [v]

    @field_validator(*sorted(EVENTS | set(ALIASES)), mode="before")
    @classmethod
    def _check_hook(cls, v: Any) -> Any:
        return rules.hooks(v)

    @model_validator(mode="after")
    def _check_combination(self) -> TrainingArgs:
        rules.combination(self)
        check_fields(self)  # another objective's fields, then the objective's own checks
        return self

    # ---- scaling --------------------------------------------------------------------------

    @property
    def elastic(self) -> bool:
        """Whether the worker count follows the cluster: ``num_workers=(min, max)``."""
        return isinstance(self.num_workers, tuple)

    @property
    def rollout_range(self) -> tuple[int, int]:
        """``rollout_workers`` as (min, max): the engines the first step waits for, and the
        engines asked for (an int n is (n, n))."""
        v = self.rollout_workers
        return v if isinstance(v, tuple) else (v, v)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        """The most workers; a step always takes the samples of this many (the global batch)."""
        return self.num_workers[1] if self.elastic else self.num_workers

    @property
    def failures_allowed(self) -> int:
        """`max_failures`, resolved (-1: no bound)."""
        if self.max_failures is not None:
            return self.max_failures
        return ELASTIC_MAX_FAILURES if self.elastic else 0

    @property
    def start_retries_allowed(self) -> int:
        """`max_start_retries`, resolved (-1: no bound). Ray Train never resets the count."""
        if self.max_start_retries is not None:
            return self.max_start_retries
        return ELASTIC_MAX_FAILURES if self.elastic else 2

    @property
    def tokens_per_micro_batch(self) -> int | None:
        """With packing: the most tokens a packed micro-batch holds (None without packing)."""
        if not self.packing:
            return None
        return self.max_tokens_per_batch or self.batch_size * self.max_length

    # ---- construction helpers -------------------------------------------------------------

    @classmethod
    def coerce(cls, args: TrainingArgs | dict | None = None, **fields: Any) -> TrainingArgs:
        """Build from a TrainingArgs, a dict, or keyword fields; raise `TrainingArgsError`."""
        if args is None:
            data: dict[str, Any] = {}
        elif isinstance(args, TrainingArgs):
            data = dict(args.__dict__)
        elif isinstance(args, dict):
            data = dict(args)
        else:
            raise TrainingArgsError(
                f"run_training() takes a TrainingArgs, a dict or keyword fields, not "
                f"{type(args).__name__}"
            )
        data.update(fields)
        try:
            return cls(**data)
        except ValidationError as e:
            raise TrainingArgsError(format_validation_error(e)) from None

    @classmethod
    def from_yaml(
        cls,
        path: str | os.PathLike,
        overrides: list[str] | None = None,
        build_callbacks: bool = True,
    ) -> TrainingArgs:
        """Load args from a YAML file, then apply ``key=value`` overrides (values parsed as YAML).

        Callbacks in YAML are import strings (``"callbacks:EarlyStopping"``) or mappings with a
        ``class`` key (a `TrainerCallback` subclass) and constructor arguments (``{class:
        callbacks:EarlyStopping, metric: loss}``). With ``build_callbacks=False`` (what
        ``ray-trainer submit`` validates) their shape is checked, nothing is imported or called,
        and the args returned have no callbacks.
        """
        path = Path(path)
        if not path.is_file():
            raise TrainingArgsError(f"{path}: config file not found")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise TrainingArgsError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise TrainingArgsError(
                f"{path}: the top level must be a mapping of TrainingArgs fields"
            )
        from ray_trainer._config.files import import_entries, parse_overrides

        raw.update(parse_overrides(overrides or []))
        try:
            return cls.coerce(import_entries(raw, str(path), build=build_callbacks))
        except TrainingArgsError as e:
            if str(e).startswith(f"{path}: "):
                raise
            raise TrainingArgsError(f"{path}: {e}") from None

    def resolved_run_name(self) -> str:
        return self.run_name or "run"

    def to_public_dict(self) -> dict[str, Any]:
        """The args as a dict of plain values (objects shown by their repr), for contexts/logs."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if v is None or isinstance(v, (str, int, float, bool)):
                out[k] = v
            elif isinstance(v, tuple) and k == "num_workers":
                out[k] = list(v)
            elif isinstance(v, dict):
                out[k] = dict(v)
            elif isinstance(v, BaseModel):  # a nested config (grpo)
                out[k] = v.model_dump()
            elif k == "callbacks" or k in EVENTS or k in ALIASES:
                out[k] = [getattr(c, "__qualname__", type(c).__name__) for c in v]
            else:
                out[k] = repr(v)
        # The names of the objective's own metrics in each log's batch_metrics (the built-in
        # trackers export those: `callbacks.builtin.common.objective_metrics`).
        out["objective_metrics"] = list(objective_of(self.objective).metrics_of(self))
        return out


@functools.cache
def _number_fields() -> frozenset[str]:
    """The fields that take a number and not a boolean (computed once, from the annotations)."""
    names = set()
    for name, info in TrainingArgs.model_fields.items():
        kinds = set(_flat_types(info.annotation))
        if kinds & {int, float} and bool not in kinds:
            names.add(name)
    return frozenset(names)


def _flat_types(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    if not args:
        return [annotation]
    return [t for a in args for t in _flat_types(a)]


def format_validation_error(e: ValidationError) -> str:
    """pydantic's errors as one message naming each field (`rules.format_validation_error`)."""
    return rules.format_validation_error(e, TrainingArgs.model_fields)
