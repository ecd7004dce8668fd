"""What LoRA changes in a worker, as the one object setup builds (`_worker/model/adaptation.py`):
what trains, what a checkpoint holds and loads back, what the export writes, and the adapters switched off.

One process, no Ray: a tiny GPT-2 written on the spot, wrapped as a worker wraps it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ray_trainer import TrainingArgs
from ray_trainer._demo.tiny_hf import make_tiny_causal_lm
from ray_trainer._errors import CheckpointError
from ray_trainer._model.spec import ModelSpec
from ray_trainer._worker.checkpoints.export import ModelWeights, SavePretrained, choose_export
from ray_trainer._worker.model.adaptation import LoraAdapters, LoraExport, WholeModel, adapt

LORA = {"r": 4, "lora_alpha": 8}
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(make_tiny_causal_lm(tmp_path_factory.mktemp("adapt") / "base", n_layer=2))


def _adapted(base: str, lora: dict | None, export: str = "merged"):
    from transformers import AutoModelForCausalLM

    args = TrainingArgs(model=base, lora=lora, lora_export=export)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    model, fill, adaptation = adapt(model, None, ModelSpec.of(args), args)
    assert fill is None  # not on the meta device: nothing to fill
    return model.eval(), adaptation


def test_without_lora_the_whole_model_trains_is_saved_and_exported(base):
    model, adaptation = _adapted(base, None)
    assert isinstance(adaptation, WholeModel) and adaptation.record is None
    state = model.state_dict()
    assert adaptation.trainable(model, state) is state
    assert adaptation.exported(model) is model
    assert isinstance(adaptation.weights(model, None, sharded=False), SavePretrained)
    staged = adaptation.weights(model, {k: v.clone() for k, v in state.items()}, sharded=False)
    assert isinstance(staged, ModelWeights)
    assert "lm_head.weight" not in staged.tensors  # tied to the embedding: written once
    with adaptation.disabled(model):
        assert all(p.requires_grad for p in model.parameters())


def test_with_lora_the_adapters_alone_train_and_are_saved(base):
    model, adaptation = _adapted(base, LORA)
    assert isinstance(adaptation, LoraAdapters)
    assert adaptation.record["base_model"] == base and adaptation.record["target_modules"]
    kept = adaptation.trainable(model, model.state_dict())
    assert kept and all(".lora_A." in k or ".lora_B." in k for k in kept)
    assert adaptation.exported(model) is model.get_base_model()
    assert isinstance(adaptation.weights(model, None, sharded=False), LoraExport)
    # A checkpoint without every adapter is refused; one with them loads (strict=False).
    with pytest.raises(CheckpointError, match="not this run's adapters"):
        adaptation.load(model, {}, "checkpoint_00000002")
    adaptation.load(model, {k: torch.zeros_like(v) for k, v in kept.items()}, "c")
    assert all(
        torch.count_nonzero(v) == 0
        for v in adaptation.trainable(model, model.state_dict()).values()
    )


def test_the_disabled_context_computes_as_the_base(base):
    from transformers import AutoModelForCausalLM

    model, adaptation = _adapted(base, LORA)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # non-zero B: the adapters change the output
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
        plain = AutoModelForCausalLM.from_pretrained(base).eval()(input_ids=IDS).logits
        adapted = model(input_ids=IDS).logits
        with adaptation.disabled(model):
            off = model(input_ids=IDS).logits
        back = model(input_ids=IDS).logits
    torch.testing.assert_close(off, plain, atol=1e-6, rtol=0)
    assert (adapted - plain).abs().max() > 1e-3
    torch.testing.assert_close(back, adapted, atol=0, rtol=0)  # on again after the block


@pytest.mark.parametrize("export", ["adapter", "merged", "both"])
def test_the_lora_export_folders_follow_lora_export(base, export):
    _, adaptation = _adapted(base, LORA, export)
    folders = {"adapter": ("hf", False), "merged": (None, True), "both": ("hf_adapter", True)}
    assert (adaptation.adapter_dir, adaptation.exports_model) == folders[export]


def test_setup_chooses_the_export_once(base):
    model, adaptation = _adapted(base, LORA)
    parallel = SimpleNamespace(module=lambda: model, sharded=False, config_for_export={})
    workload = SimpleNamespace(
        adaptation=adaptation, tokenizer=None, chat_template=None, end_of_turn_ids=None
    )
    export = choose_export(parallel, workload, save_hf_format=True)
    assert export is not None and export.adaptation is adaptation
    assert choose_export(parallel, workload, save_hf_format=False) is None
    plain = torch.nn.Linear(2, 2)  # cannot save itself: no export
    parallel = SimpleNamespace(module=lambda: plain, sharded=False, config_for_export={})
    workload = SimpleNamespace(adaptation=WholeModel())
    assert choose_export(parallel, workload, save_hf_format=True) is None
