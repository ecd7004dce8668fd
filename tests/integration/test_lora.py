"""LoRA (issue 20) on 2 gloo workers, real Ray, a real Hugging Face model on the meta device.

Three runs from the same seed: FSDP with activation checkpointing and a crash on rank 1 (it
resumes from its adapter-only checkpoint; each checkpoint's exports are loaded in an
`EvalOnSave` task, a fresh process) to step 4, then a new call with the same run_name that
continues it to 6 with asynchronous checkpoints and the default adapter export; DDP
uninterrupted for 6 steps with asynchronous checkpoints (the reference losses). The crashed,
resumed and continued losses equal the uninterrupted ones. (Was four runs: an uninterrupted
FSDP reference beside a DDP run continued by a new call; issue 47.)
"""

from __future__ import annotations

import json
import os

import pytest
from rt_support import AllRanksRecorder, KillRank1Once, read_records

from callbacks import EvalOnSave
from ray_trainer.demo import make_tiny_causal_lm

TEXTS = [
    "the cat sat on the mat",
    "what did the dog do ? it ran home",
    "the dog sat on the mat and the cat ran home",
]
LORA = {"r": 2, "lora_alpha": 4}  # small against the base: DCP adds ~2 KiB per tensor


def eval_lora_exports(checkpoint_path: str, step: int, checkpoint_uri: str | None = None):
    """An evaluation task (a fresh process): the adapter with `PeftModel.from_pretrained` on
    the base it names, the merged model with `from_pretrained`, both against `load_model`."""
    import torch
    import transformers
    from peft import PeftModel

    from ray_trainer import load_model

    adapter = os.path.join(checkpoint_path, "hf_adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base_path = json.load(f)["base_model_name_or_path"]
    auto = transformers.AutoModelForCausalLM
    peft = PeftModel.from_pretrained(auto.from_pretrained(base_path), adapter).eval()
    merged = auto.from_pretrained(os.path.join(checkpoint_path, "hf")).eval()
    ours = load_model(checkpoint_uri)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = ours(input_ids=ids).logits
        return {
            "peft_diff": (peft(input_ids=ids).logits - ref).abs().max().item(),
            "merged_diff": (merged(input_ids=ids).logits - ref).abs().max().item(),
            "plain": float(type(ours).__name__ == "GPT2LMHeadModel"),
        }


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    from ray_trainer import run_training

    tmp = tmp_path_factory.mktemp("lora")
    model = str(make_tiny_causal_lm(tmp / "gpt2", n_layer=4, n_embd=128, dropout=0.0))
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": TEXTS[i % 3]}) + "\n" for i in range(240)))
    folder, storage = str(tmp / "records"), str(tmp / "storage")
    common = dict(
        model=model,
        data=str(data),
        lora=LORA,
        batch_size=4,
        max_length=16,
        learning_rate=1e-2,
        lr_schedule="constant",
        mixed_precision="no",
        log_every_steps=1,
        storage_path=storage,
        seed=7,
        num_workers=2,
    )
    crashed = run_training(
        **common,
        strategy="fsdp",
        activation_checkpointing=True,
        lora_export="both",
        max_steps=4,
        save_every_steps=2,
        max_failures=1,
        run_name="crashed",
        callbacks=[
            AllRanksRecorder(folder, prefix="crashed"),
            KillRank1Once(3),
            EvalOnSave(eval_lora_exports, num_gpus=0),
        ],
    )
    continued = run_training(  # the default export (an adapter), asynchronous saves
        **common, strategy="fsdp", activation_checkpointing=True, max_steps=6,
        save_every_steps=2, async_checkpoint=True, run_name="crashed",
        callbacks=[AllRanksRecorder(folder, prefix="cont")],
    )  # fmt: skip
    reference = run_training(
        **common, strategy="ddp", save_every_steps=2, async_checkpoint=True,
        lora_export="merged", max_steps=6, run_name="ddp",
        callbacks=[AllRanksRecorder(folder, prefix="ddp")],
    )  # fmt: skip
    return {
        "model": model,
        "crashed": crashed,
        "continued": continued,
        "reference": reference,
        **{f"{k}_records": read_records(folder, k) for k in ("crashed", "cont", "ddp")},
    }


@pytest.fixture(scope="module")
def qlora_run(ray_session, tmp_path_factory):
    from ray_trainer import run_training
    from ray_trainer.demo import make_tiny_chat_model

    pytest.importorskip("torchao")
    tmp = tmp_path_factory.mktemp("qlora")
    model = str(make_tiny_chat_model(tmp / "chat", style="llama3", vocab_size=512))
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": TEXTS[i % 3]}) + "\n" for i in range(240)))
    folder = str(tmp / "records")
    result = run_training(
        model=model, data=str(data), lora={**LORA, "quantize_base": "nf4"},
        lora_export="both", strategy="fsdp", activation_checkpointing=True,
        async_checkpoint=True, num_workers=2, batch_size=4, max_length=16, learning_rate=1e-2,
        lr_schedule="constant", mixed_precision="no", log_every_steps=1, max_steps=5,
        save_every_steps=2, max_failures=1, seed=7, storage_path=str(tmp / "storage"),
        run_name="qlora",
        callbacks=[AllRanksRecorder(folder, prefix="qlora"), KillRank1Once(2, in_save=True)],
    )  # fmt: skip
    return {"model": model, "result": result, "records": read_records(folder, "qlora")}


def test_qlora_on_fsdp_resumes_exactly_and_exports_both_ways(qlora_run):
    import torch
    import torch.distributed.checkpoint as dcp
    import transformers
    from peft import PeftModel

    from ray_trainer import load_model

    result, records = qlora_run["result"], qlora_run["records"]
    assert (result.global_step, result.attempts) == (5, 2)
    first, resumed = _losses(records, 0), _losses(records, 1)
    assert min(resumed) == 3 and first[3] and first[1] > resumed[5]  # from step 2; it learns
    for step in set(first) & set(resumed):  # computed again after the resume: the same loss
        assert resumed[step] == pytest.approx(first[step], rel=1e-5), (step, first, resumed)
    checkpoint = result.checkpoint_path
    keys = dcp.FileSystemReader(os.path.join(checkpoint, "shards")).read_metadata()
    weights = [k for k in keys.state_dict_metadata if not k.startswith("optim")]
    assert weights and all(".lora_" in k for k in weights), weights  # no base, 4-bit or not
    auto = transformers.AutoModelForCausalLM
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    # The adapter on the original (full-precision) base: what load_model rebuilds.
    on_original = PeftModel.from_pretrained(
        auto.from_pretrained(qlora_run["model"]), os.path.join(checkpoint, "hf_adapter")
    ).eval()
    merged = auto.from_pretrained(os.path.join(checkpoint, "hf")).eval()  # dequantized + adapter
    ours = load_model(checkpoint)
    with torch.no_grad():
        reference = ours(input_ids=ids).logits
        assert (on_original(input_ids=ids).logits - reference).abs().max() < 1e-5
        off = (merged(input_ids=ids).logits - reference).abs().max()
    assert 0 < off < 0.1 * reference.abs().max()  # NF4's rounding of the base, no more


def _losses(records, attempt=None):
    return {
        r["step"]: r["loss"]
        for r in records
        if r["event"] == "on_log" and r["rank"] == 0 and attempt in (None, r["attempt"])
    }


def test_fsdp_with_checkpointing_learns_and_a_crash_resumes_exactly(runs):
    result, records = runs["crashed"], runs["crashed_records"]
    assert (result.global_step, result.attempts) == (4, 2)
    loads = {(r["rank"], r["step"]) for r in records if r["event"] == "on_load_checkpoint"}
    assert loads == {(0, 2), (1, 2)}
    resumed, first = _losses(records, 1), _losses(records, 0)
    assert min(resumed) == 3 and resumed[3] == pytest.approx(first[3], rel=1e-5)
    reference = _losses(runs["ddp_records"])  # uninterrupted
    assert reference[6] < reference[1]
    for step in (3, 4):  # after the resume: the uninterrupted run's losses
        assert resumed[step] == pytest.approx(reference[step], rel=1e-4), (step, resumed)


def test_a_new_call_continues_exactly_and_ddp_and_fsdp_compute_the_same(runs):
    assert runs["continued"].global_step == 6 and runs["reference"].global_step == 6
    loads = [r["step"] for r in runs["cont_records"] if r["event"] == "on_load_checkpoint"]
    assert loads == [4, 4]
    losses = {**_losses(runs["crashed_records"]), **_losses(runs["cont_records"])}
    assert min(_losses(runs["cont_records"])) == 5
    reference = _losses(runs["ddp_records"])
    for step in range(1, 7):  # DDP and FSDP compute the same thing
        assert losses[step] == pytest.approx(reference[step], rel=1e-4), (step, losses)


def _files(folder):
    return {
        os.path.relpath(os.path.join(root, n), folder): os.path.getsize(os.path.join(root, n))
        for root, _, names in os.walk(folder)
        for n in names
    }


def test_a_lora_checkpoint_holds_no_base_weight(runs):
    import torch
    import torch.distributed.checkpoint as dcp

    base_bytes = os.path.getsize(os.path.join(runs["model"], "model.safetensors"))
    for result in (runs["crashed"], runs["continued"], runs["reference"]):
        files = _files(result.checkpoint_path)
        resumable = {n: size for n, size in files.items() if not n.startswith("hf")}
        assert sum(resumable.values()) < base_bytes / 2, resumable
        shards = os.path.join(result.checkpoint_path, "shards")
        if os.path.isdir(shards):
            keys = dcp.FileSystemReader(shards).read_metadata().state_dict_metadata
        else:
            keys = torch.load(os.path.join(result.checkpoint_path, "model.pt"))
        weights = [k for k in keys if not k.startswith("optim")]
        assert weights and all(".lora_" in k for k in weights), weights
    crashed = _files(runs["crashed"].checkpoint_path)
    assert {"hf_adapter/adapter_model.safetensors", "hf/model.safetensors"} <= set(crashed)
    assert crashed["hf_adapter/adapter_model.safetensors"] < base_bytes / 4
    merged = _files(runs["reference"].checkpoint_path)  # lora_export="merged"
    assert "hf/model.safetensors" in merged and "hf/adapter_config.json" not in merged


def test_every_checkpoint_loads_with_peft_and_from_pretrained_in_a_fresh_process(runs):
    evals = runs["crashed"].evaluations
    assert [e["step"] for e in evals] == [2, 4], evals
    for e in evals:
        assert e["metrics"]["peft_diff"] < 1e-5 and e["metrics"]["merged_diff"] < 1e-5, e
        assert e["metrics"]["plain"] == 1.0  # load_model merges: a plain HF model


def test_the_default_adapter_export_loads_with_peft_on_the_base_it_names(runs):
    """`lora_export="adapter"` (the continued run, asynchronous saves): `hf/` is a PEFT adapter
    folder with the tokenizer and the generation config, loaded in this process on the base."""
    import torch
    import transformers
    from peft import PeftModel

    from ray_trainer import load_model

    result = runs["continued"]
    hf = os.path.join(result.checkpoint_path, "hf")
    names = set(os.listdir(hf))
    assert {"adapter_config.json", "adapter_model.safetensors", "generation_config.json"} <= names
    assert "tokenizer.json" in names and "model.safetensors" not in names, names
    with open(os.path.join(hf, "adapter_config.json")) as f:
        assert json.load(f)["base_model_name_or_path"] == runs["model"]
    auto = transformers.AutoModelForCausalLM
    peft = PeftModel.from_pretrained(auto.from_pretrained(runs["model"]), hf).eval()
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    ours = load_model(result.checkpoint_path)
    with torch.no_grad():
        diff = peft(input_ids=ids).logits - ours(input_ids=ids).logits
    assert diff.abs().max().item() < 1e-5
