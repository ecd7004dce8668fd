"""Fixtures of the real-vLLM tests (`make test-vllm`): the child in the vLLM env, tiny models.

The pytest process is the project's interpreter (it builds the models with transformers and
peft); the generation child runs under RAY_TRAINER_VLLM_PYTHON, the interpreter that
`bash bench/eval/vllm_env.sh` builds. Without that variable every test here is skipped.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
from pathlib import Path

import pytest
from generation_support import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "callbacks" / "builtin" / "generation" / "child" / "run_generation_child.py"
ENV_VAR = "RAY_TRAINER_VLLM_PYTHON"
# vLLM's CPU attention takes head sizes 32, 64, 80, ...: hidden 64 over 2 heads.
HIDDEN = 64


def pytest_collection_modifyitems(config, items):
    if os.environ.get(ENV_VAR):
        return
    skip = pytest.mark.skip(
        reason=f"real-vLLM tests: run `make test-vllm` ({ENV_VAR} names the vLLM env's python)"
    )
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(skip)


class Child:
    """The generation child as a subprocess of the vLLM env's python, asked one line at a time."""

    def __init__(self, python: str):
        self.process = subprocess.Popen(
            [python, str(CHILD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, request: dict, timeout: float = 240) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.lines.get(timeout=timeout)
        assert line is not None, f"the child exited ({self.process.poll()}); see its stderr"
        return json.loads(line)

    def close(self) -> None:
        try:
            assert self.ask({"op": "exit"}, timeout=60) == {"ok": True}
            assert self.process.wait(timeout=60) == 0
        finally:
            self.process.kill()


@pytest.fixture
def child():
    process = Child(os.environ[ENV_VAR])
    yield process
    process.close()


def _tiny_llama(path: Path, tokenizer, seed: int) -> Path:
    """A tiny Llama whose greedy answers vary with the seed (vLLM's CPU head size: 32)."""
    return tiny_llama(path, tokenizer, seed, hidden=HIDDEN, max_positions=256)


def _lora(base: Path, out: Path, seed: int, **config) -> Path:
    """A peft LoRA on `base` with random non-zero B (so it changes the answers)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, **config))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    tuned.save_pretrained(out)
    return tuned


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Three same-shape Llamas (c0, c1, c2), two LoRAs on c0 with their merged exports, a LoRA
    with modules_to_save, a GPT-2 with a LoRA, and a plain-torch folder."""
    from transformers import AutoTokenizer

    from ray_trainer._demo.chat import make_tiny_chat_tokenizer
    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    root = tmp_path_factory.mktemp("vllm_models")
    tokenizer = make_tiny_chat_tokenizer("llama3", vocab_size=384)
    paths = {f"c{i}": _tiny_llama(root / f"c{i}", tokenizer, seed=i) for i in range(3)}
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    for name, seed in (("a1", 1), ("a2", 2)):
        tuned = _lora(paths["c0"], root / name, seed, target_modules=targets)
        tuned.merge_and_unload().save_pretrained(root / f"{name}_merged")
        tokenizer.save_pretrained(root / f"{name}_merged")
        paths[name], paths[f"{name}_merged"] = root / name, root / f"{name}_merged"
    _lora(paths["c0"], root / "saving", 3, target_modules=["q_proj"], modules_to_save=["lm_head"])
    paths["saving"] = root / "saving"
    paths["gpt2"] = make_tiny_causal_lm(root / "gpt2")
    _lora(paths["gpt2"], root / "gpt2_lora", 4, target_modules=["c_attn"])
    paths["gpt2_lora"] = root / "gpt2_lora"
    (root / "plain").mkdir()
    (root / "plain" / "model.pt").write_bytes(b"a plain torch state dict")
    paths["plain"] = root / "plain"
    assert AutoTokenizer.from_pretrained(paths["c0"]).chat_template  # the chat prompts need it
    return paths
