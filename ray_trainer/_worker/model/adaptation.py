"""Training worker: what LoRA changes in a run, as one object built at setup (`adapt`).

`adapt` is the one place that asks whether a run uses LoRA. It returns the run's adaptation:
`WholeModel` (no LoRA) or `LoraAdapters`, which say what training updates (`trainable`), what a
checkpoint holds and loads back, what the ``hf/`` export writes (`weights`, the adapter and/or
the merged model), and a context in which the model computes without its adapters (`disabled`:
the base, a reference model for preference tuning). The rest of the worker asks the object and
never the run's args.

Runs in each training worker: at setup (`adapt`), and at each save of a LoRA run (the
exports). Every rank wraps the model it built with peft after the same seed, so the adapters
start identical on every rank. A pretrained base built on the meta device (``build.py``) gets
adapters on the meta device too; the fill that `apply_lora` returns gives them memory with the
base (under FSDP: this rank's shards), reads the base weights under their own names, and draws
each adapter whole from a generator seeded with the run's seed, keeping the rows this rank holds.

Under QLoRA (``lora.quantize_base``) the base's linear layers inside the blocks are NF4
(``_model/nf4.py``), quantized before peft wraps them; the rest of the base stays as below.
The base stays fp32 (the dtype of every ray-trainer run's weights; under FSDP with bf16 mixed
precision each block's parameters, base and adapters, are all-gathered in bf16 for compute).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ray_trainer._checkpoint import HF_ADAPTER_DIR, HF_DIR, tied_aliases
from ray_trainer._config.args import TrainingArgs
from ray_trainer._errors import CheckpointError
from ray_trainer._lora import quantize_base, trainable_names, wrap
from ray_trainer._lora.fingerprint import base_fingerprint, lora_state
from ray_trainer._model.nf4 import dequantized, dequantized_shards
from ray_trainer._model.pretrained.safetensors import write_weights
from ray_trainer._model.spec import ModelSpec
from ray_trainer._worker.checkpoints.export import ModelWeights, SavePretrained, untied

ADAPTER_FILE = "adapter_model.safetensors"


class WholeModel:
    """A run without LoRA: every parameter trains; checkpoints and exports hold the whole
    model."""

    record: dict[str, Any] | None = None  # nothing to record of a base
    adapter_dir: str | None = None
    exports_model = True

    def trainable(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint holds of `state`: all of it."""
        return state

    def load(self, module: nn.Module, state: dict[str, Any], name: str) -> None:
        """DDP: load a checkpoint's whole model into `module`."""
        module.load_state_dict(state)

    def exported(self, module: nn.Module) -> nn.Module:
        """The module whose ``save_pretrained`` says whether the run exports."""
        return module

    def weights(self, module: nn.Module, state: dict[str, Any] | None, sharded: bool) -> Any:
        """The export's weights: of `state` (staged copies), else of the live model (DDP: it
        saves itself; FSDP: this rank's shards under the model's own names)."""
        if state is None and not sharded:
            return SavePretrained(module)
        if state is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            state = get_model_state_dict(module)
        return ModelWeights(untied(module, state))

    def disabled(self, module: nn.Module) -> Any:
        """The model as it is: there are no adapters to disable."""
        return contextlib.nullcontext()


