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
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from ray_trainer._config.args import TrainingArgs
from ray_trainer._model.spec import ModelSpec, is_builtin, is_causal_lm
from ray_trainer._storage import locate
from ray_trainer._worker.model.adaptation import LoraAdapters, WholeModel, adapt
from ray_trainer._worker.model.build import Materialize, build_model
from ray_trainer._worker.step.micro_batches import ignores_labels

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
    # The run's objective (its loss, batch layout, validation step: `_worker/objectives/`),
    # built by setup from its registry entry first, since the workload is built around it.
    # Required (SFT's too): the loop, setup and validation ask it, never its name.
    objective: Any = field(kw_only=True)

    def forward(self, model: nn.Module, batch: dict[str, torch.Tensor], targets: int) -> Any:
        """(outputs, the micro-batch's loss sum / `norm`) for backward: the objective's loss.
        `targets` is what the loader counted in `batch` (labels the model scores; DPO: pairs)."""
        return self.objective.step_loss(self, model, batch, targets)


def build_workload(
    args: TrainingArgs,
    objective: Any,
    caches: dict[str, str] | None = None,
    chat_template: str | None = None,
    references: dict[str, str] | None = None,
    prompts: dict[str, Any] | None = None,
) -> Workload:
    """The model, datasets and loss of this rank, for `objective` (``objectives.
    worker_objective``). ``caches`` names the token cache of each data field the driver encoded
    (``data``, ``val_data``), rendered with ``chat_template``; ``references`` the folder of
    each one's reference log-probs, for an objective that needs them; ``prompts`` each field's
    encoded prompts (GRPO), which the objective lays out itself."""
    if is_builtin(args.model) and args.data is None:
        return _demo_workload(args, objective)
    spec = ModelSpec.of(args)
    model, materialize = build_model(spec)  # a pretrained model: on the meta device, unfilled
    # Under LoRA the base frozen, adapters added (on meta with the base).
    model, materialize, adaptation = adapt(model, materialize, spec, args)
    packed_layout = False
    if args.packing:  # each sample attends to itself alone, without a [T, T] mask
        from ray_trainer._worker.model.packed_attention import use_packed_attention

        packed_layout = use_packed_attention(model)
    if args.loss_fn is None and is_causal_lm(model) and _is_hf(model):
        _use_fused_loss(model, args)
    objective.prepare(model, adaptation)
    tokenizer = spec.data_tokenizer()
    pad_id = _pad_id(tokenizer)
    caches = caches or {}
    references = references or {}
    if prompts and "data" in prompts:  # prompt-only records: no token cache
        train = objective.dataset(prompts["data"], "data", args, references)
    else:
        train = _dataset("data", args, objective, caches, pad_id, references)
    collate = getattr(train, "collate", None)
    val = None
    if args.val_data is not None:
        val = _dataset("val_data", args, objective, caches, pad_id, references)
    if val is None and args.eval_every_steps:
        train, val = _hold_out(train, args.seed)
    # The constant each micro-batch's loss sum is divided by (the same on every rank): about
    # the targets of a rank's step (DPO: its pairs), so the sums stay near 1.
    per_sample = objective.targets_per_sample(args, "data" in caches)
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
        norm=float(args.batch_size * args.grad_accum_steps * per_sample),
        chat_template=chat_template,
        end_of_turn_ids=_end_of_turn(tokenizer, chat_template),
        packed_layout=packed_layout,
        materialize=materialize,
        adaptation=adaptation,
        objective=objective,
    )


def _use_fused_loss(model: nn.Module, args: TrainingArgs) -> None:
    """The loss of a Hugging Face causal LM without its full logits: liger-kernel's fused
    linear cross-entropy where the run asks for it and it runs here (`liger.use_liger` raises
    for ``liger_kernel=True`` where it cannot), else the chunked loss, else the model's own."""
    from ray_trainer._worker.model.liger import liger_wanted, use_liger

    if liger_wanted(args):
        why_not = use_liger(model, args)
        if why_not is None:
            logger.info("liger-kernel on: its kernels and fused linear cross-entropy")
            return
        logger.info("liger-kernel off (liger_kernel=None): %s", why_not)  # said once per worker
    if not args.chunked_loss:
        return
    from ray_trainer._worker.model.chunked_loss import use_chunked_loss

    reason = use_chunked_loss(model, args.loss_chunk_size)
    if reason is not None:  # said once per worker
        logger.info("chunked loss off: %s; the model computes its loss from full logits", reason)


def model_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss the model computed itself: `outputs.loss` or `outputs["loss"]` (HF style), or
    the output itself when it is a 0-dim floating tensor (plain PyTorch's ``return loss``)."""
    if torch.is_tensor(outputs):
        if outputs.ndim == 0 and outputs.is_floating_point():
            return outputs
        raise ValueError(
            f"the model returned a tensor of shape {tuple(outputs.shape)} ({outputs.dtype}), "
            "not a loss: return the loss as a 0-dim floating tensor (or in outputs.loss), or "
            "set TrainingArgs.loss_fn=(outputs, batch) -> loss"
        )
    loss = outputs.get("loss") if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            f"the model returned no loss ({type(outputs).__name__} without 'loss'): return one "
            "from forward() (a 0-dim tensor, or outputs.loss when labels are given), or set "
            "TrainingArgs.loss_fn=(outputs, batch) -> loss"
        )
    return loss


def zero_loss(outputs: Any, batch: dict[str, Any] | None = None) -> torch.Tensor:
    """A loss of exactly zero that still reaches every parameter the forward used, so backward
    (and DDP's or FSDP's gradient collectives) runs as on any other micro-batch. Taken from the
    logits (or the first other float output), not from a loss the model computed over labels
    that are all ignored: that one is a mean over no target, NaN, and so would be its gradient.
    A `batch` without labels to ignore (an elastic filler repeating real samples: no labels, or
    a regression's float labels) has a finite loss: the zero is taken from it when the model
    returned nothing else (a plain ``return loss``)."""
    if isinstance(outputs, torch.Tensor):
        named = {"loss" if outputs.ndim == 0 else "logits": outputs}
    elif isinstance(outputs, dict):  # a dict or a transformers ModelOutput
        named = dict(outputs)
    elif isinstance(outputs, (tuple, list)):
        named = {str(i): t for i, t in enumerate(outputs)}
    else:
        named = dict(vars(outputs))
    loss = named.pop("loss", None)
    floats = [t for t in named.values() if torch.is_tensor(t) and t.is_floating_point()]
    floats.sort(key=lambda t: (t is not named.get("logits"), t.ndim == 0))  # a scalar: a loss
    if not floats and torch.is_tensor(loss) and batch is not None and not ignores_labels(batch):
        floats = [loss]
    if not floats:
        raise ValueError(
            "a micro-batch has no target token (every label ignored) and the model returned no "
            "float tensor (logits) besides its loss, a mean over nothing, to take a zero loss "
            "from: return the logits too (e.g. {'loss': loss, 'logits': logits})"
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
    field: str,
    args: TrainingArgs,
    objective: Any,
    caches: dict[str, str],
    pad_id: Any,
    references: dict,
) -> Dataset:
    if field in caches:
        from ray_trainer._worker.step.micro_batches import CachedDataset

        # The cache the driver named (a path or URI), on the run's storage.
        cache = locate(caches[field], args.storage_filesystem)
        # As the objective lays its samples out (DPO: pairs of sequences).
        return objective.dataset(CachedDataset.open(cache, pad_id or 0), field, args, references)
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


def _demo_workload(args: TrainingArgs, objective: Any) -> Workload:
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
        objective=objective,
    )
