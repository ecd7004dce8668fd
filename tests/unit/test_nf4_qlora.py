"""QLoRA (issue 52) without Ray: the 4-bit base's layers and their error bounds, the refusals
before training, a base built on the meta device and quantized as it is read (no full-precision
copy kept), FSDP2 sharding and gathering the NF4 codes on two real gloo ranks, the checkpoint
(adapters alone) and both exports."""

from __future__ import annotations

import os

import pytest
import torch
from gloo_support import run_ranks
from torch import nn

from ray_trainer import TrainingArgs, TrainingArgsError

pytest.importorskip("torchao")
transformers = pytest.importorskip("transformers")

QLORA = {"r": 4, "lora_alpha": 8, "quantize_base": "nf4"}
IDS = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(path: str) -> str:
    """A tiny Llama (untied head) saved in bf16 over several safetensors files."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(
        path, max_shard_size="40KB"
    )
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return tiny_llama(str(tmp_path_factory.mktemp("qlora") / "base"))


def _built(model_path: str, strategy: str = "ddp", export: str = "both", lora=None, precision="no"):
    """The run's model as a worker builds it: on meta, quantized, wrapped, (sharded,) filled."""
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.adaptation import apply_lora
    from ray_trainer._worker.model.build import build_model
    from ray_trainer._worker.model.parallel import _shard

    args = TrainingArgs(model=model_path, lora=lora or QLORA, strategy=strategy, lora_export=export)
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    model, fill, record = apply_lora(model, fill, spec, args)
    assert fill is not None  # the meta-device path
    if strategy == "fsdp":
        _shard(model, args, torch.device("cpu"), precision)
    fill(model, torch.device("cpu"))
    return args, model, record


def _nonzero_b(model, seed: int = 1) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))


def test_the_blocks_linear_layers_are_nf4_within_their_error_bound_and_the_rest_is_not(base):
    from ray_trainer._model.nf4 import is_nf4, resident_bytes

    _, model, _ = _built(base)
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = dict(original.named_parameters())
    quantized = bf16_bytes = nf4_bytes = lowered = 0
    for name, param in model.get_base_model().named_parameters():
        source = name.replace(".base_layer.", ".")
        if ".lora_" in name:
            assert param.requires_grad
            continue
        assert not param.requires_grad  # the whole base is frozen
        leaf = source.split(".")[-2]  # the layer's name: q_proj, lm_head, norm...
        if not is_nf4(param):  # embeddings and head exact in bf16 (the files'), norms in fp32
            assert leaf not in QUANTIZED, name
            dtype = torch.bfloat16 if leaf in ("embed_tokens", "lm_head") else torch.float32
            assert param.dtype == dtype and torch.equal(param.float(), weights[source]), name
            lowered += dtype == torch.bfloat16
            continue
        assert leaf in QUANTIZED and name.endswith(".weight"), name
        quantized += 1
        whole = weights[source]
        error = (param.get_original_weight() - whole).abs()
        # NF4's 16 levels are at most 0.3038 apart on [-1, 1]: half that times each block's
        # absmax, plus the int8 double quantization of the absmax (at most ~1% of the scales').
        absmax = whole.flatten().view(-1, 64).abs().amax(dim=1, keepdim=True)
        assert (error.flatten().view(-1, 64) <= absmax * 0.16 + 1e-3).all(), name
        assert error.norm() / whole.norm() < 0.12, name
        bf16_bytes += whole.numel() * 2
        nf4_bytes += resident_bytes(param)
    assert quantized == 2 * len(QUANTIZED) and lowered == 2
    assert nf4_bytes <= 0.3 * bf16_bytes, (nf4_bytes, bf16_bytes)
    # The bf16 embeddings and head compute in the run's fp32: the embedding's rows are cast up,
    # the head's weight too, so the logits are the fp32 products of the bf16 values.
    inner = model.get_base_model()
    with torch.no_grad():
        rows = inner.model.embed_tokens(IDS)
        hidden = torch.randn(3, 64)
        logits = inner.lm_head(hidden)
    assert rows.dtype == torch.float32 and torch.equal(
        rows[0], weights["model.embed_tokens.weight"][IDS[0]]
    )
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ weights["lm_head.weight"].T, rtol=0, atol=1e-5)


