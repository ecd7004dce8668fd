"""Pretrained weights built on the meta device, sharded, then filled (issue 21, point 1).

Two gloo processes without Ray run the runner's own `loading.build_model` and
`parallel.prepare` (FSDP2 per block, then the root), then gather every tensor and compare it
with ``from_pretrained``'s, tensor by tensor, in the dtype training keeps (fp32): a tiny GPT-2
(tied embeddings) and a tiny Llama saved in bf16 over several files (rotary buffers that no
file holds). One process checks DDP's path (the whole model) and the refusals.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from gloo_support import run_ranks

from ray_trainer.demo import make_tiny_causal_lm

transformers = pytest.importorskip("transformers")


def tiny_llama(path, dtype=torch.bfloat16, max_shard_size="20KB"):
    """A tiny Llama (untied head, rotary buffers) saved over several safetensors files."""
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return str(path)


def _reference(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tensors = dict(model.state_dict())
    tensors.update(dict(model.named_buffers()))
    return tensors


def _load_sharded(rank, world, paths, strategy):
    """One rank: build and prepare each model as a runner worker does; every tensor whole."""
    return [_load_one(world, path, strategy) for path in paths]


def _load_one(world, path, strategy):
    from accelerate import Accelerator

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.build import build_model
    from ray_trainer._worker.model.parallel import prepare

    args = TrainingArgs(model=path, strategy=strategy, num_workers=world, mixed_precision="no")
    model, materialize = build_model(ModelSpec.of(args))
    assert materialize is not None and next(model.parameters()).device.type == "meta"
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    parallel = prepare(
        model, args, accelerator, lambda m: torch.optim.AdamW(m.parameters()), "no", materialize
    )
    module = parallel.module()
    local = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() for p in module.parameters()
    )
    whole = {}
    for name, tensor in [*module.state_dict().items(), *module.named_buffers()]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        whole[name] = full.detach().clone()
    tied = getattr(module, "lm_head", None) is not None and (
        module.lm_head.weight is module.get_input_embeddings().weight
    )
    return {
        "tensors": whole,
        "tied": tied,
        "local": local,
        "total": sum(p.numel() for p in module.parameters()),
    }


def _assert_equal_to_from_pretrained(path, got):
    expected = _reference(path)
    assert set(got["tensors"]) == set(expected)
    for name, tensor in expected.items():
        mine = got["tensors"][name]
        assert mine.dtype == tensor.dtype, name
        assert torch.equal(mine, tensor), name  # the same value, bit for bit


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return str(make_tiny_causal_lm(tmp_path_factory.mktemp("gpt2"), n_layer=2, n_embd=32))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"))


def test_fsdp_on_two_ranks_loads_what_from_pretrained_loads(gpt2, llama):
    assert len([n for n in os.listdir(llama) if n.endswith(".safetensors")]) > 1
    ranks = run_ranks(_load_sharded, 2, [gpt2, llama], "fsdp")  # one process group: ~15 s
    for models in ranks:
        for path, tied, got in zip((gpt2, llama), (True, False), models, strict=True):
            _assert_equal_to_from_pretrained(path, got)
            assert got["tied"] is tied
            assert 0.4 < got["local"] / got["total"] < 0.6  # each rank filled its half
    # The rotary frequencies are in no file: built as from_pretrained builds them.
    buffers = {n for n in ranks[0][1]["tensors"] if "rotary_emb" in n}
    assert buffers == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}


def test_ddp_loads_the_whole_model_in_one_process(gpt2, llama, monkeypatch):
    from ray_trainer._model.pretrained import fill
    from ray_trainer._model.spec import ModelSpec

    monkeypatch.setattr(fill, "CHUNK_BYTES", 100)  # bf16 -> fp32 through many small reads

    for path in (gpt2, llama):
        model = ModelSpec(model=path).build_model()  # the same fill, unsharded, on the CPU
        got = {"tensors": {**model.state_dict(), **dict(model.named_buffers())}}
        _assert_equal_to_from_pretrained(path, got)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # Llama: untied
    gpt = ModelSpec(model=gpt2).build_model()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight  # still one parameter


def test_a_parameter_the_files_lack_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    from ray_trainer._model.pretrained import WeightsError
    from ray_trainer._model.spec import ModelSpec

    path = tiny_llama(tmp_path / "m", torch.float32, max_shard_size="10MB")
    weights = load_file(os.path.join(path, "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        ModelSpec(model=path).build_model()


def test_a_shape_that_differs_from_the_config_is_refused(tmp_path):
    from ray_trainer._model.pretrained import WeightsError
    from ray_trainer._model.spec import ModelSpec

    path = tiny_llama(tmp_path / "m", torch.float32, max_shard_size="10MB")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["intermediate_size"] = 48
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(WeightsError, match=r"mlp\.\w+_proj\.weight: the model has shape"):
        ModelSpec(model=path).build_model()


def test_a_tensor_left_on_the_meta_device_is_refused_by_name():
    from torch import nn

    from ray_trainer._model.pretrained import WeightsError, check_materialized

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.register_buffer("inv_freq", torch.ones(2), persistent=False)

    model = nn.Sequential(Block(), Block())
    check_materialized(model)  # everything real: nothing to say
    with torch.device("meta"):
        model[1].register_buffer("inv_freq", torch.ones(2), persistent=False)
    with pytest.raises(WeightsError, match=r"buffer 1\.inv_freq is still on the meta device"):
        check_materialized(model)
    model[0].proj.weight = nn.Parameter(torch.empty(2, 2, device="meta"))
    with pytest.raises(WeightsError, match=r"parameter 0\.proj\.weight is still on the meta"):
        check_materialized(model)
