"""LoRA (issue 20) without Ray: the `lora` field, the default target modules, the merged export's
numerics, `load_model` of a LoRA checkpoint, and every refusal, before any worker starts."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from ray_trainer import TrainingArgs, TrainingArgsError, run_training
from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

LORA = {"r": 4, "lora_alpha": 8}
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return str(make_tiny_causal_lm(tmp_path_factory.mktemp("lora") / "base", n_layer=2))


def _wrapped(model_path: str, export: str = "merged"):
    """The run's model as a DDP worker builds it (the base on meta, filled), B made non-zero."""
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.adaptation import apply_lora
    from ray_trainer._worker.model.build import build_model

    args = TrainingArgs(model=model_path, lora=LORA, lora_export=export)
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    model, fill, record = apply_lora(model, fill, spec, args)
    fill(model, torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    return args, spec, model.eval(), record


def test_the_lora_field_takes_a_lora_config_or_a_dict_and_refuses_what_is_not_supported():
    from peft import LoraConfig

    assert TrainingArgs(lora=LORA).lora == LORA
    from_config = TrainingArgs(lora=LoraConfig(r=16, lora_dropout=0.1)).lora
    assert from_config == {"r": 16, "lora_dropout": 0.1}
    cases = {
        "lora_dropot": r"did you mean 'lora_dropout'\?",
        "use_dora": "not supported by ray-trainer yet",
        "init_lora_weights": "meta device",
        "bias": "only 'none'",
    }
    values = {"lora_dropot": 0.1, "use_dora": True, "init_lora_weights": "pissa", "bias": "all"}
    for key, message in cases.items():
        with pytest.raises(TrainingArgsError, match=message):
            TrainingArgs.coerce(lora={key: values[key]})
    with pytest.raises(TrainingArgsError, match="lora"):
        TrainingArgs.coerce(lora={"r": 0})
    with pytest.raises(TrainingArgsError, match="lora_export"):
        TrainingArgs.coerce(lora=LORA, lora_export="full")


def test_default_targets_are_every_linear_layer_inside_the_blocks(base):
    from ray_trainer._lora.config import default_targets
    from ray_trainer._model.spec import ModelSpec

    gpt2 = ModelSpec(model=base).build_meta_model()
    assert default_targets(gpt2, None) == ["c_attn", "c_fc", "c_proj"]  # not lm_head

    class Net(nn.Module):  # a "proj" inside the blocks and one outside: full names
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(4, 4)}) for _ in range(2))
            self.proj = nn.Linear(4, 4)

    assert default_targets(Net(), None) == ["blocks.0.proj", "blocks.1.proj"]


def test_the_base_is_frozen_and_the_optimizer_holds_the_adapters_alone(base):
    from ray_trainer._worker.assemble import _optimizer

    args, _, model, _ = _wrapped(base)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), trainable
    optimizer = _optimizer(model, args, torch.device("cpu"))
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    adapters = {id(p) for n, p in model.named_parameters() if n in trainable}
    assert held == adapters  # no frozen base weight: no AdamW moment of the base's size
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    for n, p in model.named_parameters():
        if n not in trainable:
            assert p.grad is None and torch.equal(p, before[n]), n