def test_a_qlora_step_trains_the_adapters_and_its_loss_is_close_to_the_full_precision_base(base):
    _, model, _ = _built(base)
    lora = {k: v for k, v in QLORA.items() if k != "quantize_base"}
    _, plain, _ = _built(base, lora=lora)
    loss = model(input_ids=IDS, labels=IDS).loss
    reference = plain(input_ids=IDS, labels=IDS).loss
    assert abs(loss.item() - reference.item()) < 0.05 * reference.item()
    loss.backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    # B starts at zero, so B is what the first step moves.
    assert all(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)


def test_quantize_base_is_refused_before_training_naming_the_fix(base, tmp_path, monkeypatch):
    import sys

    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm
    from ray_trainer._driver.lora_checks import check_lora_model

    with pytest.raises(TrainingArgsError, match="not a quantization ray-trainer knows"):
        TrainingArgs.coerce(lora={"r": 4, "quantize_base": "int4"})
    # A full fine-tune of 4-bit weights has no field: quantize_base lives inside lora.
    with pytest.raises(TrainingArgsError, match="quantize_base"):
        TrainingArgs.coerce(quantize_base="nf4")
    # GPT-2's Conv1D (a transposed weight) is named, in the driver, on the meta-device model.
    gpt2 = str(make_tiny_causal_lm(tmp_path / "gpt2", n_layer=1))
    with pytest.raises(TrainingArgsError, match=r"h\.0\.attn\.c_attn is a Conv1D"):
        check_lora_model(TrainingArgs(model=gpt2, lora=QLORA))
    check_lora_model(TrainingArgs(model=base, lora=QLORA))  # a Llama is fine
    # Rows that do not split over the ranks: named with the fix.
    with pytest.raises(
        TrainingArgsError, match=r"q_proj's weight \(64, 64\) cannot be quantized to NF4 on 3 rank"
    ):
        check_lora_model(TrainingArgs(model=base, lora=QLORA, strategy="fsdp", num_workers=3))
    with pytest.raises(TrainingArgsError, match="on 3 rank"):  # elastic: 3 is one of its sizes
        check_lora_model(TrainingArgs(model=base, lora=QLORA, strategy="fsdp", num_workers=(2, 4)))
    check_lora_model(TrainingArgs(model=base, lora=QLORA, strategy="fsdp", num_workers=4))
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.delitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", False)
    monkeypatch.setitem(sys.modules, "torchao.quantization.quantize_.workflows.nf4", None)
    with pytest.raises(TrainingArgsError, match=r'pip install "ray-trainer\[qlora\]"'):
        TrainingArgs.coerce(lora=QLORA)


def test_exports_merge_the_dequantized_base_and_the_adapter_loads_on_the_original(base, tmp_path):
    from peft import PeftModel

    from ray_trainer._worker.model.adaptation import lora_export

    args, model, _ = _built(base)
    _nonzero_b(model)
    folder = str(tmp_path / "ckpt")
    lora_export(model, "both", args.model).write(folder, lambda t: t, True)
    model.config.save_pretrained(os.path.join(folder, "hf"))
    with torch.no_grad():
        qlora = model(input_ids=IDS).logits
        with model.disable_adapter():
            quantized_base = model(input_ids=IDS).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf"))
        assert merged.dtype == torch.float32
        torch.testing.assert_close(merged(input_ids=IDS).logits, qlora, atol=1e-4, rtol=0)
        original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        on_original = PeftModel.from_pretrained(original, os.path.join(folder, "hf_adapter"))
        logits = on_original(input_ids=IDS).logits
        with on_original.disable_adapter():
            original_base = on_original(input_ids=IDS).logits
    # On the original base the adapter changes the logits by what it changed on the 4-bit one
    # (not exactly: the base differs by NF4's rounding); merged into the dequantized base, the
    # export is the QLoRA model itself.
    change, trained = logits - original_base, qlora - quantized_base
    assert trained.abs().max() > 1e-2
    assert (change - trained).abs().max() < 0.25 * trained.abs().max()


