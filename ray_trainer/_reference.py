"""Reference-pass tasks, the driver and training workers: DPO's reference log-probs, once, in storage.

Under ``objective="dpo"`` each pair's loss compares the summed log-probability of its answers
under the policy with the same sums under the reference: the model as DPO starts (a base, a
full SFT checkpoint, or one whose adapter was merged). Those sums do not change during
training, so by default (``precompute_reference=True``) they are computed once, before
training, and stored beside the pairs' token cache::

    <storage>/.ray_trainer/data-cache/<data fingerprint>/reference-<key>/
        logps-NNNNN.npy   float32, one per sequence of a piece (chosen 2i, rejected 2i + 1)
        meta.json         last: the marker that the folder is complete

The key (:func:`reference_key`) covers the data's fingerprint (records, tokenizer, template,
``max_length``), the reference model's fingerprint (a Hugging Face model's config and weights;
another model's structure and the seed it is built from) and the dtype of the pass; so a
second run on the same data and model, and every attempt of a resumed run, reuse it.

Who computes it: the driver launches :func:`reference_piece` as Ray tasks (``_driver/
reference.py``), one slice of sequences each, on GPUs when the run uses them, else on CPUs,
before any training worker starts (the whole cluster is still free). A model that needs sharding
(``strategy="fsdp"``) is instead run forward-only by the training workers themselves, sharded,
before their first step (``_worker/objectives/dpo_reference.py``); both use :func:`sequence_logps` here.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ray_trainer._data.cache import read_folder_meta, write_folder_meta
from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._storage import Location, locate

REFERENCE_VERSION = 1
#: Sequences per forward of the reference pass.
ROWS_PER_BATCH = 8
#: Target positions whose logits are made at once (fp32: 1024 x vocab x 4 bytes).
POSITIONS_PER_CHUNK = 1024


def reference_key(
    data_fingerprint: str, spec: Any, dtype: str, seed: int, quantize: Any = None
) -> str:
    """What decides a source's reference log-probs, in 20 hex digits (`quantize`: QLoRA's
    ``(kind, shard_modules)``, the reference being the 4-bit base)."""
    from ray_trainer._lora.fingerprint import base_fingerprint

    pretrained = isinstance(spec.model, str) and not spec.is_demo
    body = {
        "version": REFERENCE_VERSION,
        "data": data_fingerprint,
        "model": base_fingerprint(spec),
        # A model built from code has no weights to fingerprint: the seed builds them.
        "seed": None if pretrained else seed,
        "dtype": dtype,
    }
    if quantize is not None:  # absent otherwise: the keys of full-precision references stay
        body["quantize"] = list(quantize)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:20]


def reference_location(cache: Location, key: str) -> Location:
    """The folder of the reference log-probs `key` of the token cache at `cache`."""
    return cache.child(f"reference-{key}")


def read_meta(location: Location) -> dict[str, Any] | None:
    return read_folder_meta(location, REFERENCE_VERSION)


def read_reference(location: Location) -> np.ndarray | None:
    """Every sequence's reference log-prob (float32, in cache order), or None when the folder
    is not complete."""
    meta = read_meta(location)
    if meta is None:
        return None
    parts = [
        np.load(io.BytesIO(location.child(f"logps-{i:05d}.npy").read_bytes()), allow_pickle=False)
        for i in range(len(meta["pieces"]))
    ]
    values = np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)
    if len(values) != meta["sequences"]:
        return None
    return values


def write_piece(location: Location, index: int, values: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, np.asarray(values, dtype=np.float32), allow_pickle=False)
    location.child(f"logps-{index:05d}.npy").write_bytes(buf.getvalue())


def write_meta(location: Location, pieces: list[tuple[int, int]], **meta: Any) -> None:
    """The last word on a reference folder: its pieces ``(start, end)`` in order, then
    ``meta.json`` (complete)."""
    body = {
        "pieces": [list(p) for p in pieces],
        "sequences": sum(end - start for start, end in pieces),
        **meta,
    }
    write_folder_meta(location, REFERENCE_VERSION, body)


def slices(sequences: int, parts: int) -> list[tuple[int, int]]:
    """`sequences` cut into at most `parts` slices of whole pairs, in order."""
    pairs = sequences // 2
    parts = max(1, min(parts, pairs))
    bounds = [2 * (pairs * k // parts) for k in range(parts + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


# ---- the pass ----------------------------------------------------------------------------------


def sequence_logps(
    model: Any,
    samples: Sequence[tuple[np.ndarray, np.ndarray]],
    pad_id: int,
    device: Any,
    autocast: Callable[[], Any] | None = None,
    rows_per_batch: int = ROWS_PER_BATCH,
    batch_logps: Callable[..., Any] | None = None,
) -> np.ndarray:
    """Each sample's summed target log-probability under `model` (float32), with no
    gradient: its ``(input_ids, labels)`` right-padded in batches of `rows_per_batch`; a
    Hugging Face causal LM's head runs on the target positions only, a chunk at a time.
    `batch_logps(model, ids, labels, mask)` computes a batch's sums another way (the training
    workers' sharded model, through its own forward)."""
    import contextlib

    import torch

    out = np.zeros(len(samples), dtype=np.float32)
    context = autocast or contextlib.nullcontext
    # Batches of similar lengths (padding 43% of the positions in cache order, 1.4% sorted, on
    # bench_dpo's pairs: the pass took half the time); the values go back in sample order.
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    with torch.no_grad():
        for lo in range(0, len(order), rows_per_batch):
            rows = order[lo : lo + rows_per_batch]
            ids, labels, mask = _padded([samples[i] for i in rows], pad_id)
            with context():
                sums = (batch_logps or _batch_logps)(
                    model, ids.to(device), labels.to(device), mask.to(device)
                )
            out[rows] = sums.float().cpu().numpy()
    return out


