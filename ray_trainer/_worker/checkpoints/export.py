"""Training worker: the ``hf/`` export of a Hugging Face model inside every checkpoint, chosen once.

Runs in each training worker when a checkpoint is written (``save_hf_format``, the default), for
a model that has ``save_pretrained``. Setup chooses the export once (`choose_export`): whether
the run exports at all, and what its weights are, which the run's adaptation says (the whole
model, or a LoRA run's adapter and/or merged model: ``model/adaptation.py``). The export is what
evaluation tools open (``AutoModelForCausalLM.from_pretrained(f"{checkpoint}/hf")``, vLLM,
lm-eval-harness): the config, safetensors weights, the generation config and, when the run has
one, the tokenizer. Under DDP rank 0 holds the whole model and calls ``save_pretrained``. Under
FSDP no rank holds it: the weights are gathered one tensor at a time (a collective every rank
joins, in the same order) and rank 0 streams each into a safetensors file whose header it wrote
from the tensors' shapes (``_model/pretrained/safetensors.py``), so the most any rank holds at
once is its shards plus one whole tensor. Asynchronous checkpoints (``async_save.py``) write the same
weights from their background thread, from the staged tensors (`Export.weights`).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ray_trainer._checkpoint import HF_ADAPTER_DIR, HF_DIR, tied_aliases
from ray_trainer._model.pretrained.safetensors import write_weights


class Weights(Protocol):
    """An export's weights: ``write(folder, whole, writes)`` puts them into a checkpoint
    folder. ``whole(tensor)`` gives a tensor's whole value (a collective under FSDP, called by
    every rank for every tensor in the same order); only the rank that `writes` writes."""

    def write(self, folder: str, whole: Any, writes: bool) -> None: ...


class Adaptation(Protocol):
    """What the run's adaptation (``model/adaptation.py``: the whole model, or LoRA) says of
    its export."""

    adapter_dir: str | None  # the folder of a PEFT adapter, or None
    exports_model: bool  # whether ``hf/`` holds a model (with its config)

    def exported(self, module: torch.nn.Module) -> torch.nn.Module: ...

    def weights(self, module: torch.nn.Module, state: Any, sharded: bool) -> Weights: ...


def full_tensor(tensor: Any) -> torch.Tensor:
    """A tensor's whole value: an FSDP DTensor gathered (a collective), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def untied(module: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """`state` without a tied weight's second name (lm_head = wte: once; HF ties them back)."""
    aliases = tied_aliases(module.named_parameters(remove_duplicate=False))
    return {name: value for name, value in state.items() if name not in aliases}


@dataclass
class ModelWeights:
    """A whole model's weights under its own names (live shards or staged copies)."""

    tensors: dict[str, Any]

    def write(self, folder: str, whole: Any, writes: bool) -> None:
        write_weights(os.path.join(folder, HF_DIR), self.tensors, whole, writes)


@dataclass
class SavePretrained:
    """DDP's live model: rank 0 holds it whole and lets it save itself."""

    module: torch.nn.Module

    def write(self, folder: str, whole: Any, writes: bool) -> None:
        if writes:
            self.module.save_pretrained(os.path.join(folder, HF_DIR), safe_serialization=True)


@dataclass
class Export:
    """The ``hf/`` export of this run's checkpoints (`choose_export` builds it, or None)."""

    module: torch.nn.Module  # the unwrapped training module (under FSDP: sharded)
    adaptation: Adaptation
    sharded: bool
    config_for_export: dict[str, Any]  # the config values training switched off, put back
    tokenizer: Any = None
    chat_template: str | None = None  # the template the data was rendered with
    end_of_turn_ids: list[int] | None = None

    def weights(self, state: dict[str, Any] | None) -> Weights:
        """The weights to export: of `state` (a trainable-only or whole state dict, e.g.
        staged copies) or, with None, of the live model."""
        return self.adaptation.weights(self.module, state, self.sharded)

    def write(self, folder: str, rank: int) -> list[str]:
        """Write the export of the live model into `folder`; the files rank 0 wrote, relative
        to `folder` (none on the other ranks). A collective under FSDP: every rank calls it."""
        if self.sharded or rank == 0:
            self.weights(None).write(folder, full_tensor, rank == 0)
        if rank != 0:
            return []
        self.write_files(folder)
        return files(folder)

    def write_files(self, folder: str) -> None:
        """Rank 0: the export's config (with what training switched off put back) into
        ``hf/``, unless it holds a LoRA adapter alone; the generation config and the tokenizer
        into ``hf/`` and a LoRA adapter's folder."""
        target = os.path.join(folder, HF_DIR)
        folders = []
        if self.adaptation.adapter_dir is not None:  # PEFT's folder: no model config
            folders.append(os.path.join(folder, self.adaptation.adapter_dir))
        if self.adaptation.exports_model:
            os.makedirs(target, exist_ok=True)
            config = copy.deepcopy(self.module.config)
            for key, value in self.config_for_export.items():
                setattr(config, key, value)
            config.save_pretrained(target)
            folders.append(target)
        generation = generation_config(self.module, self.end_of_turn_ids)
        for path in folders:  # where to stop after chat training, beside the template
            if generation is not None:
                generation.save_pretrained(path)
            self._write_tokenizer(path)

    def _write_tokenizer(self, target: str) -> None:
        """Rank 0: the run's tokenizer, with the chat template the data was rendered with."""
        if self.tokenizer is None or not hasattr(self.tokenizer, "save_pretrained"):
            return
        os.makedirs(target, exist_ok=True)
        if self.chat_template is not None:
            self.tokenizer.chat_template = self.chat_template
        self.tokenizer.save_pretrained(target)


def choose_export(parallel: Any, workload: Any, save_hf_format: bool) -> Export | None:
    """The run's export, chosen once at setup from how the model is spread (`parallel`) and
    what it trains (`workload`), or None when its checkpoints carry none
    (``save_hf_format=False``, or a model that cannot save itself: the base's, under LoRA)."""
    module, adaptation = parallel.module(), workload.adaptation
    if not save_hf_format or not hasattr(adaptation.exported(module), "save_pretrained"):
        return None
    return Export(
        module, adaptation, parallel.sharded, parallel.config_for_export, workload.tokenizer,
        workload.chat_template, workload.end_of_turn_ids,
    )  # fmt: skip


def files(folder: str) -> list[str]:
    """The files of ``<folder>/hf/`` (and of a LoRA run's ``hf_adapter/``), relative to
    `folder`."""
    return sorted(
        os.path.relpath(os.path.join(root, name), folder)
        for top in (HF_DIR, HF_ADAPTER_DIR)
        for root, _, names in os.walk(os.path.join(folder, top))
        for name in names
    )


def generation_config(module: torch.nn.Module, end_of_turn: list[int] | None) -> Any:
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
