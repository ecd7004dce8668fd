"""Training worker: what it trains (model, data, loss), built from `TrainingArgs`.

Runs in each training worker. Every rank builds the same model from the same seed; DDP then keeps
the replicas identical. Data that ray-trainer encodes (files, a ``datasets.Dataset``) is read
from the run's token cache, which the driver's preparation tasks completed before this worker
started; a torch ``Dataset`` of the user's is used as it is.

**The loss.** A step's loss is the mean over every target token of the step's global batch (all
micro-batches of all ranks): the sum of the token losses over the global count of labels the
model scores. Each micro-batch contributes its token-loss sum divided by a constant ``norm``
(the same on every rank); after backward, the gradients are multiplied by
``norm x world / global count`` (the count rides in the step's all-reduce), so they do not
depend on how the samples are split into ``batch_size``, ``grad_accum_steps`` and
``num_workers``, and a short sample weighs no more than a long one. A model that takes
``num_items_in_batch`` (Hugging Face causal LMs, the demo model) returns that sum divided by it
itself, with no NaN on a micro-batch whose labels are all ignored; any other model (or a
``loss_fn``) returns the mean over the micro-batch's targets, which is weighted by their count;
a micro-batch with no target (a rank's filler, a chat row truncated before its answer) then
contributes an exact zero, not the NaN of a mean over nothing.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ray_trainer._config.args import TrainingArgs
from ray_trainer._model.spec import ModelSpec, is_builtin, is_causal_lm
from ray_trainer._storage import locate
from ray_trainer._worker.model.adaptation import LoraAdapters, WholeModel, adapt
from ray_trainer._worker.model.build import Materialize, build_model

if TYPE_CHECKING:
    from ray_trainer._worker.dpo import DpoObjective

logger = logging.getLogger("ray_trainer")


@dataclass
class Workload:
    model: nn.Module
    train_dataset: Dataset
    val_dataset: Dataset | None
    collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]] | None
    loss_fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    # Extra validation metrics computed on rank 0 from the unwrapped model, e.g. exact match.
    rank0_metrics: Callable[[nn.Module], dict[str, float]] | None = None
    tokenizer: Any = None  # saved into a Hugging Face export when it can save itself
    pad_id: int | None = None  # when batches have no attention mask: what padding is
    sums_itself: bool = False  # the model takes num_items_in_batch (returns sum / it)
    shifts_labels: bool = True  # a causal LM: labels[t + 1] is scored at position t
    norm: float = 1.0  # each micro-batch's loss is its token-loss sum over this
    chat_template: str | None = None  # the template the data was rendered with (for hf/)
    end_of_turn_ids: list[int] | None = None  # the tokens that end an assistant turn (for hf/)
    packed_layout: bool = False  # packed rows carry their layout to our packed attention
    # A pretrained model built on the meta device: fills it once placed (loading.py).
    materialize: Materialize | None = None
    # What LoRA changes (trainable parameters, checkpoints, the export), or the whole model.
    adaptation: WholeModel | LoraAdapters = field(default_factory=WholeModel)
    # objective="dpo": pairs to their loss (`targets` then counts pairs), else None (SFT).
    objective: DpoObjective | None = None

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], targets: int) -> Any:
        """(outputs, the micro-batch's token-loss sum / `norm`) for backward. `targets` is the
        count of labels the model scores in `batch`, known on the host (DPO: of pairs, and
        the sum is of pair losses)."""
        if self.objective is not None:
            outputs, total = self.objective.forward(model, batch, targets)
            return outputs, total / self.norm
        if self.sums_itself:
            outputs = model(**batch, num_items_in_batch=self.norm)
            return outputs, self.loss_fn(outputs, batch)
        outputs = model(**batch)
        if targets == 0:  # every rank still runs backward (DDP, FSDP): a zero on the graph
            return outputs, zero_loss(outputs)
        return outputs, self.loss_fn(outputs, batch) * (targets / self.norm)

    def loss_sum(self, model: nn.Module, batch: dict[str, torch.Tensor], targets: int) -> Any:
        """The token-loss sum of a batch (validation): no gradient needed."""
        if self.sums_itself:
            return self.loss_fn(model(**batch, num_items_in_batch=1.0), batch)
        outputs = model(**batch)  # even with no target: under FSDP a forward is a collective
        return 0.0 if targets == 0 else self.loss_fn(outputs, batch) * targets


def build_workload(
    args: TrainingArgs,
    caches: dict[str, str] | None = None,
    chat_template: str | None = None,
    references: dict[str, str] | None = None,
    reference_model: list[Any] | None = None,
) -> Workload:
    """The model, datasets and loss of this rank. ``caches`` names the token cache of each
    data field the driver encoded (``data``, ``val_data``), rendered with ``chat_template``;
    under DPO ``references`` names the folder of each one's reference log-probs, and
    ``reference_model`` is where setup puts a frozen copy (an in-step reference, no LoRA)."""
    if is_builtin(args.model) and args.data is None:
        return _demo_workload(args)
    spec = ModelSpec.of(args)
    model, materialize = build_model(spec)  # a pretrained model: on the meta device, unfilled
    # Under LoRA the base frozen, adapters added (on meta with the base).
    model, materialize, adaptation = adapt(model, materialize, spec, args)
    packed_layout = False
    if args.packing:  # each sample attends to itself alone, without a [T, T] mask
        from ray_trainer._worker.model.packed_attention import use_packed_attention

        packed_layout = use_packed_attention(model)
    if args.loss_fn is None and args.chunked_loss and is_causal_lm(model) and _is_hf(model):
        from ray_trainer._worker.model.chunked_loss import use_chunked_loss

        reason = use_chunked_loss(model, args.loss_chunk_size)
        if reason is not None:  # said once per worker
            logger.info(
                "chunked loss off: %s; the model computes its loss from full logits", reason
            )
    tokenizer = spec.data_tokenizer()
    pad_id = _pad_id(tokenizer)
    caches = caches or {}
    references = references or {}
    train = _dataset("data", args, caches, pad_id, references)
    collate = getattr(train, "collate", None)
    val = None
    if args.val_data is not None:
        val = _dataset("val_data", args, caches, pad_id, references)
    if val is None and args.eval_every_steps:
        train, val = _hold_out(train, args.seed)
    cached = "data" in caches
    objective = None
    if args.objective == "dpo":
        objective = dpo_objective(model, args, adaptation, reference_model)
    return Workload(
        model,
        train,
        val,
        collate,
        args.loss_fn or model_loss,
        tokenizer=tokenizer,
        pad_id=pad_id,
        sums_itself=args.loss_fn is None and takes_num_items(model),
        shifts_labels=is_causal_lm(model),
        norm=_norm(args, cached),
        chat_template=chat_template,
        end_of_turn_ids=_end_of_turn(tokenizer, chat_template),
        packed_layout=packed_layout,
        materialize=materialize,
        adaptation=adaptation,
        objective=objective,
    )


def _norm(args: TrainingArgs, cached: bool) -> float:
    """The constant each micro-batch's loss sum is divided by (the same on every rank): about
    the targets of a rank's step (DPO: its pairs), so the sums stay near 1."""
    per_sample = args.max_length if cached and args.objective == "sft" else 1
    return float(args.batch_size * args.grad_accum_steps * per_sample)


def dpo_objective(
    model: nn.Module, args: TrainingArgs, adaptation: Any, reference_model: Any = None
) -> DpoObjective:
    """A DPO run's objective (dropout off, as TRL's ``disable_dropout``). The reference: the
    batches' precomputed log-probs; with ``precompute_reference=False`` the model itself with
    its fresh LoRA adapters off, or `reference_model`, a frozen copy (setup makes it)."""
    from ray_trainer._worker.dpo import DpoObjective

    disable_dropout(model)
    chunked = hasattr(_inner(model), "_ray_trainer_chunk_size")
    objective = DpoObjective(args.dpo_beta, args.dpo_loss, args.label_smoothing, chunked)
    if not args.precompute_reference:
        objective.reference = in_step_reference(objective, model, adaptation, reference_model)
    return objective


def in_step_reference(objective: Any, model: nn.Module, adaptation: Any, frozen: Any) -> Any:
    """``reference(inputs, sequence, n)``: the reference's log-probs computed in the step, with
    no gradient: `model` with its LoRA adapters off (no second copy), else `frozen` (the model
    as DPO started, once setup has placed it: ``frozen[0]``)."""

    def reference(inputs: dict[str, Any], sequence: Any, n: int) -> torch.Tensor:
        if isinstance(adaptation, WholeModel):
            return objective.logps(frozen[0], inputs, sequence, n)
        with adaptation.disabled(model):
            return objective.logps(model, inputs, sequence, n)

    return reference


def disable_dropout(model: nn.Module) -> None:
    """Every dropout of `model` off, as TRL's ``disable_dropout_in_model`` (DPO compares the
    policy with a reference computed without dropout)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _inner(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss the model computed itself (HF style: `outputs.loss` or `outputs["loss"]`)."""
    loss = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            "the model returned no loss: return one from forward() when labels are given, "
            "or set TrainingArgs.loss_fn=(outputs, batch) -> loss"
        )
    return loss


