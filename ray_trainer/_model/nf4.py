"""Every process: a model's linear weights stored in NF4 (QLoRA's 4-bit base), with torchao.

Runs in each training worker (a LoRA run with ``lora={"quantize_base": "nf4"}``: the frozen
base's linear layers quantized before peft wraps them, on the meta device or on real weights),
in the driver (the same on the meta-device model, to refuse what cannot be quantized before any
worker starts) and when a pretrained fill meets a quantized weight (``pretrained/fill.py``).

torchao's ``NF4Tensor`` (the extra ``ray-trainer[qlora]``) holds a weight as 4-bit codes, one
scale per block of 64 values, and those scales quantized again to int8 per group of
`scaler_block` blocks (double quantization); ``F.linear`` on it dequantizes to the input's dtype
and computes there (bf16 under bf16 autocast or FSDP's bf16 policy, fp32 on the CPU). It
implements FSDP2's all-gather extension: under FSDP the 4-bit codes are what is sharded and
gathered. A weight must be quantized whole (the second-level scales are centred on the mean of
the whole tensor's scales): a rank quantizes the whole weight and keeps its rows (`shard_of`).

Quantized: every ``nn.Linear`` inside the model's blocks (those FSDP shards). Not quantized:
what sits outside them (the embeddings, the output head) and every norm and bias, which keep
the run's dtype; they are small next to the blocks and the most sensitive to rounding.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ray_trainer._errors import TrainingArgsError

#: The values of one first-level NF4 block (torchao's and the QLoRA paper's 64).
BLOCK = 64
#: The most first-level scales quantized together (torchao's default 256).
SCALER_BLOCK = 256
#: The ``quantize_base`` values ray-trainer knows.
KINDS = ("nf4",)
HINT = 'pip install "ray-trainer[qlora]"'


class QuantizeError(TrainingArgsError):
    """The base cannot be quantized as asked; the message names the layer and the fix."""


def torchao_nf4() -> Any:
    """torchao's NF4 module, or `QuantizeError` naming the extra to install."""
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise QuantizeError(
            f"lora.quantize_base: a 4-bit base needs torchao (>=0.18) ({e}): {HINT}"
        ) from None
    return nf4_tensor


def is_nf4(tensor: Any) -> bool:
    """Whether `tensor` (or an FSDP DTensor's local shard) is an NF4 weight."""
    local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    return hasattr(local, "quantized_data") and hasattr(local, "scaler_mean")


def scaler_block(shape: tuple[int, ...], world: int) -> int | None:
    """The second-level group size for a weight of `shape` sharded over `world` ranks: the
    largest at most `SCALER_BLOCK` that divides its blocks into groups a whole number of which
    falls on every rank. None: the weight cannot be quantized so (its size is not a multiple of
    `BLOCK` values, or its rows do not split evenly over the ranks)."""
    if len(shape) != 2 or shape[0] % world:
        return None
    numel = shape[0] * shape[1]
    if numel % (BLOCK * world):
        return None
    blocks = numel // BLOCK
    for size in range(min(SCALER_BLOCK, blocks), 0, -1):
        if blocks % size == 0 and (blocks // size) % world == 0:
            return size
    return None


def quantized_layers(model: nn.Module, shard_modules: list[str] | None = None) -> list[str]:
    """The names of the layers a 4-bit base quantizes: every ``nn.Linear`` inside the model's
    blocks. Raises `QuantizeError` for a block's linear layer torchao cannot hold (GPT-2's
    ``Conv1D``, whose weight is stored transposed) or a model whose blocks hold none."""
    from ray_trainer._model.blocks import ShardingError, find_blocks

    try:
        blocks = find_blocks(model, shard_modules)
    except ShardingError as e:
        raise QuantizeError(f"lora.quantize_base: found no blocks to quantize: {e}") from None
    names = []
    for block in blocks:
        prefix = next(n for n, m in model.named_modules() if m is block)
        for name, layer in block.named_modules():
            full = f"{prefix}.{name}" if name else prefix
            if type(layer).__name__ == "Conv1D":
                raise QuantizeError(
                    f"lora.quantize_base: {full} is a Conv1D ({type(model).__name__}'s linear "
                    "layer with a transposed weight), which torchao's NF4 cannot hold; "
                    "quantize a model built of nn.Linear (Llama, Qwen, Mistral...), or drop "
                    "quantize_base"
                )
            if isinstance(layer, nn.Linear):
                names.append(full)
    if not names:
        raise QuantizeError(
            f"lora.quantize_base: the blocks of {type(model).__name__} hold no nn.Linear to "
            "quantize; drop quantize_base"
        )
    return names


def check_quantizable(model: nn.Module, names: list[str], world: int) -> None:
    """Raise `QuantizeError` naming the first of `names` whose weight NF4 cannot hold when
    sharded over `world` ranks."""
    for name in names:
        shape = tuple(model.get_submodule(name).weight.shape)
        if scaler_block(shape, world) is None:
            raise QuantizeError(
                f"lora.quantize_base: {name}'s weight {shape} cannot be quantized to NF4 on "
                f"{world} rank(s): its size must be a multiple of {BLOCK * world} values and "
                f"its {shape[0]} rows must split evenly over the ranks; drop quantize_base or "
                "change num_workers"
            )


def quantize(weight: torch.Tensor, world: int) -> torch.Tensor:
    """`weight` (whole, real or on the meta device) as an NF4 tensor whose groups split evenly
    over `world` ranks; it keeps `weight`'s dtype, the dtype it computes in."""
    size = scaler_block(tuple(weight.shape), world)
    if size is None:
        raise QuantizeError(f"a weight of shape {tuple(weight.shape)} cannot be quantized")
    return torchao_nf4().to_nf4(weight.detach().contiguous(), BLOCK, size)


def quantize_layers(model: nn.Module, names: list[str], world: int) -> None:
    """Replace the weight of each layer in `names` by its NF4 form, frozen (in place)."""
    for name in names:
        layer = model.get_submodule(name)
        layer.weight = nn.Parameter(quantize(layer.weight, world), requires_grad=False)


def shard_of(whole: torch.Tensor, like: Any) -> torch.Tensor:
    """`whole` (a full-precision weight) quantized as `like` is (an NF4 parameter, or an FSDP
    DTensor of one), as a parameter of the same kind: for a DTensor, the NF4 rows this rank
    holds (the weight is quantized whole, then split: every rank computes the same codes)."""
    from torch.distributed.tensor import DTensor

    local = like._local_tensor if isinstance(like, DTensor) else like
    nf4 = torchao_nf4().to_nf4(
        whole.to(like.dtype).contiguous(), local.block_size, local.scaler_block_size
    )
    if not isinstance(like, DTensor):
        return nn.Parameter(nf4, requires_grad=False)
    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    part = torch.chunk(nf4, world, dim=0)[rank]
    shard = DTensor.from_local(
        part, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    return nn.Parameter(shard, requires_grad=False)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """An NF4 weight's full-precision value (its dtype); any other tensor as it is."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def resident_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` (this rank's shard of a DTensor) holds in memory: an NF4 weight's
    codes, scales and their factors, or a plain tensor's elements."""
    local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    if not is_nf4(local):
        return local.numel() * local.element_size()
    parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
    return sum(p.numel() * p.element_size() for p in parts)
