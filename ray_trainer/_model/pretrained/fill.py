"""Every process: a module built without memory, then filled from safetensors files by name.

Runs in each training worker (a pretrained model, sharded or whole, filled with the rows this
rank holds) and wherever ``load_model`` rebuilds a model whose weights are on a bucket. The
steps: `empty_model` builds a Hugging Face model from its config with every parameter on the
meta device (buffers are computed for real, as its ``__init__`` computes them); the caller may
shard it (FSDP2 keeps meta parameters as meta DTensors); `materialize` gives the parameters
memory on the device, puts the buffers back, and `fill_from_safetensors` copies each tensor in
from the files, each rank reading only its own rows; nothing may be left unfilled.

`fill_from_safetensors` is general: any module, whole or sharded (``Shard(0)`` or
``Replicate`` DTensors on a 1-D mesh), whose parameter names are the files' tensor names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ray_trainer._model.nf4 import is_nf4, shard_of
from ray_trainer._model.pretrained.safetensors import SafetensorsFiles
from ray_trainer._model.ties import tied_aliases

#: The most a fill holds of a file at once (a tensor's rows read, then converted or moved).
CHUNK_BYTES = 16 * 2**20


class WeightsError(ValueError):
    """Weights that cannot be loaded into the model; the message names the parameter."""


def empty_model(config: Any) -> nn.Module:
    """A Hugging Face causal LM of `config` whose parameters are on the meta device (no
    memory) and fp32 (the dtype training keeps its weights in, whatever the files hold); its
    buffers (rotary frequencies and the like) are real, computed by its constructor as
    ``from_pretrained`` computes them. Tied weights are tied."""
    import transformers
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # parameters made one by one on meta are tied again here
    return model


def materialize(
    module: nn.Module, files: SafetensorsFiles, device: torch.device, rename: Any = None
) -> None:
    """Give `module`'s meta parameters memory on `device` (only this rank's shards when it
    is sharded), keep its buffers' values, then fill it from `files` (`rename`: as
    `fill_from_safetensors`). Tied weights stay tied (FSDP2's ``to_empty`` keeps a shared
    parameter shared; on a whole module they are tied again)."""
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    on_meta = [name for name, b in buffers.items() if b.device.type == "meta"]
    if on_meta:
        raise WeightsError(
            f"buffer {on_meta[0]} was computed on the meta device when the model was built, so "
            "its value is unknown; build this model without meta-device loading"
        )
    ties = tied_aliases(module.named_parameters(remove_duplicate=False))
    module.to_empty(device=device)
    for alias, kept in ties.items():  # to_empty gives an unsharded module's copies their own
        weight = module.get_parameter(kept)
        if module.get_parameter(alias) is not weight:
            owner, _, leaf = alias.rpartition(".")
            setattr(module.get_submodule(owner), leaf, weight)
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            buffer.copy_(buffers[name])
    fill_from_safetensors(module, files, getattr(module, "base_model_prefix", ""), rename)


def fill_from_safetensors(
    module: nn.Module, files: SafetensorsFiles, prefix: str = "", rename: Any = None
) -> None:
    """Copy every parameter and persistent buffer of `module` from `files`, by name (a name
    may also be found with `prefix` added or removed: a base model's checkpoint loaded into a
    model with a head). Each tensor is read in turn: a sharded one, only the rows this rank
    holds. Converts to the tensor's dtype and device. ``rename(name)`` maps a parameter's name
    to its name in the files, or to None for one the files do not hold and the caller fills
    (a LoRA adapter's: ``_worker/model/adaptation.py``).

    Raises:
        WeightsError: a parameter the files do not hold (it would keep no value), a shape
            that differs, a parameter on the meta device, or a sharding it cannot read.
    """
    groups: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    owners: dict[int, str] = {}  # a tensor's first name in `module`
    for own, tensor in module.state_dict(keep_vars=True).items():
        name = own if rename is None else rename(own)
        if name is None:
            continue
        groups.setdefault(id(tensor), []).append(name)  # tied weights: one tensor, many names
        tensors[id(tensor)] = tensor
        owners.setdefault(id(tensor), own)
    missing = []
    with torch.no_grad():
        for key, names in groups.items():
            tensor = tensors[key]
            source = _source(names, files, prefix)
            if source is None:
                if isinstance(tensor, nn.Parameter):
                    missing.append(names[0])
                continue  # a persistent buffer the files lack keeps its constructed value
            if is_nf4(tensor):
                _quantize_in(module, owners[key], tensor, files, source)
            else:
                _copy_in(names[0], tensor, files, source)
    if missing:
        shown = ", ".join(missing[:5]) + (
            f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        )
        raise WeightsError(
            f"{files.folder.name}: its safetensors files hold no {shown}; the parameter would be "
            "left uninitialised on the meta device. Load a checkpoint of this architecture, "
            "saved with save_pretrained (safetensors)"
        )
    check_materialized(module)


def check_materialized(module: nn.Module) -> None:
    """Raise `WeightsError` naming the first parameter or buffer still on the meta device."""
    for kind, items in (
        ("parameter", module.named_parameters()),
        ("buffer", module.named_buffers()),
    ):
        for name, tensor in items:
            local = _local(tensor)
            if local.device.type == "meta" or (is_nf4(local) and local.scaler_mean.is_meta):
                raise WeightsError(
                    f"{kind} {name} is still on the meta device: it was never loaded"
                )


def _source(names: list[str], files: SafetensorsFiles, prefix: str) -> str | None:
    """The name under which the files hold one of `names`."""
    for name in names:
        candidates = [name]
        if prefix:
            head = f"{prefix}."
            candidates.append(name[len(head) :] if name.startswith(head) else head + name)
        for candidate in candidates:
            if candidate in files:
                return candidate
    return None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _copy_in(name: str, tensor: torch.Tensor, files: SafetensorsFiles, source: str) -> None:
    entry = files.entries[source]
    if tuple(tensor.shape) != entry.shape:
        raise WeightsError(
            f"{name}: the model has shape {tuple(tensor.shape)}, {files.folder.name} holds "
            f"{source} with shape {entry.shape}; the config does not match the weights"
        )
    local = _local(tensor)
    if local.device.type == "meta":
        raise WeightsError(f"{name} is on the meta device: call materialize() (or to_empty) first")
    start = _first_row(name, tensor)
    if local.numel() == 0:
        return
    if local.device.type == "cpu" and local.dtype == entry.dtype and local.is_contiguous():
        files.read_into(local, entry.start + start * entry.row_bytes, entry.file)  # no copy
        return
    if local.ndim == 0:
        local.copy_(files.read(source).view(()))
        return
    # Another dtype or device: through one buffer of at most CHUNK_BYTES of the file's rows.
    step = max(1, CHUNK_BYTES // max(entry.row_bytes, 1))
    for first in range(0, local.shape[0], step):
        last = min(local.shape[0], first + step)
        local[first:last].copy_(files.read_rows(source, start + first, start + last))


def _quantize_in(
    module: nn.Module, name: str, tensor: torch.Tensor, files: SafetensorsFiles, source: str
) -> None:
    """An NF4 weight (QLoRA's base, ``_model/nf4.py``) quantized on its device as it is read
    from the files in row blocks, and put in place of `name` (this rank's rows of it when
    sharded): no full-precision copy of the weight is ever held, only one block of its rows
    (the files' reused buffer, its copy in the run's dtype) and the quantization's scratch."""
    entry = files.entries[source]
    if tuple(tensor.shape) != entry.shape:
        raise WeightsError(
            f"{name}: the model has shape {tuple(tensor.shape)}, {files.folder.name} holds "
            f"{source} with shape {entry.shape}; the config does not match the weights"
        )
    owner, _, leaf = name.rpartition(".")
    quantized = shard_of(lambda a, b: files.read_rows(source, a, b), tensor)
    setattr(module.get_submodule(owner), leaf, quantized)
    _trim_heap()


def _trim_heap() -> None:
    """Hand the heap that one weight's quantization freed back to the system (glibc's
    ``malloc_trim``). The quantization's short-lived chunks (``nf4.CHUNK_VALUES`` values'
    scratch each) fall under glibc's (raised) mmap threshold: without this a worker's memory
    grew by fragmentation, to several times the 4-bit base it kept (measured with torchao's
    whole-weight ``to_nf4``: ``bench/memory`` ``--phases qlora``). Nothing where it is not
    glibc."""
    global _LIBC
    if _LIBC is None:
        import ctypes
        import ctypes.util

        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _LIBC.malloc_trim  # noqa: B018  (glibc only)
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def _first_row(name: str, tensor: torch.Tensor) -> int:
    """The first row (along dim 0) of the whole tensor that this rank holds: 0 unless it is a
    DTensor sharded along dim 0 (this rank holds its local shape's rows from there)."""
    placements = getattr(tensor, "placements", None)
    if placements is None or all(p.is_replicate() for p in placements) or tensor.ndim == 0:
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, placements
    )
    if tuple(local_shape[1:]) != tuple(tensor.shape[1:]) or any(offset[1:]):
        raise WeightsError(
            f"{name}: sharded as {placements}; loading reads rows of dim 0 only (FSDP's "
            "default Shard(0))"
        )
    return offset[0]