def sharded_qlora(rank: int, world: int, model_path: str, folder: str) -> dict:
    from ray_trainer._model.nf4 import is_nf4, resident_bytes
    from ray_trainer._worker.checkpoints.async_save import _Gather
    from ray_trainer._worker.checkpoints.export import full_tensor
    from ray_trainer._worker.checkpoints.saving import sharded_state
    from ray_trainer._worker.model.adaptation import LoraAdapters, lora_export

    args, model, record = _built(model_path, strategy="fsdp")
    weight = model.get_submodule("base_model.model.model.layers.0.mlp.down_proj.base_layer").weight
    local = weight._local_tensor
    out = {
        "local_nf4": is_nf4(local),
        "local_rows": local.shape[0],
        "local_codes": local.quantized_data.numel(),
        "local_bytes": sum(resident_bytes(p) for p in model.parameters() if is_nf4(p)),
        "gathered": full_tensor(weight).get_original_weight(),
        # An asynchronous checkpoint's export gathers the staged rows to rank 0 (its own group).
        "async_gathered": _Gather(None, rank, world)(weight),
    }
    _nonzero_b(model)  # the same seed on both ranks: the same adapters
    from ray_trainer._worker.assemble import _optimizer

    optimizer = _optimizer(model, args, torch.device("cpu"))
    loss = model(input_ids=IDS, labels=IDS).loss
    loss.backward()
    optimizer.step()
    out["loss"] = loss.item()
    state = sharded_state(model, optimizer, LoraAdapters(record, "both", args.model))
    out["saved"] = sorted(state["model"])
    lora_export(model, "both", args.model).write(folder, full_tensor, rank == 0)
    if rank == 0:  # what write_hf_files adds: the config
        model.config.save_pretrained(os.path.join(folder, "hf"))
    with torch.no_grad():
        out["logits"] = model(input_ids=IDS).logits
    # FSDP's bf16 policy: the NF4 codes are gathered as they are, dequantized to bf16 to compute.
    _, bf16, _ = _built(model_path, strategy="fsdp", precision="bf16")
    _nonzero_b(bf16)
    loss = bf16(input_ids=IDS, labels=IDS).loss
    loss.backward()
    out["bf16_loss"] = loss.item()
    out["bf16_grads"] = all(
        p.grad is not None and p.grad.to_local().abs().sum() > 0
        for n, p in bf16.named_parameters()
        if ".lora_B." in n
    )
    # DDP (accelerate) on the same ranks: the 4-bit base left out of DDP, the adapters'
    # gradients averaged over ranks that saw different tokens.
    from accelerate import Accelerator

    from ray_trainer._worker.model.parallel import prepare

    args, ddp, _ = _built(model_path)
    codes = {n: p.quantized_data.data_ptr() for n, p in ddp.named_parameters() if is_nf4(p)}
    parallel = prepare(
        ddp, args, Accelerator(cpu=True), lambda m: _optimizer(m, args, torch.device("cpu")), "no"
    )
    ids = IDS + rank
    parallel.model(input_ids=ids, labels=ids).loss.backward()
    out["ddp_ignored"] = sorted(ddp._ddp_params_and_buffers_to_ignore)
    out["ddp_frozen"] = sorted(n for n, p in ddp.named_parameters() if not p.requires_grad)
    # Already on the CPU, the model was not moved again: every NF4 weight's codes are the ones
    # built (accelerate's move copied each of them).
    out["ddp_placed"] = codes and all(
        p.quantized_data.data_ptr() == codes[n] for n, p in ddp.named_parameters() if is_nf4(p)
    )
    out["ddp_grads"] = {n: p.grad for n, p in ddp.named_parameters() if p.grad is not None}
    return out


