"""The generation child (`callbacks/builtin/generation/child/`) without vLLM.

The vLLM plumbing runs against a fake `vllm` package written into tmp_path (it records what the
child asks of it and answers with canned tokens); the hf backend runs for real on a tiny Llama
saved to tmp_path; the wire protocol runs the child as a subprocess of this interpreter. The
real engine is tested by `make test-vllm` (tests/vllm).
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from generation_support import tiny_llama

from callbacks.builtin.generation.child.generation_child.session import Session
from callbacks.builtin.generation.process import CHILD

CPU_ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 28, "enforce_eager": True}
PROMPTS = [
    {"text": "the cat sat on the mat"},
    {"text": "hello"},
    {"messages": [{"role": "user", "content": "what is the sky?"}]},
]

# The fake vLLM: the calls the child makes, appended to `vllm.CALLS`; answers are the prompt's
# last two tokens and then the first stop token (so every answer ends with finish "stop").
FAKE_VLLM = {
    "vllm/__init__.py": """
        import os
        from vllm.model_executor.models import ModelRegistry
        CALLS = []

        class SamplingParams:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                CALLS.append(("SamplingParams", kwargs))

        class _Out:
            def __init__(self, token_ids, finish_reason):
                self.token_ids, self.finish_reason = token_ids, finish_reason

        class _RequestOutput:
            def __init__(self, out):
                self.outputs = [out]

        class _Core:
            def shutdown(self):
                CALLS.append(("shutdown", None))

        class _Engine:
            engine_core = _Core()

        class LLM:
            def __init__(self, **kwargs):
                print("fake vllm: starting an engine")  # libraries print; stdout must stay clean
                os.write(1, b"fake vllm: a raw write to fd 1\\n")
                CALLS.append(("LLM", kwargs))
                self.llm_engine = _Engine()

            def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
                CALLS.append(("collective_rpc", {"method": method, "kwargs": kwargs}))
                return [None]

            def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
                CALLS.append(("reset_prefix_cache", None))
                return True

            def generate(self, prompts, params, use_tqdm=True, lora_request=None):
                lora = None if lora_request is None else lora_request.lora_int_id
                CALLS.append(("generate", {"n": len(prompts), "lora_id": lora}))
                stop = params.kwargs["stop_token_ids"][0]
                return [
                    _RequestOutput(_Out(p["prompt_token_ids"][-2:] + [stop], "stop"))
                    for p in prompts
                ]
    """,
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": """
        from vllm import CALLS

        class LoRARequest:
            def __init__(self, lora_name, lora_int_id, lora_path):
                self.lora_int_id = lora_int_id
                CALLS.append(("LoRARequest", (lora_name, lora_int_id, lora_path)))
    """,
    "vllm/model_executor/__init__.py": "",
    "vllm/model_executor/models/__init__.py": """
        class _Llama:
            lora = True

        class _Gpt2:
            lora = False

        class ModelRegistry:
            classes = {"LlamaForCausalLM": _Llama, "GPT2LMHeadModel": _Gpt2}

            @classmethod
            def get_supported_archs(cls):
                return set(cls.classes)

            @classmethod
            def _try_load_model_cls(cls, arch):
                return cls.classes.get(arch)
    """,
    "vllm/model_executor/models/interfaces.py": """
        def supports_lora(model):
            return getattr(model, "lora", False)
    """,
}


def _write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


def _tiny_llama(path: Path, tokenizer, seed: int, hidden: int = 64) -> Path:
    """A tiny Llama with the llama3-style tokenizer and chat template of ray-trainer's demo."""
    return tiny_llama(path, tokenizer, seed, hidden=hidden, max_positions=64)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from ray_trainer._demo.chat import make_tiny_chat_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = make_tiny_chat_tokenizer("llama3", vocab_size=384)
    return {
        "a": _tiny_llama(root / "a", tokenizer, seed=1),
        "b": _tiny_llama(root / "b", tokenizer, seed=2),
        "wide": _tiny_llama(root / "wide", tokenizer, seed=3, hidden=96),
    }


