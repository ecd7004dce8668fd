"""Training worker: how the model is spread over the ranks, replicated (DDP) or sharded (FSDP2).

Runs in each training worker, once per worker-group start. ``strategy="ddp"`` (the default)
replicates the model on every rank through accelerate's DDP. ``strategy="fsdp"`` shards it with
torch's own FSDP2 (``fully_shard``), each block on its own and then the root, so every rank
holds about 1/N of the parameters, gradients and optimizer state (plus the block being
computed). The same code runs on CPU (gloo) and GPU (nccl). Activation checkpointing (torch's
composable ``checkpoint``, which keeps parameter names unchanged) recomputes each block in
backward under either strategy.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ray_trainer._config.args import TrainingArgs
from ray_trainer._model.blocks import find_blocks


@dataclass
class Replicated:
    """DDP through accelerate: every rank holds the whole model, gradients and optimizer (one
    rank: the model without a DDP wrapper)."""

    accelerator: Any
    model: nn.Module  # the DDP-wrapped model (one rank: the model itself)
    optimizer: torch.optim.Optimizer
    # Config fields changed for training, to put back in an export ({"use_cache": True}).
    config_for_export: dict[str, Any] = field(default_factory=dict)
    sharded = False

    def module(self) -> nn.Module:
        """The model without its DDP wrapper (for state dicts, evaluation, export)."""
        return self.accelerator.unwrap_model(self.model)

    def no_sync(self) -> Any:
        """Accumulate gradients locally (a micro-batch that is not the step's last)."""
        return self.accelerator.no_sync(self.model)

    def scale_and_clip(self, scale: torch.Tensor, max_norm: float | None) -> Any:
        """Multiply the gradients by `scale`, clipped to `max_norm`; their norm (or None)."""
        if self.accelerator.scaler is not None:  # fp16: unscale before anything reads them
            self.accelerator.unscale_gradients()
        return scale_and_clip_(list(self.model.parameters()), scale, max_norm, sharded=False)


@dataclass
class Sharded:
    """FSDP2: the parameters, gradients and optimizer state are DTensors sharded over ranks."""

    model: nn.Module  # the fully_shard-ed model (the module itself: FSDP2 wraps in place)
    optimizer: torch.optim.Optimizer
    config_for_export: dict[str, Any] = field(default_factory=dict)
    sharded = True

    def module(self) -> nn.Module:
        return self.model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally: FSDP2 reduce-scatters only on the step's last
        micro-batch."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def scale_and_clip(self, scale: torch.Tensor, max_norm: float | None) -> Any:
        """Multiply the gradients by `scale`, clipped by the norm over every rank's shards (a
        collective when clipping: all ranks call it); their norm (or None)."""
        return scale_and_clip_(list(self.model.parameters()), scale, max_norm, sharded=True)


def scale_and_clip_(
    params: list[nn.Parameter], scale: torch.Tensor | float, max_norm: float | None, sharded: bool
) -> torch.Tensor | None:
    """``grad *= scale`` for every parameter, clipped so that the scaled gradients' norm is at
    most `max_norm`: one pass to read the norm, one to multiply (as clipping alone takes).
    Returns the norm of the scaled gradients before clipping, a device tensor (None without
    clipping). Sharded gradients (FSDP's DTensors) are scaled through their local shards, and
    their norm is summed over the ranks (an all-reduce). A `scale` known on the host (one CPU
    rank's: `SoloAgreement`) is a float, and a scale of exactly 1 multiplies nothing."""
    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if not local:
        return None
    unit = isinstance(scale, float) and scale == 1.0
    if not isinstance(scale, float):
        scale = scale.to(local[0].device)
    if max_norm is None:
        if not unit:
            torch._foreach_mul_(local, scale)
        return None
    norms = torch._foreach_norm(local)
    squares = torch.stack([n if n.dtype == torch.float32 else n.float() for n in norms])
    squares = squares.square().sum()
    if sharded:
        import torch.distributed as dist

        dist.all_reduce(squares)  # every rank holds a slice of every gradient
    norm = squares.sqrt() if unit else squares.sqrt() * scale
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    torch._foreach_mul_(local, factor if unit else factor * scale)
    return norm


def prepare(
    model: nn.Module,
    args: TrainingArgs,
    accelerator: Any,
    make_optimizer: Any,
    mixed_precision: str,
    materialize: Any = None,
) -> Replicated | Sharded:
    """Spread `model` over the ranks as `args.strategy` says and build its optimizer
    (`make_optimizer(model)`) on the result. Every rank calls it: FSDP's sharding and DDP's
    broadcast of the initial weights are collectives. A model on the meta device comes with
    `materialize(model, device)` (``build.py``), called once it is placed: under FSDP after
    sharding (each rank fills its shards), under DDP before wrapping; then the optimizer."""
    restore: dict[str, Any] = {}
    # Training never needs a Hugging Face model's KV cache: it costs memory, a recomputed block
    # would append to it again, and with one transformers would not keep packed samples apart.
    # The export gets the config's own value back.
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        restore["use_cache"] = config.use_cache
        config.use_cache = False
    if args.activation_checkpointing:
        for block in find_blocks(model, args.fsdp_shard_modules, why="checkpointing"):
            checkpoint_forward(block)  # recompute this block's activations in backward
    if args.compile:
        _compile(model, args)
    if args.strategy == "ddp":
        if materialize is not None:  # straight to the device: no host copy of the model
            materialize(model, accelerator.device)
        # A model already on the device is not moved again: accelerate's ``model.to(device)``
        # copies every NF4 weight even onto its own device (QLoRA: +120 MiB at the peak of a
        # 254M Llama's load on one worker, and 50 MiB kept).
        placed = all(_on(p.device, accelerator.device) for p in model.parameters())
        if accelerator.num_processes == 1:
            # One rank: nothing to average, so no DDP wrapper (accelerate wraps any process
            # group, even of one): no broadcast of the weights at its start (a copy of every
            # trainable weight at once: +48 MiB at the peak of a 1.1B QLoRA load), no bucket
            # copy of every gradient in each backward, no hooks. Autocast and the rest of
            # accelerate's preparation are as with DDP.
            prepared = accelerator.prepare_model(model, not placed, evaluation_mode=True)
            optimizer = accelerator.prepare_optimizer(make_optimizer(model))
            return Replicated(accelerator, prepared, optimizer, restore)
        _ddp_ignores_frozen_base(model)
        prepared, optimizer = accelerator.prepare(
            model, make_optimizer(model), device_placement=[not placed, True]
        )
        return Replicated(accelerator, prepared, optimizer, restore)
    _shard(model, args, accelerator.device, mixed_precision)
    if materialize is not None:  # this rank's shards only
        materialize(model, accelerator.device)
    return Sharded(model, make_optimizer(model), restore)


def _on(device: torch.device, target: torch.device) -> bool:
    """Whether `device` is `target` (any CPU is the CPU: accelerate's is ``cpu:0``)."""
    return device.type == target.type and (device.type == "cpu" or device.index == target.index)


def _ddp_ignores_frozen_base(model: nn.Module) -> None:
    """QLoRA's frozen base (``_model/nf4.py``: its 4-bit layers, and the embeddings, head and
    norms that stay) kept out of DDP: frozen, and the same on every rank (each read and
    quantized the same files alike), it needs neither DDP's broadcast nor its checks. The
    checks would dequantize every 4-bit weight to compare it (a whole full-precision copy of
    the base at once: 2.3x the peak of the load on a 47M-parameter block stack); the broadcast
    copies the rest into buckets of up to 250 MiB (+318 MiB at the peak of a 254M Llama's load
    on one worker, the embeddings and head in fp32)."""
    from ray_trainer._model.nf4 import is_nf4

    params = list(model.named_parameters())
    names = [name for name, p in params if not p.requires_grad]
    if any(is_nf4(p) for _, p in params):
        from torch.nn.parallel import DistributedDataParallel

        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)