def test_fsdp2_shards_and_gathers_the_nf4_codes_and_ddp_leaves_them_out_on_two_ranks(
    base, tmp_path
):
    from ray_trainer._model.nf4 import is_nf4, quantize, resident_bytes

    folder = str(tmp_path / "ckpt")
    r0, r1 = run_ranks(sharded_qlora, 2, base, folder)
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    whole = original.model.layers[0].mlp.down_proj.weight
    quantized = quantize(whole, 1)
    for r in (r0, r1):
        assert r["local_nf4"] and r["local_rows"] == whole.shape[0] // 2
        assert r["local_codes"] == whole.numel() // 4  # half the rows, two codes a byte
        # Gathered: the whole weight's own quantization, exactly (quantized whole, then split).
        assert torch.equal(r["gathered"], quantize(whole, 2).get_original_weight())
        assert all(".lora_" in k for k in r["saved"]) and r["saved"]  # the adapters alone
    assert torch.equal(r0["async_gathered"], r0["gathered"]) and r1["async_gathered"] is None
    assert r0["loss"] == r1["loss"]
    # The whole frozen base is left out of DDP: the 4-bit layers, the bf16 embeddings and head,
    # the norms (each rank reads the same files); only the adapters are DDP's.
    assert r0["ddp_ignored"] == r0["ddp_frozen"] and r0["ddp_placed"]
    assert sum(".base_layer.weight" in n for n in r0["ddp_ignored"]) == 2 * len(QUANTIZED)
    assert {n for n in r0["ddp_ignored"] if "embed_tokens" in n or "lm_head" in n} == {
        "base_model.model.model.embed_tokens.weight",
        "base_model.model.lm_head.weight",
    }
    assert r0["ddp_grads"].keys() == r1["ddp_grads"].keys() and r0["ddp_grads"]
    for name, grad in r0["ddp_grads"].items():  # all-reduced: the same on both ranks
        assert ".lora_" in name and torch.equal(grad, r1["ddp_grads"][name]), name
    assert r0["bf16_grads"] and abs(r0["bf16_loss"] - r0["loss"]) < 0.02 * r0["loss"]
    assert torch.equal(r0["logits"], r1["logits"])
    assert (r0["gathered"] - quantized.get_original_weight()).abs().max() < 0.02
    # Each rank holds half of the NF4 codes and scales: under a third of its half in bf16.
    quantized = [p for p in _built(base)[1].parameters() if is_nf4(p)]
    bf16 = sum(p.numel() * 2 for p in quantized)
    assert r0["local_bytes"] == r1["local_bytes"]
    assert abs(r0["local_bytes"] - sum(map(resident_bytes, quantized)) / 2) < 0.01 * bf16
    assert r0["local_bytes"] <= 0.3 * bf16 / 2
    merged = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "hf"))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, r0["logits"], atol=1e-4, rtol=0)
    assert isinstance(original.model.layers[0].mlp.down_proj, nn.Linear)


def _trained_loss(model_path: str, lora: dict, steps: int) -> float:
    """`steps` AdamW steps of the runner's model and optimizer on fixed batches; the loss after."""
    from ray_trainer._worker.assemble import _optimizer

    torch.manual_seed(0)
    args, model, _ = _built(model_path, lora=lora)
    optimizer = _optimizer(
        model, args.model_copy(update={"learning_rate": 1e-2}), torch.device("cpu")
    )
    # Counting sequences (3, 4, 5, ... from varied starts): a pattern the adapters can learn.
    starts = torch.arange(8).view(4, 2, 1) * 7 + 3
    batches = (starts + torch.arange(16)) % 200 + 3
    for step in range(steps):
        ids = batches[step % len(batches)]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        return sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)


def test_on_the_tiny_chat_model_qlora_learns_within_5_percent_of_lora(tmp_path):
    from ray_trainer.demo import make_tiny_chat_model

    path = str(make_tiny_chat_model(tmp_path / "chat", style="llama3", vocab_size=256))
    lora = {k: v for k, v in QLORA.items() if k != "quantize_base"}
    before = _trained_loss(path, lora, 0)
    lora_loss, qlora_loss = _trained_loss(path, lora, 20), _trained_loss(path, QLORA, 20)
    print(f"loss before {before:.4f}, LoRA {lora_loss:.4f}, QLoRA {qlora_loss:.4f}")
    assert max(lora_loss, qlora_loss) < 0.95 * before  # both learn
    assert abs(qlora_loss - lora_loss) <= 0.05 * lora_loss


def test_dpos_precomputed_reference_is_the_4_bit_base_with_its_adapters_off(base):
    from ray_trainer._driver.reference import reference_quantize
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._reference import reference_key, reference_model

    args, model, _ = _built(base)
    _nonzero_b(model)
    quantize = reference_quantize(args)
    assert quantize == ("nf4", None)
    assert reference_quantize(args.model_copy(update={"lora": {"r": 4}})) is None
    spec = ModelSpec.of(args)
    reference = reference_model(spec, torch.device("cpu"), 0, quantize)
    with torch.no_grad(), model.disable_adapter():
        assert torch.equal(reference(input_ids=IDS).logits, model(input_ids=IDS).logits)
    # A cached full-precision reference is not reused for a 4-bit base, nor the reverse.
    assert reference_key("data", spec, "float32", 0) != reference_key(
        "data", spec, "float32", 0, quantize
    )