def zero_loss(outputs: Any) -> torch.Tensor:
    """A loss of exactly zero that still reaches every parameter the forward used, so backward
    (and DDP's or FSDP's gradient collectives) runs as on any other micro-batch. Taken from the
    logits (or the first other float output), never from a loss the model computed: that one is
    a mean over no target, NaN, and so would be its gradient."""
    if isinstance(outputs, torch.Tensor):
        named = {"logits": outputs}
    elif isinstance(outputs, dict):  # a dict or a transformers ModelOutput
        named = dict(outputs)
    elif isinstance(outputs, (tuple, list)):
        named = {str(i): t for i, t in enumerate(outputs)}
    else:
        named = dict(vars(outputs))
    named.pop("loss", None)
    floats = [t for t in named.values() if torch.is_tensor(t) and t.is_floating_point()]
    floats.sort(key=lambda t: (t is not named.get("logits"), t.ndim == 0))  # a scalar: a loss
    if not floats:
        raise ValueError(
            "a micro-batch has no target token and the model returned no float tensor "
            "(logits) besides its loss to take a zero loss from: return the logits too"
        )
    return floats[0].sum() * 0.0


def takes_num_items(model: nn.Module) -> bool:
    """Whether the model sums its loss over ``num_items_in_batch`` (as transformers' causal LMs
    do; a model class says so with ``accepts_loss_kwargs``, as in transformers)."""
    declared = getattr(model, "accepts_loss_kwargs", None)
    if declared is not None:
        return bool(declared)
    params = inspect.signature(model.forward).parameters.values()
    if any(p.name == "num_items_in_batch" for p in params):
        return True
    # A Hugging Face model passes **kwargs on to its loss function.
    return hasattr(model, "loss_function") and any(p.kind is p.VAR_KEYWORD for p in params)