def checkpoint_forward(block: nn.Module) -> None:
    """Run `block`'s forward under non-reentrant `torch.utils.checkpoint`, in place (parameter
    names unchanged): backward recomputes what it saved. torch.compile traces this form as
    one region whose recompute it plans itself; with the composable ``checkpoint(block)``
    (hooks around an eager forward) a compiled model's recompute saved other tensors than its
    forward had ("tensor at position N ... recomputed metadata"), on an H200 and on CPU alike.
    FSDP's hooks stay outside it: the block's parameters are gathered before its recompute.
    Both forwards are methods bound to the block, so a copy of the model runs its own."""
    block._ray_trainer_inner_forward = block.forward
    block.forward = types.MethodType(_checkpointed_forward, block)


def _checkpointed_forward(self: nn.Module, *inputs: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(self._ray_trainer_inner_forward, *inputs, use_reentrant=False, **kwargs)


def _compile(model: nn.Module, args: TrainingArgs) -> None:
    """`torch.compile` in place (`Module.compile`: parameter names stay as they are): each
    block under FSDP (it then shards compiled blocks), the whole model under DDP (DDP then
    wraps the compiled module), or its body when the chunked loss computes the loss (its
    number of target positions changes at every step: compiled, it would recompile)."""
    from ray_trainer._model.compile_probe import missing_compile_toolchain

    problem = missing_compile_toolchain(args.use_gpu)
    if problem:
        raise RuntimeError(problem)
    _resolve_loss_function(model)
    if args.strategy == "fsdp":
        for block in find_blocks(model, args.fsdp_shard_modules):
            block.compile()
    else:  # with the chunked loss, its body only: the chunk loop stays eager
        from ray_trainer._worker.model.chunked_loss import chunked_body

        (chunked_body(model) or model).compile()


def _resolve_loss_function(model: nn.Module) -> None:
    """Pin a Hugging Face model's loss function, resolved once here. Its ``loss_function``
    property looks the function up at every call, and for a model whose class name names no
    loss (GPT-2's ``GPT2LMHeadModel``: ``loss_type`` None) it calls ``logger.warning_once``
    first, which dynamo cannot trace: a graph break in every compiled step that computes the
    model's own loss (tests/unit/test_model_parallel_compile_graphs.py). The pinned function is the one the
    property returns (``ForCausalLMLoss`` for such a model), so the loss is unchanged."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    loss = getattr(type(inner), "loss_function", None)
    if isinstance(loss, property) and loss.fset is not None:
        inner.loss_function = inner.loss_function  # its setter keeps it on the instance


def _shard(model: nn.Module, args: TrainingArgs, device: torch.device, precision: str) -> None:
    """`fully_shard` each block, then the root, on a 1-D mesh of every rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy()  # fp32 everywhere
    if precision == "bf16":  # bf16 parameters for compute, fp32 for the gradient reduction
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # No model.to(device) first: fully_shard moves each block's states to the mesh's device as
    # it shards them, so the whole model is never on one GPU (a model larger than one fits).
    options = {
        "mesh": mesh,
        "reshard_after_forward": args.fsdp_reshard_after_forward,
        "mp_policy": policy,
    }
    for block in find_blocks(model, args.fsdp_shard_modules):
        fully_shard(block, **options)
    fully_shard(model, **options)
