"""Training worker: the check, on the real model, that packed samples do not attend to each other.

Runs in each training worker before training, when ``packing=True``. A packed micro-batch is one
row of several samples, with ``position_ids`` restarting at each sample and no attention mask;
only an attention path that builds its mask from those positions keeps the samples apart
(transformers does for SDPA, eager and flex attention when there is no KV cache and no
attention mask). Some models and attention implementations ignore ``position_ids`` and would
let every token see the previous samples: such a model would train silently wrong. So the
worker runs the model twice on two rows that differ only in their first sample; the second
sample's logits must not move. Under FSDP the forward is a collective: every rank runs it.
"""

from __future__ import annotations

from typing import Any

import torch


class PackingError(ValueError):
    """The model lets packed samples attend to each other (or cannot take packed rows)."""


def check_packed_attention(model: torch.nn.Module, device: Any, autocast: Any, width: int) -> None:
    """Raise `PackingError` unless the model keeps packed samples apart. `width` is the row
    length to test with (the training rows' under ``compile=True``, so no new shape compiles)."""
    vocab = _vocab_size(model)
    first, second = 5, 7
    width = max(width, first + second)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (2, width), generator=generator)
    tokens[1, first:] = tokens[0, first:]  # the rows differ in their first sample only
    positions = torch.cat(
        [torch.arange(first), torch.arange(second), torch.arange(width - first - second)]
    )
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            logits = [
                _logits(model, row[None].to(device), positions[None].to(device)) for row in tokens
            ]
    except TypeError as e:
        raise PackingError(
            f"packing=True: {type(model).__name__}.forward does not take position_ids ({e}); "
            "packing needs a model whose attention keeps packed samples apart by their "
            "position_ids (Hugging Face causal LMs do); set packing=False"
        ) from None
    finally:
        model.train(was_training)
    a, b = (x[0, first : first + second].float() for x in logits)
    moved = float((a - b).abs().max())
    scale = 1.0 + float(a.abs().max())
    tolerance = (
        1e-4 if a.dtype == torch.float32 and logits[0].dtype == torch.float32 else 2e-2
    ) * scale
    if moved > tolerance:
        impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
        raise PackingError(
            f"packing=True: {type(model).__name__} (attention implementation {impl!r}) lets a "
            f"packed sample attend to the one before it (its logits moved by {moved:.3g} when "
            "only the previous sample changed), so it would train on mixed samples; use an "
            "attention implementation that honours packed position_ids (e.g. "
            "attn_implementation='sdpa' or 'flex_attention' in the model's config), or set "
            "packing=False"
        )


def _logits(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids, position_ids=positions)
    return out["logits"] if isinstance(out, dict) else out.logits


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(model, "get_input_embeddings"):
        vocab = model.get_input_embeddings().num_embeddings
    return int(vocab or 2)
