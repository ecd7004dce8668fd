"""Every process: the run's LoRA config (``TrainingArgs.lora``) and wrapping a model with peft.

Runs in the driver (validating ``TrainingArgs``, and wrapping the model built on the meta device
to refuse what peft cannot do), in each training worker (wrapping the model it trains) and
wherever ``load_model`` rebuilds a LoRA checkpoint's model. peft is imported lazily: it is the
optional extra ``ray-trainer[lora]``.

Only the fields below are supported; the others change what a LoRA layer holds or how it starts
(DoRA, ``modules_to_save``, initialisations from the base weights such as PiSSA or LoftQ, ...),
which the checkpoints, the merged export or the meta-device start do not handle yet.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from ray_trainer._errors import TrainingArgsError

#: Where a LoRA checkpoint's trainer state records the adapter config and the base fingerprint.
LORA_STATE = "lora"
#: The LoraConfig fields ray-trainer supports (the others must keep their defaults).
SUPPORTED = (
    "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules", "fan_in_fan_out",
    "use_rslora", "init_lora_weights", "layers_to_transform", "layers_pattern", "rank_pattern",
    "alpha_pattern", "task_type", "bias",
)  # fmt: skip
#: The initialisations a meta-device start can reproduce (they do not read the base weights).
INITS = (True, False, "gaussian")
#: The field of ``lora`` that is ray-trainer's own, not peft's: QLoRA's 4-bit base (``_model/nf4.py``).
QUANTIZE = "quantize_base"
_HINT = "pip install 'ray-trainer[lora]'"


class LoraSetupError(TrainingArgsError):
    """LoRA cannot be applied as asked; the message names the field and the fix."""


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise LoraSetupError(f"lora: LoRA fine-tuning needs peft: {_HINT}") from None
    return peft


def normalise_lora(value: Any) -> dict[str, Any] | None:
    """``TrainingArgs.lora`` as a plain dict of the fields the user set (a ``LoraConfig``: its
    fields that differ from the defaults), validated by building a ``LoraConfig`` from it.

    Raises:
        ValueError: an unknown or unsupported field, or a value peft refuses.
    """
    if value is None:
        return None
    peft = _peft()
    defaults = peft.LoraConfig().to_dict()
    if isinstance(value, peft.LoraConfig):
        fields = {k: v for k, v in value.to_dict().items() if v != defaults.get(k)}
        fields.pop("peft_version", None)
    elif isinstance(value, dict):
        fields = dict(value)
    else:
        raise ValueError(
            f"got {type(value).__name__}; pass a peft.LoraConfig or a dict of its fields "
            "(e.g. {'r': 16, 'lora_alpha': 32})"
        )
    quantize = fields.pop(QUANTIZE, None)
    for key in fields:
        if key not in defaults:
            close = difflib.get_close_matches(key, list(defaults), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"lora.{key}: not a LoraConfig field{hint}")
        if key not in SUPPORTED and fields[key] != defaults[key]:
            raise ValueError(
                f"lora.{key}={fields[key]!r} is not supported by ray-trainer yet; drop it "
                f"(supported: {', '.join(SUPPORTED)})"
            )
    if isinstance(fields.get("target_modules"), (set, tuple)):
        fields["target_modules"] = sorted(fields["target_modules"])
    if fields.get("init_lora_weights", True) not in INITS:
        raise ValueError(
            f"lora.init_lora_weights={fields['init_lora_weights']!r} starts the adapters from "
            "the base weights, which a model loaded on the meta device does not have yet; use "
            "True (the default), 'gaussian' or False"
        )
    if fields.get("bias", "none") != "none":
        raise ValueError(
            f"lora.bias={fields['bias']!r} trains the base model's biases too; only 'none' is "
            "supported (the checkpoints and exports hold the adapters alone)"
        )
    rank = fields.get("r", defaults["r"])
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise ValueError(f"lora.r={rank!r}: the adapters' rank must be a positive integer")
    try:
        peft.LoraConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"lora: {e}") from None
    if quantize is not None:
        fields[QUANTIZE] = _quantize_kind(quantize)
    return fields


def _quantize_kind(value: Any) -> str:
    """``lora.quantize_base`` checked: a known kind, and its library installed."""
    from ray_trainer._model.nf4 import KINDS, torchao_nf4

    if value not in KINDS:
        raise ValueError(
            f"lora.quantize_base={value!r}: not a quantization ray-trainer knows; use "
            f"{' or '.join(map(repr, KINDS))} (a 4-bit NormalFloat base, QLoRA), or leave it out"
        )
    torchao_nf4()  # QuantizeError (a ValueError) naming the extra to install
    return value


def peft_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without ray-trainer's own (``quantize_base``): what ``peft.LoraConfig`` takes."""
    return {k: v for k, v in fields.items() if k != QUANTIZE}


