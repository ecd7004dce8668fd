"""bench_eval's generation part (``--generation``): `GenerationEval` on checkpoints of one model,
with transformers, with vLLM cold (a fresh subprocess and engine per evaluation) and with vLLM
warm (``keep_engine=True``: the engine kept, each checkpoint's weights loaded in place), their
answers compared. No Ray: the function is called as its evaluation task or its evaluator actor
calls it, so the figures are the evaluation's own wall time.

The model is a tiny Llama-3-style chat model (`make_tiny_chat_model`, 2 layers, width 64, head
size 32: vLLM's CPU attention needs one of its sizes), in three checkpoints of the same shape
and tokenizer (the weights moved a little each time), asked `PROMPTS` chat questions for up to `MAX_NEW` tokens each, greedy.
vLLM runs under `--python`, the interpreter of the environment `bench/eval/vllm_env.sh` builds.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = 16
MAX_NEW = 32
ENGINE = {"dtype": "float32", "enforce_eager": True, "kv_cache_memory_bytes": 256 << 20,
          "max_model_len": 512}  # fmt: skip
#: The target: a warm evaluation takes at most a third of a cold one's wall time.
WARM_TARGET = 3.0


def checkpoints(root: Path, n: int = 3) -> list[str]:
    """`n` checkpoint folders whose hf/ exports are one model's weights moved a little each
    time (as training moves them), with the same tokenizer."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from ray_trainer._demo.chat import make_tiny_chat_model

    first = root / "checkpoint_00000001"
    make_tiny_chat_model(first / "hf", style="llama3", num_heads=2, max_position_embeddings=512)
    out = [str(first)]
    for step in range(2, n + 1):
        folder = root / f"checkpoint_{step:08d}"
        shutil.copytree(first, folder)
        model = AutoModelForCausalLM.from_pretrained(folder / "hf")
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(step)
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        model.save_pretrained(folder / "hf")
        out.append(str(folder))
    return out


def prompts() -> list[Any]:
    topics = ["the river", "the cat", "the sky", "a dog", "the house", "rain", "the sea", "bread"]
    return [
        [{"role": "user", "content": f"tell me about {topics[i % len(topics)]} ({i})"}]
        for i in range(PROMPTS)
    ]


def _timed(fn: Any, checkpoint: str, step: int) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    metrics = fn(checkpoint, step)
    return time.perf_counter() - started, metrics


def _answers(checkpoint: str, name: str) -> list[str]:
    with open(os.path.join(checkpoint, "eval", f"{name}.jsonl")) as f:
        return [json.loads(line)["answer"] for line in f]


def run_generation(python: str) -> dict[str, Any]:
    """Wall seconds per evaluation: hf on each checkpoint, vLLM cold on the first, vLLM warm
    (one kept engine) on all three (the first includes its start); and the answers compared."""
    from callbacks import GenerationEval

    asked = prompts()
    common = {"max_new_tokens": MAX_NEW, "engine": ENGINE, "timeout_s": 1200}
    with tempfile.TemporaryDirectory(prefix="bench_eval_generation_") as tmp:
        folders = checkpoints(Path(tmp))
        hf = GenerationEval(asked, name="hf", backend="hf", **common)
        cold = GenerationEval(asked, name="cold", backend="vllm", python=python, **common)
        warm = GenerationEval(asked, name="warm", backend="vllm", python=python,
                              keep_engine=True, **common)  # fmt: skip
        seconds: dict[str, list[float]] = {"hf": [], "cold": [], "warm": []}
        same = {"cold": 0, "warm": 0}
        try:
            for step, folder in enumerate(folders, start=1):
                seconds["hf"].append(_timed(hf, folder, step)[0])
                took, metrics = _timed(warm, folder, step)
                seconds["warm"].append(took)
                assert metrics["warm/engine_reused"] == (0.0 if step == 1 else 1.0), metrics
                if step == 1:
                    seconds["cold"].append(_timed(cold, folder, step)[0])
                    same["cold"] = _matches(folder, "cold")
                same["warm"] += _matches(folder, "warm")
        finally:
            warm.close()
    warm_after = statistics.median(seconds["warm"][1:])
    return {
        "seconds": seconds,
        "hf_s": statistics.median(seconds["hf"]),
        "vllm_cold_s": seconds["cold"][0],
        "vllm_warm_first_s": seconds["warm"][0],
        "vllm_warm_s": warm_after,
        "cold_over_warm": seconds["cold"][0] / warm_after,
        "answers_equal_hf": {
            "cold": f"{same['cold']}/{PROMPTS}",
            "warm": f"{same['warm']}/{PROMPTS * len(folders)}",
        },
    }


def _matches(folder: str, name: str) -> int:
    return sum(a == b for a, b in zip(_answers(folder, name), _answers(folder, "hf"), strict=True))


def generation_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's table: each configuration's wall time per evaluation, against vLLM cold."""
    cold = result["vllm_cold_s"]
    rows = [
        ("`hf` (transformers in the task), median of 3 checkpoints", result["hf_s"], "-"),
        ("vLLM cold (a new subprocess and engine), first checkpoint", cold,
         result["answers_equal_hf"]["cold"]),
        ("vLLM warm, first evaluation (starts the kept engine)", result["vllm_warm_first_s"], "-"),
        ("vLLM warm, later checkpoints (weights reloaded in place), median", result["vllm_warm_s"],
         result["answers_equal_hf"]["warm"]),
    ]  # fmt: skip
    return [
        {
            "configuration": label,
            "wall per evaluation (s)": f"{s:.1f}",
            "cold / this": f"{cold / s:.2f}",
            "answers equal to hf": same,
        }
        for label, s, same in rows
    ]
