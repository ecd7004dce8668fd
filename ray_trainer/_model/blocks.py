"""Driver and workers: a model's blocks, the modules FSDP shards and checkpointing recomputes.

The driver finds them on the model built on the meta device (to refuse a model with none before
training); each worker finds them to shard and to recompute; LoRA's default targets are the
linear layers inside them.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._errors import TrainingArgsError


class ShardingError(TrainingArgsError):
    """The model has no blocks to shard (or to checkpoint) as asked; the message lists the
    model's candidate block classes."""


def find_blocks(model: Any, names: list[str] | None = None, why: str = "fsdp") -> list[Any]:
    """The model's blocks, in order: the modules FSDP shards one by one and activation
    checkpointing recomputes. Of the classes ``names`` when given; else of the classes in a
    Hugging Face model's ``_no_split_modules``; else the children of its ``nn.ModuleList``s.

    Runs in the driver (on the model built on the meta device) and in each training worker.

    Raises:
        ShardingError: no such block, or a class in ``names`` the model does not contain.
    """
    from torch import nn

    present = {type(m).__name__ for m in model.modules()}
    wanted = list(names) if names else list(getattr(model, "_no_split_modules", None) or [])
    if names:
        missing = [n for n in names if n not in present]
        if missing:
            raise ShardingError(
                f"fsdp_shard_modules names {', '.join(map(repr, missing))}, which "
                f"{type(model).__name__} does not contain; {_candidates(model)}"
            )
    if wanted:
        blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    else:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = [child for lst in lists for child in lst]
    if not blocks:
        what = "activation_checkpointing" if why == "checkpointing" else "strategy='fsdp'"
        raise ShardingError(
            f"{what}: {type(model).__name__} has no blocks to "
            f"{'recompute' if why == 'checkpointing' else 'shard'} (no _no_split_modules and "
            f"no nn.ModuleList); name them with fsdp_shard_modules=[...]. {_candidates(model)}"
        )
    return blocks


def _candidates(model: Any) -> str:
    """The classes that look like blocks: repeated submodules with parameters."""
    from collections import Counter

    counts = Counter(
        type(m).__name__
        for m in model.modules()
        if m is not model and any(True for _ in m.parameters(recurse=True))
    )
    repeated = [name for name, n in counts.most_common() if n > 1]
    shown = ", ".join(repeated[:8]) if repeated else "none that repeat"
    return f"its candidate block classes: {shown}"