def linear_layers(model: Any) -> dict[str, Any]:
    """The model's layers LoRA can adapt by default, by name: ``nn.Linear`` and transformers'
    ``Conv1D`` (GPT-2's linear layer, weight transposed)."""
    from torch import nn

    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"
    }


def default_targets(model: Any, shard_modules: list[str] | None) -> list[str]:
    """Every linear layer inside the model's blocks (those FSDP shards): their last names when
    that picks no layer outside the blocks (``["c_attn", "c_fc", "c_proj"]``), else their full
    names. peft's ``"all-linear"`` knows Hugging Face models only; this knows any model."""
    from ray_trainer._model.blocks import ShardingError, find_blocks

    try:
        blocks = find_blocks(model, shard_modules)
    except ShardingError as e:
        raise LoraSetupError(
            f"lora.target_modules: not given, and the default (every linear layer inside the "
            f"model's blocks) found no blocks: name the layers, e.g. "
            f"lora={{'target_modules': [...]}}; {e}"
        ) from None
    inside = {id(m) for block in blocks for m in block.modules()}
    layers = linear_layers(model)
    chosen = [name for name, m in layers.items() if id(m) in inside]
    if not chosen:
        raise LoraSetupError(
            "lora.target_modules: the model's blocks hold no nn.Linear; name the layers to "
            f"adapt with lora={{'target_modules': [...]}}; {candidates(model)}"
        )
    leaves = sorted({name.rpartition(".")[2] for name in chosen})
    outside = [
        n for n, m in layers.items() if id(m) not in inside and n.rpartition(".")[2] in leaves
    ]
    return chosen if outside else leaves


def candidates(model: Any) -> str:
    """The layer names `target_modules` may use, for an error message."""
    names = sorted({name.rpartition(".")[2] for name in linear_layers(model)})
    shown = ", ".join(names[:20]) + (" ..." if len(names) > 20 else "")
    return f"its linear layers: {shown or 'none'}"


def lora_config(fields: dict[str, Any], model: Any, shard_modules: list[str] | None = None) -> Any:
    """The ``peft.LoraConfig`` of `fields` for `model`: default targets filled in, and
    ``task_type="CAUSAL_LM"`` for a Hugging Face causal LM (so PEFT's auto classes load the
    adapter). Raises `LoraSetupError` for target modules the model does not have."""
    peft = _peft()
    fields = peft_fields(fields)
    if fields.get("target_modules") is None:
        fields["target_modules"] = default_targets(model, shard_modules)
    targets = fields["target_modules"]
    if isinstance(targets, (list, tuple)):
        names = [name for name, _ in model.named_modules()]
        missing = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]
        if missing:
            raise LoraSetupError(
                f"lora.target_modules: {type(model).__name__} has no module named "
                f"{', '.join(map(repr, missing))}; {candidates(model)}"
            )
    head = tied_head(model)
    if head is not None and _targets(targets, head):
        raise LoraSetupError(
            f"lora.target_modules: {head!r} is the output layer of {type(model).__name__}, "
            "whose weight is tied to the input embeddings: merged into it, the adapter would "
            f"change the input embeddings too, and the export would be another model. Leave "
            f"{head!r} out of target_modules, or untie the weights (tie_word_embeddings=False "
            "in the model's config)"
        )
    from ray_trainer._model.spec import is_causal_lm

    # peft's causal-LM task wraps a Hugging Face model only (one that saves itself).
    if "task_type" not in fields and hasattr(model, "save_pretrained") and is_causal_lm(model):
        fields["task_type"] = "CAUSAL_LM"
    return peft.LoraConfig(**fields)