def _end_of_turn(tokenizer: Any, chat_template: str | None) -> list[int] | None:
    if chat_template is None:
        return None
    from ray_trainer._data.template import end_of_turn_ids

    return list(end_of_turn_ids(tokenizer, chat_template))


def _is_hf(model: nn.Module) -> bool:
    """A Hugging Face model (it has a config), or a peft model around one."""
    return getattr(model, "config", None) is not None


def _pad_id(tokenizer: Any) -> int | None:
    if tokenizer is None:
        return None
    from ray_trainer._data.encode import Encoder

    return Encoder(tokenizer).pad_id


def _dataset(
    field: str, args: TrainingArgs, caches: dict[str, str], pad_id: Any, references: dict
) -> Dataset:
    if field in caches:
        from ray_trainer._worker.step.micro_batches import CachedDataset, PairDataset

        # The cache the driver named (a path or URI), on the run's storage.
        cache = locate(caches[field], args.storage_filesystem)
        dataset = CachedDataset.open(cache, pad_id or 0)
        if args.objective != "dpo":
            return dataset
        reference = None
        if field in references:  # precomputed: the driver's tasks (or setup, under FSDP)
            from ray_trainer._reference import read_reference

            where = locate(references[field], args.storage_filesystem)
            reference = read_reference(where)
            # Under FSDP the workers fill it at setup (reference_pass.py); else the driver did.
            if reference is None and args.strategy != "fsdp":
                raise FileNotFoundError(f"{where.name}: no complete reference log-probs here")
        return PairDataset(dataset, reference)
    spec = getattr(args, field)
    if isinstance(spec, type) or (callable(spec) and not hasattr(spec, "__getitem__")):
        spec = spec()
    return spec


def _hold_out(train: Any, seed: int) -> tuple[Any, Any]:
    """5% of the training data for validation, the same split on every rank."""
    from torch.utils.data import random_split

    n_val = max(1, len(train) // 20)
    generator = torch.Generator().manual_seed(seed)
    if hasattr(train, "subset"):  # a token cache keeps its lengths (for packing)
        order = torch.randperm(len(train), generator=generator).tolist()
        return train.subset(order[n_val:]), train.subset(order[:n_val])
    return random_split(train, [len(train) - n_val, n_val], generator=generator)


def _demo_workload(args: TrainingArgs) -> Workload:
    from ray_trainer._demo import build_demo

    demo = build_demo(**args.demo)
    model, _, adaptation = adapt(demo.model_factory(), None, ModelSpec.of(args), args)
    return Workload(
        model=model,
        train_dataset=demo.train_dataset,
        val_dataset=demo.val_dataset,
        collate_fn=None,
        loss_fn=args.loss_fn or model_loss,
        rank0_metrics=demo.eval_fn,
        pad_id=demo.tokenizer.pad_id,
        sums_itself=args.loss_fn is None,
        norm=float(args.batch_size * args.grad_accum_steps * 8),
        adaptation=adaptation,
    )