def test_the_merged_export_computes_what_base_plus_adapter_computes(base, tmp_path):
    from transformers import AutoModelForCausalLM

    from ray_trainer._worker.model.adaptation import lora_export

    args, _, model, _ = _wrapped(base)
    lora_export(model, args.lora_export, args.model).write(str(tmp_path), lambda t: t, True)
    model.config.save_pretrained(tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected, atol=1e-5, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(base)(input_ids=IDS).logits
    assert (plain - expected).abs().max() > 1e-3


def _checkpoint(folder, spec, model=None, record=None):
    """A complete DDP checkpoint: the adapters alone (a LoRA run's) or a full model's."""
    from ray_trainer import _checkpoint as ckpt
    from ray_trainer._lora import trainable_names

    os.makedirs(folder)
    state = ckpt.TrainerState(global_step=2, strategy="ddp")
    weights = None
    if record is not None:
        state.extra["lora"] = record
        keep = set(trainable_names(model))
        weights = {k: v for k, v in model.state_dict().items() if k in keep}
    files = []
    if weights is not None:  # as a DDP save writes them
        torch.save(weights, os.path.join(folder, ckpt.MODEL_FILE))
        files.append(ckpt.MODEL_FILE)
    ckpt.write_rank_part(
        str(folder), rank=0, world_size=1, callback_state={}, user_state={}, extra_files=files,
        trainer_state=state, model_spec=spec,
    )  # fmt: skip
    return str(folder)


def test_load_model_of_a_lora_checkpoint_merges_or_returns_the_peft_model(base, tmp_path):
    from peft import PeftModel

    from ray_trainer import load_model

    _, spec, model, record = _wrapped(base)
    path = _checkpoint(tmp_path / "checkpoint_00000002", spec, model, record)
    merged, adapted = load_model(path), load_model(path, merge=False)
    assert type(merged).__name__ == "GPT2LMHeadModel" and isinstance(adapted, PeftModel)
    with torch.no_grad():
        expected = model(input_ids=IDS).logits
        torch.testing.assert_close(merged(input_ids=IDS).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(adapted(input_ids=IDS).logits, expected, atol=1e-6, rtol=0)


def _refused(tmp_path, message, **fields):
    import ray

    with pytest.raises(TrainingArgsError, match=message):
        run_training(storage_path=str(tmp_path / "runs"), run_name="r", max_steps=1, **fields)
    assert not ray.is_initialized()  # refused before Ray (let alone a worker) started


def test_a_model_peft_cannot_wrap_and_missing_target_modules_are_refused(base, tmp_path):
    def no_linear():
        return nn.Sequential(nn.Embedding(8, 4), nn.ModuleList([nn.LayerNorm(4)] * 2))

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat sat"}\n' * 64)
    common = {"data": str(data), "batch_size": 2}
    _refused(tmp_path, "blocks hold no nn.Linear", model=no_linear, lora=LORA, **common)
    _refused(
        tmp_path, r"no module named 'q_proj'.*c_attn, c_fc, c_proj, lm_head",
        model=base, lora={"target_modules": ["q_proj"]}, **common,
    )  # fmt: skip
    # GPT-2 ties lm_head to the input embeddings: an adapter merged into it would change both.
    for targets in (["c_attn", "lm_head"], r".*(c_attn|lm_head)"):
        _refused(
            tmp_path, r"'lm_head' is the output layer of GPT2LMHeadModel, whose weight is tied",
            model=base, lora={"target_modules": targets}, **common,
        )  # fmt: skip


def test_resuming_across_lora_and_onto_another_base_is_refused(base, tmp_path):
    from ray_trainer._lora.fingerprint import base_fingerprint
    from ray_trainer._model.spec import ModelSpec

    _, spec, model, record = _wrapped(base)
    lora_ckpt = _checkpoint(tmp_path / "a" / "checkpoint_00000002", spec, model, record)
    full_ckpt = _checkpoint(tmp_path / "b" / "checkpoint_00000002", spec)
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "the cat sat"}\n' * 64)
    common = {"data": str(data), "batch_size": 2, "model": base}
    _refused(tmp_path, "written without LoRA", resume_from=full_ckpt, lora=LORA, **common)
    _refused(tmp_path, "holds LoRA adapters", resume_from=lora_ckpt, **common)
    _refused(tmp_path, "trained with lora=", resume_from=lora_ckpt, lora={"r": 8}, **common)
    other = str(make_tiny_causal_lm(tmp_path / "other", n_layer=2, seed=1))  # same config
    _refused(
        tmp_path, "adapters of another base model",
        resume_from=lora_ckpt, lora=LORA, **{**common, "model": other},
    )  # fmt: skip
    # The same base under another path is the same base.
    moved = str(make_tiny_causal_lm(tmp_path / "moved", n_layer=2))
    assert base_fingerprint(ModelSpec(model=moved)) == record["base_fingerprint"]


def test_lm_eval_opens_an_adapter_export_on_its_base_fetched_from_a_bucket(base, tmp_path):
    from callbacks import LmEval
    from ray_trainer._worker.model.adaptation import lora_export

    args, _, model, _ = _wrapped(base, export="adapter")
    uri = f"file://{base}"  # a base named by URI, as a run on a bucket names it
    export = lora_export(model, args.lora_export, uri)
    export.write(str(tmp_path), lambda t: t, True)
    found = LmEval("t").model_arguments(str(tmp_path))
    assert found["peft"] == str(tmp_path / "hf")
    assert found["pretrained"] != uri and os.path.isfile(f"{found['pretrained']}/config.json")