def tied_head(model: Any) -> str | None:
    """The name of the model's output layer when its weight is the input embeddings' (GPT-2,
    Qwen2's small models...), else None."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    if get_out is None or get_in is None:
        return None
    out, embed = get_out(), get_in()
    if out is None or embed is None or getattr(out, "weight", None) is not embed.weight:
        return None
    return next((name for name, module in model.named_modules() if module is out), None)


def _targets(targets: Any, name: str) -> bool:
    """Whether peft's ``target_modules`` (a list of name suffixes, or one regular expression)
    selects the module called `name`."""
    if isinstance(targets, str):
        return targets == name or re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith(f".{t}") for t in targets or ())


def wrap(
    model: Any,
    fields: dict[str, Any],
    shard_modules: list[str] | None = None,
    on_meta: bool = False,
) -> Any:
    """`model` wrapped by ``peft.get_peft_model``: the base frozen, LoRA layers added (random
    with torch's generator: seed it first for identical adapters on every rank). `on_meta`:
    the base is on the meta device, and the adapters are made there directly (no memory; the
    caller fills them, see ``_worker/model/adaptation.py``).

    Raises:
        LoraSetupError: peft cannot wrap this model, or nothing was adapted.
    """
    peft = _peft()
    config = lora_config(fields, model, shard_modules)
    try:
        wrapped = peft.get_peft_model(model, config, low_cpu_mem_usage=on_meta)
    except (TypeError, ValueError, RuntimeError) as e:
        raise LoraSetupError(
            f"lora: peft cannot wrap {type(model).__name__} ({e}); LoRA needs a Hugging Face "
            f"model or an nn.Module whose target_modules are linear layers; {candidates(model)}"
        ) from None
    if not trainable_names(wrapped):
        raise LoraSetupError(f"lora: no layer of {type(model).__name__} was adapted")
    return wrapped


def quantize_base(
    model: Any, fields: dict[str, Any], shard_modules: list[str] | None = None, world: int = 1
) -> list[str]:
    """Under ``lora.quantize_base`` (QLoRA), store the frozen base's linear layers in NF4 and
    its embeddings and head in bf16, in place, before peft wraps `model` (real or on the meta
    device; `world`: the ranks FSDP will shard it over, 1 under DDP). The names of the layers
    quantized (none without it).

    Raises:
        QuantizeError: a layer torchao cannot quantize, named (``_model/nf4.py``).
    """
    if fields.get(QUANTIZE) is None:
        return []
    from ray_trainer._model.nf4 import (
        check_quantizable,
        quantize_layers,
        quantized_layers,
        store_outside,
    )

    names = quantized_layers(model, shard_modules)
    check_quantizable(model, names, world)
    quantize_layers(model, names, world)
    store_outside(model, shard_modules)  # the embeddings and the head in bf16
    return names


def trainable_names(model: Any) -> list[str]:
    """The names of the parameters training updates (the adapters'), in the model's order."""
    return [name for name, p in model.named_parameters() if p.requires_grad]


def adapter_names(model: Any) -> list[str]:
    """The adapter parameters' names (``...lora_A.default.weight``)."""
    return [n for n in trainable_names(model) if ".lora_" in n]
