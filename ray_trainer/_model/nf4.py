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
the whole tensor's scales): a rank reads the whole weight in row blocks for those scales, then
quantizes only its own rows (`quantize_rows`, `shard_of`).

Quantized: every ``nn.Linear`` inside the model's blocks (those FSDP shards). Not quantized:
what sits outside them (the embeddings, the output head) and every norm and bias; they are
small next to the blocks and the most sensitive to rounding. Norms and biases keep the run's
dtype. The embeddings' and the head's weights, frozen like the rest of the base, are stored in
bf16 (`store_outside`), the dtype LLM checkpoints are saved in, so nothing of the files is lost
(an fp32 checkpoint loses bf16's rounding, far less than NF4 takes from its layers); they
compute in the run's dtype, each lookup's rows or the head's weight cast as they are used. In
fp32 they were about half of what a QLoRA worker holds of a 1.1B Llama.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
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
    over `world` ranks; it keeps `weight`'s dtype, the dtype it computes in. A real weight is
    quantized in row blocks (`quantize_rows`): the same codes as torchao's ``to_nf4``."""
    size = scaler_block(tuple(weight.shape), world)
    if size is None:
        raise QuantizeError(f"a weight of shape {tuple(weight.shape)} cannot be quantized")
    weight = weight.detach()
    if weight.device.type == "meta":
        return torchao_nf4().to_nf4(weight.contiguous(), BLOCK, size)
    shape, dtype = tuple(weight.shape), weight.dtype
    return quantize_rows(lambda a, b: weight[a:b], shape, dtype, size, device=weight.device)


#: The dtype of the frozen weights outside the blocks under QLoRA (`store_outside`).
OUTSIDE_DTYPE = torch.bfloat16


def store_outside(model: nn.Module, shard_modules: list[str] | None = None) -> None:
    """Store the weight of every ``nn.Embedding`` and ``nn.Linear`` outside the model's blocks
    (the embeddings and the head) in `OUTSIDE_DTYPE`, in place, real or on the meta device;
    each module still computes in its weight's former dtype: an embedding's output is cast to
    it, a linear layer casts its weight to its input's dtype (under autocast, autocast casts
    both). Tied weights stay tied."""
    from ray_trainer._model.blocks import find_blocks

    inside = {id(m) for block in find_blocks(model, shard_modules) for m in block.modules()}
    lowered: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if not isinstance(module, (nn.Embedding, nn.Linear)) or id(module) in inside:
            continue
        weight = module.weight
        if not weight.is_floating_point() or weight.element_size() <= 2:
            continue
        if id(weight) not in lowered:
            lowered[id(weight)] = nn.Parameter(weight.detach().to(OUTSIDE_DTYPE),
                                               requires_grad=False)  # fmt: skip
        module.weight = lowered[id(weight)]
        module._ray_trainer_compute_dtype = weight.dtype
        if isinstance(module, nn.Embedding):
            module.register_forward_hook(_embedding_out)
        else:
            module.forward = types.MethodType(_linear_cast, module)


def _embedding_out(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
    return output.to(module._ray_trainer_compute_dtype)


def _linear_cast(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = self.weight, self.bias
    if not torch.is_autocast_enabled(x.device.type):
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, weight, bias)


def quantize_layers(model: nn.Module, names: list[str], world: int) -> None:
    """Replace the weight of each layer in `names` by its NF4 form, frozen (in place)."""
    for name in names:
        layer = model.get_submodule(name)
        layer.weight = nn.Parameter(quantize(layer.weight, world), requires_grad=False)


#: The most values of a weight `quantize_rows` quantizes at once. The nearest-code search
#: (`nearest`) takes ~70 bytes of scratch a value (3 candidates' int64 indices and fp32
#: distances, the minimum's index), so a chunk's scratch is ~9 MiB whatever the weight's size;
#: torchao's ``to_nf4`` on a whole weight held a normalised copy of it in its dtype plus the
#: search over all 16 codes of 1M values at a time (~150 MiB measured).
CHUNK_VALUES = 2**17


def quantize_rows(
    read: Callable[[int, int], torch.Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    size: int,
    world: int = 1,
    rank: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Rank `rank`'s rows (of `world` equal parts) of the NF4 form of a 2-D weight of `shape`,
    its scales grouped `size` blocks a group, read ``read(first, last)`` rows at a time (any
    dtype; computed in `dtype` on `device`).

    Bit for bit ``torch.chunk(to_nf4(whole, BLOCK, size), world)[rank]``
    (torchao's arithmetic, in the same order), without ever holding the whole weight: a first
    pass reads every row to take each block's absolute maximum (the second-level scales are
    centred on the mean of all of them, so every rank reads them all), a second reads only this
    rank's rows to compute their codes. The most held at once is `CHUNK_VALUES` values of the
    weight and their scratch, plus the result."""
    nf4_module = torchao_nf4()
    rows, cols = shape if len(shape) == 2 else (0, 0)
    n_blocks = rows * cols // BLOCK
    if not n_blocks or rows % world or n_blocks % size or (n_blocks // size) % world:
        raise QuantizeError(
            f"a weight of shape {tuple(shape)} cannot be quantized in groups of {size} blocks "
            f"over {world} rank(s)"
        )
    # Rows a chunk: a whole number of blocks (chunks start on a block), at most CHUNK_VALUES.
    align = BLOCK // math.gcd(cols, BLOCK)
    step = max(align, CHUNK_VALUES // cols // align * align)

    def chunks(first: int, last: int):  # (first row, last row, its values on device in dtype)
        for a in range(first, last, step):
            b = min(last, a + step)
            yield a, b, read(a, b).to(device=device, dtype=dtype).reshape(-1)

    scalers = torch.empty(n_blocks, dtype=dtype, device=device)
    for a, b, values in chunks(0, rows):  # torchao's get_block_absmax, a chunk at a time
        scalers[a * cols // BLOCK : b * cols // BLOCK] = values.view(-1, BLOCK).abs().max(1).values
    # torchao's double_quantize_scalers on the whole weight's first-level scales (small).
    mean = scalers.mean()
    centred = scalers - mean
    groups = n_blocks // size
    absmax = centred.view(groups, size).abs().max(dim=1).values
    absmax = absmax.unsqueeze(-1).expand(groups, size)
    factor = 256 / (2 * absmax)
    quantized = (centred.view(groups, size) * factor).round().clamp(-128, 127)
    quantized_scalers = quantized.flatten().to(torch.int8)
    factor = factor[:, 0].contiguous()
    # This rank's part, as torch.chunk splits an NF4 tensor's inner tensors.
    first, last = rows // world * rank, rows // world * (rank + 1)
    blocks = slice(first * cols // BLOCK, last * cols // BLOCK)
    lut = nf4_module.to_nf4(torch.ones(BLOCK, dtype=dtype, device=device), BLOCK, 1).nf4
    codes = torch.empty((last - first) * cols // 2, dtype=torch.uint8, device=device)
    for a, b, values in chunks(first, last):  # torchao's convert_to_norm_float_weight
        block_scalers = scalers[a * cols // BLOCK : b * cols // BLOCK]
        scaled = values.view(-1, BLOCK) / block_scalers.unsqueeze(-1).expand(-1, BLOCK)
        index = nearest(scaled.flatten(), lut)
        codes[(a - first) * cols // 2 : (b - first) * cols // 2] = index[::2] << 4 | index[1::2]
        del values, scaled, index
    meta = nf4_module.SubclassTensorArgs(
        torch.Size((last - first, cols)), (cols, 1), 0, dtype, torch.device(device), False
    )
    return nf4_module.NF4Tensor(
        meta, BLOCK, n_blocks, size,
        quantized_scalers[blocks].clone(),
        factor[blocks.start // size : blocks.stop // size].clone(),
        mean, codes, lut,
    )  # fmt: skip


def nearest(values: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The index (uint8) of the code in the sorted `lut` nearest each of `values`: the first
    of the smallest ``(value - code).abs()``, as torchao's ``quantize_tensor_nearest`` takes it
    over all 16 codes, but compared with 3: the code the midpoints put it next to and that
    code's neighbours (rounding moves the nearest code at most one place from there: the
    distances, rounded, still fall then rise along the sorted codes). About 4x faster."""
    mids = (lut[1:] + lut[:-1]) / 2
    near = torch.bucketize(values, mids)
    first = (near - 1).clamp(0, len(lut) - 3)
    candidates = first.unsqueeze(-1) + torch.arange(3, device=values.device)
    distance = (values.unsqueeze(-1) - lut[candidates]).abs()
    return (first + distance.min(dim=-1).indices).to(torch.uint8)


def shard_of(read: Callable[[int, int], torch.Tensor], like: Any) -> torch.Tensor:
    """The weight read ``read(first, last)`` rows at a time, quantized as `like` is (an NF4
    parameter, or an FSDP DTensor of one), as a parameter of the same kind: for a DTensor, only
    the NF4 rows this rank holds (`quantize_rows`: every rank computes the same codes as the
    whole weight's quantization, and only its own)."""
    from torch.distributed.tensor import DTensor

    local = like._local_tensor if isinstance(like, DTensor) else like
    shape, size = tuple(like.shape), local.scaler_block_size
    if local.block_size != BLOCK:
        raise QuantizeError(f"an NF4 weight with blocks of {local.block_size} values")
    if not isinstance(like, DTensor):
        nf4 = quantize_rows(read, shape, like.dtype, size, device=local.device)
        return nn.Parameter(nf4, requires_grad=False)
    mesh = like.device_mesh
    rank, world = mesh.get_local_rank(), mesh.size()
    part = quantize_rows(read, shape, like.dtype, size, world, rank, local.device)
    shard = DTensor.from_local(
        part, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    return nn.Parameter(shard, requires_grad=False)


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """An NF4 weight's full-precision value (its dtype); any other tensor as it is."""
    return tensor.get_original_weight() if is_nf4(tensor) else tensor


def dequantized_shards(tensor: torch.Tensor) -> torch.Tensor:
    """An FSDP2 shard of an NF4 weight dequantized on its own rank, still a shard (NF4 blocks
    never span ranks), so that gathering it (``full_tensor()``) is a plain all-gather of the
    dtype; any other tensor as it is (a whole NF4 weight: `dequantized`, where it is written).
    Gathering the NF4 DTensor itself goes through torchao's NF4 handling of the functional
    collectives (three asynchronous all-gathers, waited when each part is read), where a rank
    died in the wait, twice, on gloo (docs/lora.md)."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(tensor, DTensor) and is_nf4(tensor._local_tensor)):
        return tensor
    local = tensor._local_tensor.get_original_weight()
    return DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False,
        shape=tensor.shape, stride=tensor.stride(),
    )  # fmt: skip


def resident_bytes(tensor: torch.Tensor) -> int:
    """The bytes `tensor` (this rank's shard of a DTensor) holds in memory: an NF4 weight's
    codes, scales and their factors, or a plain tensor's elements."""
    local = tensor._local_tensor if hasattr(tensor, "_local_tensor") else tensor
    if not is_nf4(local):
        return local.numel() * local.element_size()
    parts = (local.quantized_data, local.quantized_scalers, local.quantization_factor)
    return sum(p.numel() * p.element_size() for p in parts)
