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

from ray_trainer._worker.step.micro_batches import pack_row


class PackingError(ValueError):
    """The model lets packed samples attend to each other (or cannot take packed rows)."""


def check_packed_attention(
    model: torch.nn.Module, device: Any, autocast: Any, pad_to: int = 1, layout: bool = False
) -> None:
    """Raise `PackingError` unless the model keeps packed samples apart, run on rows built as
    the loader builds them (`pad_to`: the training rows' width under ``compile=True``, so no
    new shape compiles; `layout`: the rows carry their `PackedLayout`)."""
    vocab = _vocab_size(model)
    first, second = 5, 7
    generator = torch.Generator().manual_seed(0)
    samples = [torch.randint(0, vocab, (n,), generator=generator).numpy() for n in (5, 5, 7)]
    rows = [  # the rows differ in their first sample only
        pack_row([(a, a), (samples[2], samples[2])], 0, pad_to, layout)[0] for a in samples[:2]
    ]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), autocast():
            logits = [_logits(model, row, device) for row in rows]
    except TypeError as e:
        raise PackingError(
            f"packing=True: {type(model).__name__}.forward does not take position_ids ({e}); "
            "packing needs a model whose attention keeps packed samples apart by their "
            "position_ids (Hugging Face causal LMs do); set packing=False"
        ) from None
    finally:
        model.train(was_training)
    a, b = (x[0, first : first + second].float() for x in logits)  # the second sample
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


def _logits(model: torch.nn.Module, row: dict[str, Any], device: Any) -> torch.Tensor:
    inputs = {k: v.to(device) for k, v in row.items() if k != "labels"}
    out = model(**inputs)
    return out["logits"] if isinstance(out, dict) else out.logits


def _vocab_size(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(model, "get_input_embeddings"):
        vocab = model.get_input_embeddings().num_embeddings
    return int(vocab or 2)