def test_compile_on_a_qlora_model_gives_the_eager_loss_and_adapter_gradients_in_one_graph(
    base, monkeypatch
):
    """``compile=True`` with a 4-bit base: the runner's own `_compile` (the whole model, as
    under DDP without the chunked loss), with "aot_eager" (dynamo's and AOTAutograd's graphs, as
    the compile tests of tests/unit): torchao's NF4 linear traces without a graph break."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from ray_trainer._model.compile_probe import missing_compile_toolchain
    from ray_trainer._worker.model.parallel import _compile

    if missing_compile_toolchain(False) is not None:
        pytest.skip("no C++ compiler for inductor")
    compile_module = nn.Module.compile
    monkeypatch.setattr(
        nn.Module, "compile", lambda m, *a, **k: compile_module(m, *a, backend="aot_eager", **k)
    )

    def step(compiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        args, model, _ = _built(base)
        _nonzero_b(model)
        if compiled:
            _compile(model, args.model_copy(update={"compile": True, "chunked_loss": False}))
        loss = model(input_ids=IDS, labels=IDS).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    torch._dynamo.reset()
    counters.clear()
    eager_loss, eager_grads = step(False)
    loss, grads = step(True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.allclose(loss, eager_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == eager_grads.keys() and all(".lora_" in n for n in grads)
    for name, grad in grads.items():
        assert torch.allclose(grad, eager_grads[name], rtol=1e-5, atol=1e-7), name
    torch._dynamo.reset()


def test_generation_eval_and_lm_eval_put_a_qlora_adapter_on_the_original_base(tmp_path):
    """A QLoRA checkpoint's adapter export is evaluated on the original, full-precision base
    (issue 52): `GenerationEval` and `LmEval` name the run's base and the adapter, the ``hf``
    backend's loader gives the base's own weights (not the 4-bit ones the run trained on) with
    the trained adapter, and a generation runs on it."""
    import json

    from callbacks import GenerationEval, LmEval
    from callbacks.builtin.generation.child.generation_child.hf import load_hf_model
    from ray_trainer._model.nf4 import dequantized
    from ray_trainer._worker.checkpoints.export import full_tensor
    from ray_trainer._worker.model.adaptation import lora_export
    from ray_trainer.demo import make_tiny_chat_model

    base = str(make_tiny_chat_model(tmp_path / "chat", style="llama3", vocab_size=256))
    args, model, _ = _built(base, export="adapter")
    _nonzero_b(model)
    checkpoint = tmp_path / "checkpoint_00000004"
    lora_export(model, "adapter", args.model).write(str(checkpoint), full_tensor, True)
    hf = str(checkpoint / "hf")
    assert (
        json.loads((checkpoint / "hf" / "adapter_config.json").read_text())[
            "base_model_name_or_path"
        ]
        == base
    )

    fn = GenerationEval(["the cat sat on the"], name="gen", backend="hf", max_new_tokens=4)
    request = fn.request(str(checkpoint))
    assert (request["model"], request["adapter"]) == (base, hf)
    assert LmEval(tasks=["hellaswag"]).model_arguments(str(checkpoint))["pretrained"] == base
    loaded = load_hf_model(request)
    original = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=loaded.dtype)
    layer = "model.layers.0.mlp.down_proj"
    evaluated = loaded.get_submodule(f"base_model.model.{layer}.base_layer").weight
    trained = model.get_submodule(f"base_model.model.{layer}.base_layer").weight
    assert torch.equal(evaluated, original.get_submodule(layer).weight)  # the original base
    assert not torch.equal(evaluated.float(), dequantized(trained).float())  # not the 4-bit one
    name = f"base_model.model.{layer}.lora_B.default.weight"
    assert torch.equal(loaded.get_parameter(name).float(), model.get_parameter(name).detach())
    metrics = fn(str(checkpoint), 4)
    assert metrics["gen/vllm"] == 0.0 and 0 < metrics["gen/answer_tokens_mean"] <= 4
