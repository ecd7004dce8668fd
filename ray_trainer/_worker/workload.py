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


@dataclass
class Workload:
    model: nn.Module
    train_dataset: Dataset
    val_dataset: Dataset | None
    collate_fn: Callable[[list[Any]], dict[str, torch.Tensor]] | None
    loss_fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]
    # Extra validation metrics computed on rank 0 from the unwrapped model, e.g. exact match.
    rank0_metrics: Callable[[nn.Module], dict[str, float]] | None = None


def build_workload(args: TrainingArgs) -> Workload:
    if is_builtin(args.model) and args.data is None:
        return _demo_workload(args)

    tokenizer = None
    if is_builtin(args.model):
        from ray_trainer._data import ByteTokenizer
        from ray_trainer._demo.model import TinyCausalLM, TinyLMConfig

        tokenizer = ByteTokenizer()
        overrides = {k: v for k, v in args.demo.items() if k in TinyLMConfig.__dataclass_fields__}
        overrides.setdefault("max_len", args.max_length)
        model = TinyCausalLM(TinyLMConfig(vocab_size=tokenizer.vocab_size, **overrides))
    elif isinstance(args.model, str):
        from ray_trainer._hf import load_hf_causal_lm, load_hf_tokenizer

        model = load_hf_causal_lm(args.model, allow_download=args.allow_download)
        tokenizer = load_hf_tokenizer(
            args.tokenizer or args.model, allow_download=args.allow_download
        )
    else:
        model = args.model()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model factory {args.model!r} returned {type(model).__name__}, not an nn.Module"
            )
        if args.tokenizer:
            from ray_trainer._hf import load_hf_tokenizer

            tokenizer = load_hf_tokenizer(args.tokenizer, allow_download=args.allow_download)

    train = _dataset(args.data, args, tokenizer)
    # A dataset that knows how to batch itself (JsonlTextDataset pads with its tokenizer's pad
    # id) brings its collate; other datasets use torch's default.
    collate = getattr(train, "collate", None)
    val = _dataset(args.val_data, args, tokenizer) if args.val_data is not None else None
    if val is None and args.eval_every_steps:
        # Hold out 5% of the training data, the same split on every rank.
        n_val = max(1, len(train) // 20)
        train, val = random_split(
            train, [len(train) - n_val, n_val], generator=torch.Generator().manual_seed(args.seed)
        )
    loss_fn = args.loss_fn or model_loss
    return Workload(model, train, val, collate, loss_fn)


def model_loss(outputs: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The loss the model computed itself (HF style: `outputs.loss` or `outputs["loss"]`)."""
    loss = outputs["loss"] if isinstance(outputs, dict) else getattr(outputs, "loss", None)
    if loss is None:
        raise ValueError(
            "the model returned no loss: return one from forward() when labels are given, "
            "or set TrainingArgs.loss_fn=(outputs, batch) -> loss"
        )
    return loss


def _dataset(spec: Any, args: TrainingArgs, tokenizer: Any) -> Dataset:
    if isinstance(spec, str):
        from ray_trainer._data import JsonlTextDataset

        return JsonlTextDataset(spec, tokenizer, args.max_length, text_field=args.text_field)
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
    )