def _padded(batch: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int) -> tuple[Any, Any, Any]:
    import torch

    width = max(len(a) for a, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (a, b) in enumerate(batch):
        ids[row, : len(a)] = torch.as_tensor(a)
        labels[row, : len(b)] = torch.as_tensor(b)
        mask[row, : len(a)] = 1
    return ids, labels, mask


def _batch_logps(model: Any, ids: Any, labels: Any, mask: Any) -> Any:
    import torch
    import torch.nn.functional as F

    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    keep = targets != IGNORE_INDEX
    row = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(ids)[keep]
    wanted = targets[keep]
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    body = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if body is not None and head is not None and getattr(inner, "config", None) is not None:
        hidden = body(input_ids=ids, attention_mask=mask, use_cache=False)[0][keep]
        picks = [
            -F.cross_entropy(head(h).float(), t, reduction="none")
            for h, t in zip(
                hidden.split(POSITIONS_PER_CHUNK), wanted.split(POSITIONS_PER_CHUNK), strict=True
            )
        ]
    else:
        outputs = model(input_ids=ids, attention_mask=mask)
        logits = outputs if isinstance(outputs, torch.Tensor) else outputs["logits"]
        picks = [-F.cross_entropy(logits[keep].float(), wanted, reduction="none")]
    values = torch.cat(picks) if picks else torch.zeros(0, device=ids.device)
    out = torch.zeros(ids.shape[0], dtype=torch.float32, device=ids.device)
    return out.index_add(0, row, values)


# ---- a reference task ----------------------------------------------------------------------------


def reference_model(spec: Any, device: Any, seed: int, quantize: Any = None) -> Any:
    """The reference, whole, on `device`, in eval mode: a pretrained model read in place (meta
    device, then filled from its safetensors), any other built from `seed`. `quantize`
    (QLoRA's ``(kind, shard_modules)``): its blocks' linear layers in 4 bits, as the trained
    model's base (each weight quantized as it is read), so that the reference is the policy
    with its adapters off."""
    import torch

    from ray_trainer._lora.config import QUANTIZE, quantize_base

    fields = {QUANTIZE: quantize[0]} if quantize is not None else {}
    shard_modules = quantize[1] if quantize is not None else None
    folder = spec.pretrained_folder()
    if folder is None:
        torch.manual_seed(seed)
        model = spec.build_model()
        quantize_base(model, fields, shard_modules)
    else:
        from ray_trainer._model.pretrained import SafetensorsFiles, empty_model, materialize

        model = empty_model(spec.hf_config())
        quantize_base(model, fields, shard_modules)
        with SafetensorsFiles(folder) as files:
            materialize(model, files, device)
    return model.to(device).eval()


def reference_piece(
    spec: Any,
    cache_name: str,
    out_name: str,
    filesystem: Any,
    index: int,
    start: int,
    end: int,
    pad_id: int,
    seed: int,
    bf16: bool = False,
    quantize: Any = None,
) -> dict[str, Any]:
    """The body of a reference task (on any node): the reference log-probs of sequences
    ``[start, end)`` of the token cache at `cache_name`, written as piece `index` of the
    reference folder `out_name`. On a GPU when the task has one (bf16 autocast with `bf16`)."""
    import torch

    from ray_trainer._data.cache import TokenCache

    started, cpu = time.perf_counter(), time.process_time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = reference_model(spec, device, seed, quantize)
    cache = TokenCache(locate(cache_name, filesystem))
    samples = cache.samples(list(range(start, end)))

    def autocast() -> Any:
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)

    values = sequence_logps(model, samples, pad_id, device, autocast)
    write_piece(locate(out_name, filesystem), index, values)
    return {
        "index": index,
        "device": device.type,
        "wall_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu,
    }