@dataclass
class LoraAdapters:
    """A LoRA run: the base frozen, the adapters train; checkpoints hold the adapters alone
    (with `record`, the base they belong to); the export is the adapter and/or the merged
    model, by ``lora_export`` (`kind`)."""

    record: dict[str, Any]  # what checkpoints record of the base (base, fingerprint, config)
    kind: str  # lora_export: "adapter", "merged" or "both"
    base: Any  # the run's `model`, named in the adapter's config

    @property
    def adapter_dir(self) -> str | None:
        """The checkpoint's folder of the PEFT adapter (None: the merged model alone)."""
        return None if self.kind == "merged" else adapter_dir(self.kind)

    @property
    def exports_model(self) -> bool:
        return self.kind != "adapter"

    def trainable(self, module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
        """The entries of `state` that training updates: the adapters."""
        keep = set(trainable_names(module))
        return {k: v for k, v in state.items() if k in keep}

    def load(self, module: nn.Module, state: dict[str, Any], name: str) -> None:
        """DDP: load a checkpoint's adapters, every one of them (the base is the run's own,
        checked to be the same by the driver)."""
        missing = [n for n in trainable_names(module) if n not in state]
        if missing:
            raise CheckpointError(f"{name} holds no {missing[0]}: not this run's adapters")
        module.load_state_dict(state, strict=False)

    def exported(self, module: nn.Module) -> nn.Module:
        """The base's: a PeftModel saves itself whatever it wraps."""
        return module.get_base_model()

    def weights(self, module: nn.Module, state: dict[str, Any] | None, sharded: bool) -> Any:
        """The export's weights, from `state` (trainable-only: staged copies) or the live
        adapters."""
        return lora_export(module, self.kind, self.base, state)

    def disabled(self, module: nn.Module) -> Any:
        """A context in which `module` computes as its base, without the adapters."""
        return module.disable_adapter()


def adapt(
    model: nn.Module, materialize: Any, spec: ModelSpec, args: TrainingArgs
) -> tuple[nn.Module, Any, WholeModel | LoraAdapters]:
    """The run's model (wrapped with its adapters under LoRA), its fill (None when it is not on
    the meta device) and its adaptation: the one place that asks whether a run uses LoRA."""
    if args.lora is None:
        return model, materialize, WholeModel()
    model, materialize, record = apply_lora(model, materialize, spec, args)
    return model, materialize, LoraAdapters(record, args.lora_export, args.model)


def apply_lora(
    model: nn.Module, materialize: Any, spec: ModelSpec, args: TrainingArgs
) -> tuple[nn.Module, Any, dict[str, Any]]:
    """`model` wrapped with the run's adapters, its fill (None when it is not on the meta
    device), and what its checkpoints record of the base (`lora_state`). Under
    ``lora.quantize_base`` the base's linear layers are NF4 first (QLoRA): on the meta device,
    the fill quantizes each weight as it reads it (``_model/pretrained/fill.py``)."""
    quantize_base(model, args.lora, args.fsdp_shard_modules, _world(args))
    wrapped = wrap(model, args.lora, args.fsdp_shard_modules, on_meta=materialize is not None)
    record = lora_state(spec, args.lora, base_fingerprint(spec))
    targets = wrapped.peft_config["default"].target_modules  # the defaults, resolved
    record["target_modules"] = targets if isinstance(targets, str) else sorted(targets)
    if materialize is None:
        return wrapped, None, record
    folder = spec.pretrained_folder()
    init = args.lora.get("init_lora_weights", True)

    def fill(module: nn.Module, device: torch.device) -> None:
        from ray_trainer._model.pretrained import SafetensorsFiles, materialize

        inner = module.get_base_model()
        with SafetensorsFiles(folder) as files:
            materialize(inner, files, device, rename=base_name)
        init_adapters(module, args.seed, init)

    return wrapped, fill, record


def _world(args: TrainingArgs) -> int:
    """The ranks FSDP shards the model over (1 under DDP: every rank holds it whole)."""
    import torch.distributed as dist

    if args.strategy != "fsdp" or not dist.is_initialized():
        return 1
    return dist.get_world_size()


def base_name(name: str) -> str | None:
    """The name of a wrapped model's parameter in the base's files (None: an adapter's)."""
    if ".lora_" in name:
        return None
    return name.replace(".base_layer.", ".")


def init_adapters(model: nn.Module, seed: int, init: Any) -> None:
    """Draw every adapter as peft would (A: Kaiming-uniform, or Gaussian of std 1/r; B: zero,
    unless ``init_lora_weights=False``), whole, from a generator seeded with `seed`, in the
    model's order: every rank draws the same values and keeps the rows it holds."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_A." in name or (".lora_B." in name and init is False):
                full = torch.empty(param.shape, dtype=param.dtype)
                if init == "gaussian":
                    full.normal_(0.0, 1.0 / param.shape[0], generator=generator)
                else:
                    nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)
            elif ".lora_B." in name:
                full = torch.zeros(param.shape, dtype=param.dtype)
            else:
                continue
            set_whole(param, full)


def set_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` (the whole tensor, the same on every rank) into `param`: its rows that this
    rank holds when `param` is an FSDP DTensor (no communication)."""
    if hasattr(param, "placements"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param.to_local().copy_(local)
    else:
        param.copy_(full)


# ---- exports -----------------------------------------------------------------------------------


def adapter_key(name: str) -> str:
    """An adapter parameter's key in ``adapter_model.safetensors`` (peft drops the adapter's
    name: ``...lora_A.default.weight`` -> ``...lora_A.weight``)."""
    return name.replace(".default.", ".")


def adapter_tensors(state: dict[str, Any]) -> dict[str, Any]:
    """The adapter tensors of a trainable-only state dict, under peft's keys."""
    return {adapter_key(n): t for n, t in state.items() if ".lora_" in n}


def write_adapter(
    target: str, tensors: dict[str, Any], whole: Any, writes: bool, config: Any, base: Any
) -> None:
    """A PEFT adapter folder in `target`: ``adapter_config.json`` naming `base` (the run's
    ``model``) and ``adapter_model.safetensors``. ``whole(t)`` gives a tensor's whole value: a
    collective under FSDP, called by every rank for every tensor in the same order; the rank
    that `writes` holds the results and writes them."""
    import copy
    import os

    from safetensors.torch import save_file

    values = {key: whole(t) for key, t in tensors.items()}
    if not writes:
        return
    os.makedirs(target, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in values.items()},
        os.path.join(target, ADAPTER_FILE),
        metadata={"format": "pt"},
    )
    config = copy.deepcopy(config)
    config.base_model_name_or_path = base if isinstance(base, str) else None
    config.inference_mode = True
    config.save_pretrained(target)


@dataclass
class MergePlan:
    """The merged model's tensors under the base's own names (`tensors`, what the header is
    written from: the base weights), and for each adapted weight its adapter."""

    tensors: dict[str, Any]
    adapters: dict[int, tuple[Any, Any, float, bool]] = field(default_factory=dict)

    def whole(self, gather: Any) -> Any:
        """``whole(tensor)`` for `write_weights`: the tensor's whole value (`gather`; an NF4
        weight dequantized: the 4-bit base's values, not the original weights'), plus
        ``scale * B @ A`` for an adapted weight (transposed for a ``Conv1D``). A collective
        when `gather` is: A and B are gathered right after their weight."""

        def merged(tensor: Any) -> Any:
            # QLoRA's NF4 base: written dequantized, in its dtype (under FSDP2 each rank
            # dequantizes its own rows before the gather; under DDP the rank that writes)
            value = gather(dequantized_shards(tensor))
            if value is not None:
                value = dequantized(value)
            adapter = self.adapters.get(id(tensor))
            if adapter is None:
                return value
            a, b = gather(adapter[0]), gather(adapter[1])
            if value is None:  # a rank that does not write
                return None
            delta = (b.float() @ a.float()) * adapter[2]
            delta = delta.T if adapter[3] else delta
            return (value.float() + delta.to(value.device)).to(value.dtype)

        return merged


def merge_plan(module: nn.Module, adapters: dict[str, Any] | None = None) -> MergePlan:
    """The merged export of a peft-wrapped `module`: its base weights (live: they are frozen,
    so they hold the same values whenever they are read), under the base model's names, each
    tied weight once, with `adapters` (a trainable-only state dict, e.g. staged copies; default
    the live parameters) added to the weights they adapt."""
    inner = module.get_base_model()
    prefix = "base_model.model."
    adapters = adapters if adapters is not None else dict(module.named_parameters())
    aliases = tied_aliases(inner.named_parameters(remove_duplicate=False))
    plan = MergePlan({})
    for name, tensor in inner.state_dict(keep_vars=True).items():
        if ".lora_" in name or name in aliases:
            continue
        plan.tensors[base_name(name)] = tensor
        owner, _, leaf = name.rpartition(".")
        if leaf != "weight" or not owner.endswith(".base_layer"):
            continue
        layer_name = owner.removesuffix(".base_layer")
        layer = inner.get_submodule(layer_name)
        a = adapters[f"{prefix}{layer_name}.lora_A.default.weight"]
        b = adapters[f"{prefix}{layer_name}.lora_B.default.weight"]
        plan.adapters[id(tensor)] = (a, b, layer.scaling["default"], layer.fan_in_fan_out)
    return plan


@dataclass
class LoraExport:
    """What a LoRA checkpoint exports, by ``lora_export``: the merged model in ``hf/``
    ("merged", "both") and the adapter in ``hf/`` ("adapter") or ``hf_adapter/`` ("both")."""

    kind: str
    adapters: dict[str, Any]  # peft's keys -> tensors (live or staged)
    plan: MergePlan | None
    config: Any  # the adapter's peft config
    base: Any  # the run's `model`

    def write(self, folder: str, gather: Any, writes: bool) -> None:
        """Write the exports' weights into `folder` (the configs and tokenizer are
        `write_hf_files`'); a collective when `gather` is (every rank calls it)."""
        import os

        if self.plan is not None:
            write_weights(
                os.path.join(folder, HF_DIR), self.plan.tensors, self.plan.whole(gather), writes
            )
        if self.kind != "merged":
            target = os.path.join(folder, adapter_dir(self.kind))
            write_adapter(target, self.adapters, gather, writes, self.config, self.base)


def adapter_dir(kind: str) -> str:
    """The folder of a checkpoint that holds the PEFT adapter (``lora_export`` != "merged")."""
    return HF_DIR if kind == "adapter" else HF_ADAPTER_DIR


def lora_export(
    module: nn.Module, kind: str, base: Any, state: dict[str, Any] | None = None
) -> LoraExport:
    """The exports of a LoRA run's checkpoint (``lora_export`` `kind`; `base` the run's
    ``model``), from `state` (its trainable-only state dict: live, or staged copies; default
    the live parameters)."""
    state = state if state is not None else dict(module.named_parameters())
    plan = merge_plan(module, state) if kind != "adapter" else None
    return LoraExport(kind, adapter_tensors(state), plan, module.peft_config["default"], base)
