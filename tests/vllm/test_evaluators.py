"""GenerationEval and LmEval with the real vLLM engine (`make test-vllm`), against their hf runs.

The evaluation functions are called as an evaluation task or the evaluator actor calls them
(a local checkpoint folder, a step), with ``python=`` the vLLM env's interpreter: the same code
path as on a cluster, without Ray. Engines started: one kept for three checkpoints, one kept for
a tied-head model's two, one for the LoRA checkpoint, and one per lm-eval run on vLLM (two).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import ENV_VAR
from generation_support import TINY_CHOICE_TASK
from test_vllm_engine import ENGINE, SHORT

from callbacks import GenerationEval, LmEval

PROMPTS = [
    *[{"messages": p["messages"]} if "messages" in p else p["text"] for p in SHORT],
    "the dog ran home and the cat sat on the mat near the house " * 12,  # > one KV block
]

GEN_TASK = """\
task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{query}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
QUESTIONS = [
    {"query": "the cat sat on the", "choices": ["mat", "ran", "sky"], "gold": 0},
    {"query": "what did the dog do ? it", "choices": ["ran", "mat", "river"], "gold": 0},
    {"query": "tell me about the", "choices": ["river", "cat", "home"], "gold": 0},
    {"query": "the sky is", "choices": ["blue", "dog", "sat"], "gold": 0},
]


def _checkpoint(root: Path, step: int, model: Path) -> str:
    """A checkpoint folder whose hf/ export is `model` (a full model or a LoRA adapter)."""
    folder = root / f"checkpoint_{step:08d}"
    shutil.copytree(model, folder / "hf")
    return str(folder)


def _answers(checkpoint: str, name: str) -> list[str]:
    with open(os.path.join(checkpoint, "eval", f"{name}.jsonl")) as f:
        return [json.loads(line)["answer"] for line in f]


def _generation(name: str, backend: str, **kwargs) -> GenerationEval:
    python = os.environ[ENV_VAR] if backend == "vllm" else None
    return GenerationEval(PROMPTS, name=name, backend=backend, python=python, max_new_tokens=8,
                          engine=ENGINE, timeout_s=600, **kwargs)  # fmt: skip


def test_a_kept_engine_answers_three_checkpoints_as_transformers_does(models, tmp_path):
    kept = _generation("vllm", "vllm", keep_engine=True)
    once = _generation("hf", "hf")
    try:
        for step, model in enumerate(("c0", "c1", "c2"), start=1):
            checkpoint = _checkpoint(tmp_path, step, models[model])
            got = kept(checkpoint, step)
            once(checkpoint, step)
            assert got["vllm/vllm"] == 1.0
            assert got["vllm/engine_reused"] == (0.0 if step == 1 else 1.0)  # no second start
            assert _answers(checkpoint, "vllm") == _answers(checkpoint, "hf"), model
        assert (
            len({tuple(_answers(tmp_path / f"checkpoint_{s:08d}", "vllm")) for s in (1, 2, 3)}) == 3
        )
    finally:
        kept.close()


def _moved(source: Path, out: Path, seed: int) -> Path:
    """`source`'s weights moved a little (as a training step moves them), its tokenizer kept."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, out)
    model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(out)
    return out


def test_a_kept_engine_reloads_a_tied_head_too(tmp_path):
    """A model whose head is its input embedding (tie_word_embeddings, as small Llama 3.2 and
    Qwen2.5 models are): after the in-place reload vLLM's CPU build kept its head's prepacked
    copy of the old weights until the child had it remade; answers equal transformers'."""
    from ray_trainer._demo.chat import make_tiny_chat_model

    first = make_tiny_chat_model(tmp_path / "m1", style="llama3", num_heads=2)
    second = _moved(first, tmp_path / "m2", seed=2)
    kept, once = _generation("tied", "vllm", keep_engine=True), _generation("tied", "hf")
    try:
        for step, model in enumerate((first, second), start=1):
            checkpoint = _checkpoint(tmp_path / "ck", step, model)
            assert kept(checkpoint, step)["tied/engine_reused"] == float(step > 1)
            vllm_answers = _answers(checkpoint, "tied")
            once(checkpoint, step)
            assert vllm_answers == _answers(checkpoint, "tied"), step
    finally:
        kept.close()


def test_a_lora_checkpoint_through_vllm_unmerged_equals_its_merged_export(models, tmp_path):
    adapter = _checkpoint(tmp_path / "a", 1, models["a1"])
    merged = _checkpoint(tmp_path / "m", 1, models["a1_merged"])
    got = _generation("lora", "vllm")(adapter, 1)
    _generation("lora", "hf")(merged, 1)
    assert got["lora/vllm"] == 1.0
    assert _answers(adapter, "lora") == _answers(merged, "lora")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval") / "tasks"
    (folder / "data").mkdir(parents=True)
    (folder / "tiny.yaml").write_text(TINY_CHOICE_TASK)
    (folder / "data" / "tiny.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (folder / "gen.yaml").write_text(GEN_TASK)
    gen = [{"query": q["query"], "answer": q["choices"][0]} for q in QUESTIONS]
    (folder / "data" / "gen.jsonl").write_text("".join(json.dumps(q) + "\n" for q in gen))
    return folder


def test_lm_eval_on_vllm_scores_as_on_transformers_also_for_an_adapter(models, tasks, tmp_path):
    """A full export on a multiple-choice task; a LoRA adapter (lora_local_path, unmerged,
    max_lora_rank from its r) on a generation task: vLLM's scores within transformers'."""
    options = {"include_path": tasks, "batch_size": 4, "bootstrap_iters": 100}
    for name, task in (("c1", "tiny_choice"), ("a1", "tiny_gen")):
        checkpoint = _checkpoint(tmp_path / name, 1, models[name])
        on_vllm = LmEval([task], backend="vllm", python=os.environ[ENV_VAR],
                         model_args={"dtype": "float32", "max_model_len": 256}, **options)(
            checkpoint, 1)  # fmt: skip
        on_hf = LmEval([task], model_args={"dtype": "float32"}, **options)(checkpoint, 1)
        assert on_vllm["lm_eval/backend"] == "vllm", on_vllm
        metric = "acc" if task == "tiny_choice" else "exact_match"
        got, want = on_vllm[f"{task}/{metric}"], on_hf[f"{task}/{metric}"]
        assert abs(got - want) <= max(on_hf[f"{task}/{metric}_stderr"], 1e-9), (name, got, want)


def test_lm_eval_falls_back_to_transformers_for_what_vllm_cannot_do(models, tasks, tmp_path):
    """GPT-2 has no LoRA in vLLM; a LoRA adapter's prompt log-probabilities (multiple choice)
    are wrong or fail in vLLM: both are evaluated with hf (and peft), and say so."""
    for name, why in (("gpt2_lora", "no LoRA support"), ("a1", "log-probabilities")):
        checkpoint = _checkpoint(tmp_path / name, 1, models[name])
        got = LmEval(["tiny_choice"], include_path=tasks, backend="vllm",
                     python=os.environ[ENV_VAR], bootstrap_iters=0)(checkpoint, 1)  # fmt: skip
        assert got["lm_eval/backend"] == "hf" and why in got["lm_eval/fallback"], got
        assert 0.0 <= got["tiny_choice/acc"] <= 1.0
