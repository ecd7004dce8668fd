"""Training worker: the ``hf/`` export of a Hugging Face model, inside every checkpoint.

Runs in each training worker when a checkpoint is written (``save_hf_format``, the default), for
a model that has ``save_pretrained``. The export is what evaluation tools open
(``AutoModelForCausalLM.from_pretrained(f"{checkpoint}/hf")``, vLLM, lm-eval-harness): the
config, safetensors weights and, when the run has one, the tokenizer. Under DDP rank 0 holds
the whole model and calls ``save_pretrained``. Under FSDP no rank holds it: the weights are
gathered one tensor at a time (a collective every rank joins, in the same order) and rank 0
streams each into a safetensors file whose header it wrote from the tensors' shapes, so the
most any rank holds at once is its shards plus one whole tensor. Asynchronous checkpoints
(``async_save.py``) use the same writer (`write_weights`) from their background thread, on the
staged tensors, gathered over the checkpoint's own process group.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ray_trainer._checkpoint import HF_DIR, tied_aliases

if TYPE_CHECKING:
    from ray_trainer._worker.setup import WorkerState

#: A file of the export holds at most this many bytes (as save_pretrained's default shards).
MAX_SHARD_BYTES = 5 * 2**30
_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def exports(s: WorkerState) -> bool:
    """Whether this run's checkpoints carry an ``hf/`` export."""
    module = s.parallel.module()
    if s.args.lora is not None:  # the base's: a PeftModel saves itself whatever it wraps
        module = module.get_base_model()
    return s.args.save_hf_format and hasattr(module, "save_pretrained")


def export_hf(s: WorkerState, folder: str) -> list[str]:
    """Write ``<folder>/hf/`` (rank 0); the files it wrote, relative to `folder` (none on the
    other ranks). A collective under FSDP: every rank calls it."""
    module = s.parallel.module()
    target = os.path.join(folder, HF_DIR)
    if s.args.lora is not None:  # the adapter and/or the merged model (lora.py)
        from ray_trainer._worker.lora import lora_export

        if s.parallel.sharded or s.rank == 0:
            lora_export(module, s.args, None).write(folder, _full, s.rank == 0)
    elif s.parallel.sharded:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(module)  # this rank's shards, under the model's own names
        write_weights(target, untied(module, state), _full, s.rank == 0)
    elif s.rank == 0:
        module.save_pretrained(target, safe_serialization=True)
    if s.rank != 0:
        return []
    write_hf_files(s, target)
    return hf_files(folder)


def untied(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without a tied weight's second name (lm_head = wte: once; HF ties them back)."""
    aliases = tied_aliases(module.named_parameters(remove_duplicate=False))
    return {name: value for name, value in state.items() if name not in aliases}


def write_hf_files(s: WorkerState, target: str) -> None:
    """Rank 0: the export's config (with what training switched off put back) into `target`,
    unless it is a LoRA adapter alone; the generation config and the tokenizer into `target`
    and a LoRA adapter's folder."""
    module = s.parallel.module()
    kind = s.args.lora_export if s.args.lora is not None else None
    folders = []
    if kind in ("adapter", "both"):  # a PEFT adapter folder: no model config (the base has it)
        from ray_trainer._worker.lora import adapter_dir

        folders.append(os.path.join(os.path.dirname(target), adapter_dir(kind)))
    if kind != "adapter":
        os.makedirs(target, exist_ok=True)
        config = copy.deepcopy(module.config)
        for key, value in s.parallel.config_for_export.items():  # what training switched off
            setattr(config, key, value)
        config.save_pretrained(target)
        folders.append(target)
    generation = _generation_config(module, s.workload.end_of_turn_ids)
    for folder in folders:  # where to stop after chat training, beside the template
        if generation is not None:
            generation.save_pretrained(folder)
        write_tokenizer(s, folder)


def write_tokenizer(s: WorkerState, target: str) -> None:
    """Rank 0: the run's tokenizer (with the chat template the data was rendered with)."""
    tokenizer = s.workload.tokenizer
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        os.makedirs(target, exist_ok=True)
        if s.workload.chat_template is not None:  # the template the data was rendered with
            tokenizer.chat_template = s.workload.chat_template
        tokenizer.save_pretrained(target)


def hf_files(folder: str) -> list[str]:
    """The files of ``<folder>/hf/`` (and of a LoRA run's ``hf_adapter/``), relative to
    `folder`."""
    return sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for top in (HF_DIR, "hf_adapter")
        for root, _, names in os.walk(os.path.join(folder, top))
        for name in names
    )


def _generation_config(module: torch.nn.Module, end_of_turn: list[int] | None) -> Any:
    """The model's generation config; after chat training its end-of-sequence ids include the
    token that ends an assistant turn, so generation stops where the model learned to stop."""
    from transformers import GenerationConfig

    config = getattr(module, "generation_config", None)
    if config is None and not end_of_turn:
        return None
    config = copy.deepcopy(config) if config is not None else GenerationConfig()
    if end_of_turn:
        eos = config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        config.eos_token_id = [*eos, *(t for t in end_of_turn if t not in eos)]
    return config


def _full(tensor: Any) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def write_weights(
    target: str, tensors: dict[str, Any], whole: Callable[[Any], Any], writes: bool
) -> None:
    """Stream `tensors` into safetensors files in `target`, one whole tensor at a time, the
    headers written from the shapes first. ``whole(tensor)`` gives a tensor's whole value; under
    FSDP it is a collective that every rank calls for every tensor, in the same order, and only
    the rank that `writes` (rank 0) holds the result and writes it."""
    names = list(tensors)
    files = _plan(names, tensors)
    if writes:
        os.makedirs(target, exist_ok=True)
    for file_names, file in zip(files, _file_names(len(files)), strict=True):
        out = open(os.path.join(target, file), "wb") if writes else None  # noqa: SIM115
        try:
            if out is not None:
                out.write(_header(file_names, tensors))
            for name in file_names:
                value = whole(tensors[name])
                if out is not None:
                    out.write(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
                del value
        finally:
            if out is not None:
                out.close()
    if writes and len(files) > 1:
        weight_map = {
            n: f for ns, f in zip(files, _file_names(len(files)), strict=True) for n in ns
        }
        total = sum(_nbytes(tensors[n]) for n in names)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(target, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _nbytes(tensor: Any) -> int:
    return tensor.numel() * tensor.element_size()


def _plan(names: list[str], state: dict[str, Any]) -> list[list[str]]:
    """The weights of each file, in order, each file at most `MAX_SHARD_BYTES` (one weight
    larger than that gets a file of its own)."""
    files: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = _nbytes(state[name])
        if files[-1] and size + n > MAX_SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def _file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def _header(names: list[str], state: dict[str, Any]) -> bytes:
    """The safetensors header of one file (sizes known from the shapes: nothing gathered)."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        tensor = state[name]
        n = _nbytes(tensor)
        entries[name] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    header = json.dumps(entries, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(header)) + header
