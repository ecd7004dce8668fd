"""Training worker: what it trains (model, data, loss), built from `TrainingArgs`.

Runs in each training worker. Every rank builds the same model from the same seed; DDP then keeps the replicas identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, random_split

from ray_trainer._config import TrainingArgs, is_builtin
from ray_trainer._models import ModelSpec
from ray_trainer._worker.loading import Materialize, build_model


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
    # A pretrained model built on the meta device: fills it once placed (loading.py).
    materialize: Materialize | None = None


def build_workload(args: TrainingArgs, shipped: dict[str, bytes] | None = None) -> Workload:
    """The model, datasets and loss of this rank. ``shipped`` holds the content of data files
    the driver sent through Ray's object store (by field: ``data``, ``val_data``)."""
    if is_builtin(args.model) and args.data is None:
        return _demo_workload(args)
    spec = ModelSpec.of(args)
    model, materialize = build_model(spec)  # a pretrained model: on the meta device, unfilled
    tokenizer = spec.build_tokenizer()
    shipped = shipped or {}
    train = _dataset(args.data, args, tokenizer, shipped.get("data"))
    # A dataset that knows how to batch itself (JsonlTextDataset pads with its tokenizer's pad
    # id) brings its collate; other datasets use torch's default.
    collate = getattr(train, "collate", None)
    val = (
        _dataset(args.val_data, args, tokenizer, shipped.get("val_data"))
        if args.val_data is not None
        else None
    )
    if val is None and args.eval_every_steps:
        # Hold out 5% of the training data, the same split on every rank.
        n_val = max(1, len(train) // 20)
        train, val = random_split(
            train, [len(train) - n_val, n_val], generator=torch.Generator().manual_seed(args.seed)
        )
    loss_fn = args.loss_fn or model_loss
    return Workload(
        model, train, val, collate, loss_fn, tokenizer=tokenizer, materialize=materialize
    )


def model_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss the model computed itself (HF style: `outputs.loss` or `outputs["loss"]`)."""
    loss = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            "the model returned no loss: return one from forward() when labels are given, "
            "or set TrainingArgs.loss_fn=(outputs, batch) -> loss"
        )
    return loss


def _dataset(spec: Any, args: TrainingArgs, tokenizer: Any, content: bytes | None) -> Dataset:
    if isinstance(spec, str):
        from ray_trainer._data import JsonlTextDataset

        return JsonlTextDataset(
            spec, tokenizer, args.max_length, text_field=args.text_field, content=content
        )
    if isinstance(spec, type) or (callable(spec) and not hasattr(spec, "__getitem__")):
        spec = spec()
    return spec


def _demo_workload(args: TrainingArgs) -> Workload:
    from ray_trainer._demo import build_demo

    demo = build_demo(**args.demo)
    return Workload(
        model=demo.model_factory(),
        train_dataset=demo.train_dataset,
        val_dataset=demo.val_dataset,
        collate_fn=None,
        loss_fn=args.loss_fn or model_loss,
        rank0_metrics=demo.eval_fn,
        pad_id=demo.tokenizer.pad_id,
    )