@pytest.fixture(scope="module")
def adapters(models, tmp_path_factory):
    """Real peft adapters on model "a": "lora" (random non-zero B, so it changes the answers)
    with its merged export "merged", and "saving" (trains lm_head whole: modules_to_save)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    base = AutoModelForCausalLM.from_pretrained(models["a"])
    tuned = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, param in tuned.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    tuned.save_pretrained(root / "lora")
    tuned.merge_and_unload().save_pretrained(root / "merged")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(models["a"] / name, root / "merged")
    config = peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"])
    base = AutoModelForCausalLM.from_pretrained(models["a"])
    peft.get_peft_model(base, config).save_pretrained(root / "saving")
    return {"lora": root / "lora", "merged": root / "merged", "saving": root / "saving"}


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """The fake `vllm` package, importable in this process; yields its CALLS list."""
    root = _write_tree(tmp_path / "fake", FAKE_VLLM)
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    import vllm

    yield vllm.CALLS
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        del sys.modules[name]


def _adapter(path: Path, r: int = 16, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    settings = {"peft_type": "LORA", "r": r, "modules_to_save": None, **config}
    (path / "adapter_config.json").write_text(json.dumps(settings))
    return path


def _request(model, **fields) -> dict:
    return {"op": "generate", "model": str(model), "prompts": PROMPTS, "max_new_tokens": 6,
            "backend": "vllm", "engine": CPU_ENGINE, **fields}  # fmt: skip


def _ok(response: dict) -> dict:
    assert response["ok"], response
    return response


def _names(calls) -> list[str]:
    return [name for name, _ in calls]


# -- the vLLM plumbing, on the fake -----------------------------------------------------------


def test_warm_engine_reloads_weights_in_place_and_resets_the_prefix_cache(
    models, fake_vllm, tmp_path
):
    session = Session()
    first = _ok(session.handle(_request(models["a"])))
    assert first["backend"] == "vllm" and first["engine"]["reused"] is False
    llm = [kw for name, kw in fake_vllm if name == "LLM"]
    assert len(llm) == 1
    assert llm[0]["model"] == str(models["a"]) and llm[0]["kv_cache_memory_bytes"] == 1 << 28
    assert llm[0]["dtype"] == "float32" and llm[0]["enforce_eager"] is True
    assert "enable_lora" not in llm[0] and "gpu_memory_utilization" not in llm[0]

    for model in (models["b"], models["a"]):
        fake_vllm.clear()
        response = _ok(session.handle(_request(model)))
        assert response["engine"]["reused"] is True and response["engine"]["lora_id"] is None
        assert response["engine"]["prefix_cache_reset"] is True
        # The reload, then the reset, then the generation: stale keys/values never answer.
        assert _names(fake_vllm) == [
            "collective_rpc", "reset_prefix_cache", "SamplingParams", "generate"
        ]  # fmt: skip
        assert fake_vllm[0][1] == {"method": "reload_weights",
                                   "kwargs": {"weights_path": str(model)}}  # fmt: skip

    fake_vllm.clear()  # the same weights again: nothing to reload, nothing to reset
    same = _ok(session.handle(_request(models["a"])))
    assert same["engine"]["reused"] is True and same["engine"]["prefix_cache_reset"] is False
    assert "collective_rpc" not in _names(fake_vllm)

    # The same model saved again with a rewritten tokenizer config: the vocabulary is the same.
    again = shutil.copytree(models["b"], tmp_path / "b_again")
    config = json.loads((again / "tokenizer_config.json").read_text())
    (again / "tokenizer_config.json").write_text(json.dumps({**config, "is_local": True}))
    assert _ok(session.handle(_request(again)))["engine"]["reused"] is True

    fake_vllm.clear()  # another shape: the old engine stops, a new one starts
    wide = _ok(session.handle(_request(models["wide"])))
    assert wide["engine"]["reused"] is False
    assert _names(fake_vllm)[:2] == ["shutdown", "LLM"]
    session.close()
    assert _names(fake_vllm)[-1] == "shutdown"


def test_sampling_params_stop_at_eos_and_end_of_turn(models, fake_vllm):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["a"])
    request = _request(models["a"], temperature=0.7, top_p=0.9, seed=5, stop=["\n\n"])
    response = _ok(Session().handle(request))
    params = next(kw for name, kw in fake_vllm if name == "SamplingParams")
    assert params["temperature"] == 0.7 and params["top_p"] == 0.9 and params["seed"] == 5
    assert params["max_tokens"] == 6 and params["stop"] == ["\n\n"]
    eot, eos = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"])
    assert set(params["stop_token_ids"]) == {eot, eos}
    # The fake answers the prompt's last two tokens then a stop token: the stop is cut off.
    rows = [tokenizer(p["text"])["input_ids"] for p in PROMPTS[:2]]
    assert response["answers"][:2] == [tokenizer.decode(r[-2:]) for r in rows]
    assert response["answer_tokens"] == [2, 2, 2]
    assert response["finish_reasons"] == ["stop"] * 3
    assert response["prompt_tokens"][:2] == [len(r) for r in rows]


def test_a_new_lora_id_whenever_the_adapter_changes(models, fake_vllm, tmp_path):
    one, two = _adapter(tmp_path / "one", r=12), _adapter(tmp_path / "two", r=12)
    session = Session()
    ids = []
    for adapter in (one, two, two, one):
        response = _ok(session.handle(_request(models["a"], adapter=str(adapter))))
        ids.append(response["engine"]["lora_id"])
    (two / "adapter_model.safetensors").write_bytes(b"new weights")  # same folder, new contents
    ids.append(_ok(session.handle(_request(models["a"], adapter=str(two))))["engine"]["lora_id"])
    assert ids == [1, 2, 2, 3, 4]
    llm = [kw for name, kw in fake_vllm if name == "LLM"]
    assert len(llm) == 1  # one engine for all of them
    assert llm[0]["enable_lora"] is True and llm[0]["max_lora_rank"] == 16  # r=12, rounded up
    requests = [args for name, args in fake_vllm if name == "LoRARequest"]
    assert [(i, Path(p).name) for _, i, p in requests] == [
        (1, "one"), (2, "two"), (2, "two"), (3, "one"), (4, "two")
    ]  # fmt: skip
    assert [kw["lora_id"] for name, kw in fake_vllm if name == "generate"] == ids
    fake_vllm.clear()  # the LoRA engine answers a plain model of the same shape too
    plain = _ok(session.handle(_request(models["b"])))
    assert plain["engine"]["reused"] is True and plain["engine"]["lora_id"] is None
    assert _names(fake_vllm)[:2] == ["collective_rpc", "reset_prefix_cache"]
    assert [kw["lora_id"] for name, kw in fake_vllm if name == "generate"] == [None]
    fake_vllm.clear()  # a rank above the engine's max_lora_rank needs a new engine
    wider = _adapter(tmp_path / "wider", r=64)
    _ok(session.handle(_request(models["a"], adapter=str(wider))))
    assert _names(fake_vllm)[:2] == ["shutdown", "LLM"]
    session.close()


def test_max_lora_rank_follows_adapter_rank(models, fake_vllm, tmp_path):
    adapter = _adapter(tmp_path / "ad", r=4)
    _ok(Session().handle(_request(models["a"], adapter=str(adapter))))
    _ok(Session().handle(_request(models["a"], adapter=str(adapter), adapter_rank=64)))
    ranks = [kw["max_lora_rank"] for name, kw in fake_vllm if name == "LLM"]
    assert ranks == [8, 64]  # at least 8; adapter_rank wins over the folder's r


def test_gpu_settings_go_to_vllm(models, fake_vllm):
    engine = {"device": "cuda", "gpu_memory_utilization": 0.5, "max_model_len": 48}
    _ok(Session().handle(_request(models["a"], engine=engine)))
    llm = next(kw for name, kw in fake_vllm if name == "LLM")
    assert llm["gpu_memory_utilization"] == 0.5 and llm["max_model_len"] == 48
    assert "kv_cache_memory_bytes" not in llm


def test_models_vllm_cannot_load_are_unsupported(models, fake_vllm, tmp_path):
    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    gpt2 = make_tiny_causal_lm(tmp_path / "gpt2")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.pt").write_bytes(b"torch")
    saving = _adapter(tmp_path / "saving", modules_to_save=["lm_head"])
    cases = {
        "no LoRA support for ['GPT2LMHeadModel']": _request(gpt2, adapter=str(_adapter(tmp_path / "g"))),
        "no transformers config.json": _request(plain),
        "modules_to_save": _request(models["a"], adapter=str(saving)),
    }  # fmt: skip
    for words, request in cases.items():
        response = Session().handle(request)
        assert response["ok"] is False and response["kind"] == "unsupported", response
        assert words in response["error"]
    assert "LLM" not in _names(fake_vllm)


def test_auto_falls_back_to_hf_and_says_why(models, adapters, fake_vllm):
    request = _request(models["a"], backend="auto", adapter=str(adapters["saving"]))
    response = _ok(Session().handle({**request, "max_new_tokens": 3}))
    assert response["backend"] == "hf" and "modules_to_save" in response["fallback"]
    assert len(response["answers"]) == 3
    auto = _ok(Session().handle(_request(models["a"], backend="auto", max_new_tokens=3)))
    assert auto["backend"] == "vllm" and auto["fallback"] is None
    assert _names(fake_vllm).count("LLM") == 1


def test_missing_vllm_is_named_not_a_traceback(models, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` fail
    response = Session().handle(_request(models["a"]))
    assert response["ok"] is False and response["kind"] == "missing_backend"
    assert "pip install vllm" in response["error"] and sys.executable in response["error"]
    assert "Traceback" not in response["error"]
    auto = _ok(Session().handle(_request(models["a"], backend="auto", max_new_tokens=2)))
    assert auto["backend"] == "hf" and "not importable" in auto["fallback"]


def test_rows_too_long_are_refused_by_row_before_any_engine(models, fake_vllm):
    long = {"text": "the cat " * 40}
    prompts = [PROMPTS[1], long, PROMPTS[0], long]
    response = Session().handle(_request(models["a"], prompts=prompts, max_new_tokens=10))
    assert response["ok"] is False and response["kind"] == "bad_rows"
    assert [r["row"] for r in response["rows"]] == [1, 3]
    assert response["rows"][0]["limit"] == 64 and response["rows"][0]["max_new_tokens"] == 10
    assert "row 1" in response["error"] and "row 3" in response["error"]
    engine = {**CPU_ENGINE, "max_model_len": 8}  # max_model_len is the limit when given
    short = Session().handle(_request(models["a"], prompts=[PROMPTS[0]], engine=engine))
    assert short["kind"] == "bad_rows" and short["rows"][0]["limit"] == 8
    assert "LLM" not in _names(fake_vllm)


def test_bad_requests_name_the_field():
    session = Session()
    for request, words in (
        ({"op": "generate", "model": "m", "backend": "tgi", "prompts": PROMPTS}, "backend="),
        ({"op": "generate", "model": "m", "prompts": []}, "prompts"),
        ({"op": "generate", "model": "m", "prompts": [{"txt": "x"}]}, "rows [0]"),
        ({"op": "generate", "model": "m", "prompts": PROMPTS, "engine": {"gpus": 2}}, "gpus"),
        ({"op": "train"}, "unknown op"),
    ):
        response = session.handle(request)
        assert response["ok"] is False and response["kind"] == "error", response
        assert words in response["error"]


# -- the hf backend, for real ------------------------------------------------------------------


def _hand_generate(model, ids: list[int], n: int) -> list[int]:
    """Greedy, one prompt, no padding and no stop: what the child must reproduce."""
    import torch

    inputs = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(inputs, attention_mask=torch.ones_like(inputs), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=None)  # fmt: skip
    return out[0, len(ids) :].tolist()


def _chat_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_hf_greedy_batched_answers_equal_a_hand_run_generate(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["a"])
    model = AutoModelForCausalLM.from_pretrained(models["a"]).eval()
    response = _ok(Session().handle(_request(models["a"], backend="hf", token_ids=True)))
    assert response["backend"] == "hf" and response["fallback"] is None
    chat = tokenizer.apply_chat_template(PROMPTS[2]["messages"], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip
    assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    rows = [tokenizer(p["text"])["input_ids"] for p in PROMPTS[:2]]
    rows.append(_chat_ids(tokenizer, PROMPTS[2]["messages"]))
    assert response["prompt_tokens"] == [len(r) for r in rows]
    expected = [_hand_generate(model, r, 6) for r in rows]  # one by one: no padding at all
    assert response["answer_ids"] == expected  # so left padding changed nothing
    assert response["answers"] == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
    assert len(set(map(tuple, expected))) == 3  # the answers differ: a real comparison


def test_hf_stops_at_the_end_of_turn_token(models, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["a"])
    model = AutoModelForCausalLM.from_pretrained(models["a"]).eval()
    ids = _chat_ids(tokenizer, PROMPTS[2]["messages"])
    greedy = _hand_generate(model, ids, 6)
    k = next(i for i in range(1, 6) if greedy[i] not in greedy[:i])
    # Swap the lm_head rows of the k-th answer token and <|eot_id|>: the model now says
    # <|eot_id|> where it said that token, and the answer must end just before it.
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    with torch.no_grad():
        rows = model.lm_head.weight
        rows[[greedy[k], eot]] = rows[[eot, greedy[k]]]
    model.save_pretrained(tmp_path / "eot")
    tokenizer.save_pretrained(tmp_path / "eot")
    response = _ok(Session().handle(
        _request(tmp_path / "eot", backend="hf", prompts=[PROMPTS[2]], token_ids=True)
    ))  # fmt: skip
    assert response["answer_ids"] == [greedy[:k]]
    assert response["finish_reasons"] == ["stop"] and response["answer_tokens"] == [k]
    assert "<|eot_id|>" not in response["answers"][0]


def test_hf_sampling_is_seeded(models):
    session = Session()
    sample = _request(models["a"], backend="hf", temperature=1.0, max_new_tokens=12)
    first, again = (_ok(session.handle({**sample, "seed": 7}))["answers"] for _ in range(2))
    other = _ok(session.handle({**sample, "seed": 8}))["answers"]
    assert first == again and first != other


def test_hf_adapter_unmerged_equals_its_merged_export(models, adapters):
    session = Session()
    plain = _ok(session.handle(_request(models["a"], backend="hf", token_ids=True)))
    unmerged = _ok(session.handle(
        _request(models["a"], adapter=str(adapters["lora"]), backend="hf", token_ids=True)
    ))  # fmt: skip
    merged = _ok(session.handle(_request(adapters["merged"], backend="hf", token_ids=True)))
    assert unmerged["answer_ids"] == merged["answer_ids"] != plain["answer_ids"]


def test_stop_strings_cut_the_answer():
    from callbacks.builtin.generation.child.generation_child.tokens import finish as _finish

    class Tok:
        def decode(self, ids, skip_special_tokens):
            return "".join(chr(ord("a") + i) for i in ids)

    assert _finish(Tok(), [0, 1, 2, 3], "length", [9], ["cd"]) == {
        "ids": [0, 1, 2, 3], "text": "ab", "reason": "stop"
    }  # fmt: skip
    assert _finish(Tok(), [0, 9, 2], "length", [9], None)["text"] == "a"
    assert _finish(Tok(), [0, 1], "length", [9], ["zz"])["reason"] == "length"


# -- the wire ----------------------------------------------------------------------------------


def test_the_subprocess_answers_one_json_line_per_request(models, tmp_path):
    fake = _write_tree(tmp_path / "fake", FAKE_VLLM)
    child = subprocess.Popen(
        [sys.executable, CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**_clean_env(), "PYTHONPATH": str(fake)},
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(child.stderr), daemon=True).start()
    requests = [
        {"op": "hello"},
        _request(models["a"], max_new_tokens=2),  # the fake engine prints to stdout (fd 1)
        "not json {",
        _request(models["b"], max_new_tokens=2),
        _request(models["a"], prompts=[{"text": "the " * 80}]),
    ]
    responses = []
    try:
        for request in requests:
            line = request if isinstance(request, str) else json.dumps(request)
            child.stdin.write(line + "\n")
            child.stdin.flush()
            responses.append(json.loads(lines.get(timeout=60)))
        child.stdin.write(json.dumps({"op": "exit"}) + "\n")
        child.stdin.flush()
        assert json.loads(lines.get(timeout=30)) == {"ok": True}
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
    assert lines.get(timeout=5) is None  # nothing more on stdout: the prints went elsewhere
    hello, first, bad, second, long = responses
    assert hello["ok"] and hello["python"] == sys.executable
    assert set(hello["versions"]) == {"torch", "transformers", "vllm", "peft"}
    assert first["ok"] and first["engine"]["reused"] is False
    assert second["ok"] and second["engine"] == {
        "reused": True, "lora_id": None, "prefix_cache_reset": True, "cached_prompt_tokens": 0
    }  # fmt: skip
    assert bad == {"ok": False, "kind": "error", "error": bad["error"]}
    assert "not a JSON line" in bad["error"]
    assert long["kind"] == "bad_rows"
    assert "fake vllm: a raw write to fd 1" in "".join(stderr)


def test_the_child_runs_from_a_copy_of_its_folder_with_the_standard_library_only(tmp_path):
    """What a vLLM environment without ray-trainer gets: the child's folder is all it needs.
    A copy of that folder away from the checkout, under `python -S` (no site-packages: neither
    ray-trainer's install nor torch), still starts and answers; what it brings is the
    generation_child package and its launcher, nothing else of the project."""
    root = Path(CHILD).parent
    assert sorted(p.name for p in root.iterdir() if p.name != "__pycache__") == [
        "generation_child", "run_generation_child.py",
    ]  # fmt: skip
    copy = shutil.copytree(root, tmp_path / "child", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-S", str(copy / "run_generation_child.py")],
        input=json.dumps({"op": "hello"}) + "\n" + json.dumps({"op": "exit"}) + "\n",
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_clean_env(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    hello, bye = map(json.loads, done.stdout.splitlines())
    assert hello["ok"] and hello["versions"]["torch"] is None  # no site-packages: no torch
    assert bye == {"ok": True}


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_a_dead_engine_is_dropped_and_the_next_request_starts_anew(models, fake_vllm):
    session = Session()
    _ok(session.handle(_request(models["a"])))

    def dead(*args, **kwargs):
        raise RuntimeError("EngineDeadError: the engine process died")

    session._engine.llm.generate = dead
    response = session.handle(_request(models["a"]))
    assert response == {"ok": False, "kind": "error", "error": response["error"]}
    assert "EngineDeadError" in response["error"]
    fake_vllm.clear()
    again = _ok(session.handle(_request(models["a"])))
    assert again["engine"]["reused"] is False and _names(fake_vllm).count("LLM") == 1
    session.close()


def test_auto_falls_back_to_hf_when_the_engine_fails_to_start(models, fake_vllm, monkeypatch):
    import vllm

    def broken(self, **kwargs):
        raise RuntimeError("Unsupported CPU attention configuration: head_dim=16")

    monkeypatch.setattr(vllm.LLM, "__init__", broken)
    failed = Session().handle(_request(models["a"]))
    assert failed["ok"] is False and failed["kind"] == "error"
    assert "head_dim=16" in failed["error"]
    auto = _ok(Session().handle(_request(models["a"], backend="auto", max_new_tokens=2)))
    assert auto["backend"] == "hf" and "vLLM failed: RuntimeError" in auto["fallback"]
    assert len(auto["answers"]) == 3
