"""The ``"vllm"`` rollout engine's own logic, without vLLM (`_rollout/shm.py`, `engine_vllm.py`,
`engines.py`, the child's rollout ops): the shared-memory files are safetensors files that
safetensors reads back exactly (bf16 too), a sync cut into small buckets reaches the child as
whole tensors equal to the trainer's, one file per bucket, each removed once loaded, and a LoRA
sync as one adapter folder that peft loads; the request lines; the `Completion` of a sample;
which backend ``"auto"`` picks; the child's refusals. The engine on real vLLM: tests/vllm."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from callbacks.builtin.generation.child.generation_child.rollout import at_temperature, llm_kwargs
from callbacks.builtin.generation.child.generation_child.session import Session
from ray_trainer._model.spec import ModelSpec
from ray_trainer._rollout.engine import EngineSpec, SamplingParams
from ray_trainer._rollout.engine_vllm import (
    PYTHON_ENV,
    VllmEngine,
    completion_of,
    sample_request,
    start_request,
    vllm_lora_rank,
    vllm_python,
)
from ray_trainer._rollout.engines import resolve_backend
from ray_trainer._rollout.shm import (
    ADAPTER_FILE,
    ShmReceiver,
    adapter_file_name,
    safetensors_header,
    write_safetensors,
)
from ray_trainer._rollout.transport import LocalTransport, sync_weights
from ray_trainer._rollout.weights import WeightSyncError, buckets


def _flat(tensor: torch.Tensor):
    return tensor.contiguous().view(-1).view(torch.uint8).numpy()


def test_shm_files_are_safetensors_files_read_back_exactly(tmp_path):
    from safetensors.torch import load_file

    tensors = {
        "a.weight": torch.randn(3, 5),
        "b.bias": torch.randn(7).to(torch.bfloat16),
        "c.steps": torch.arange(4, dtype=torch.int64).view(2, 2),
    }
    rows = [(n, str(t.dtype).removeprefix("torch."), list(t.shape), _flat(t))
            for n, t in tensors.items()]  # fmt: skip
    written = write_safetensors(tmp_path / "x.safetensors", rows)
    assert written == sum(t.numel() * t.element_size() for t in tensors.values())
    back = load_file(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    header = safetensors_header([("w", "float32", [2], 8)])
    assert len(header) % 8 == 0 and int.from_bytes(header[:8], "little") == len(header) - 8
    with pytest.raises(ValueError, match=r"w: 4 bytes for a float32 tensor of shape \(2,\)"):
        safetensors_header([("w", "float32", [2], 4)])
    with pytest.raises(ValueError, match="w: twice"):
        safetensors_header([("w", "float32", [1], 4), ("w", "float32", [1], 4)])
    with pytest.raises(ValueError, match="complex64 has no safetensors code"):
        safetensors_header([("w", "complex64", [1], 8)])


def test_the_receiver_joins_slices_into_whole_tensors_and_checks_the_sync():
    weights = {"embed.weight": torch.randn(10, 6), "norm.weight": torch.randn(6),
               "head.weight": torch.randn(4, 6)}  # fmt: skip
    meta = {n: torch.empty(t.shape, device="meta") for n, t in weights.items()}
    receiver = ShmReceiver(meta)
    receiver.begin(1)
    got = {}
    sent = list(buckets(((f"module.{n}", t) for n, t in weights.items()), max_bytes=64))
    assert len(sent) > 5  # embed's 240 bytes span several buckets
    for bucket in sent:
        receiver.load(bucket)
        for name, dtype, shape, data in receiver.take():
            assert name not in got and dtype == "float32"
            got[name] = torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)
    assert set(got) == set(weights)
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name
    assert receiver.finish(1)["tensors"] == 3
    # A sync that misses a tensor is refused at its end, naming it.
    receiver.begin(2)
    for bucket in buckets([("embed.weight", weights["embed.weight"])], max_bytes=64):
        receiver.load(bucket)
    with pytest.raises(WeightSyncError, match=r"did not send every weight: norm\.weight"):
        receiver.finish(2)
    with pytest.raises(WeightSyncError, match="other: no such weight"):
        receiver.load(next(buckets([("other", torch.zeros(1))])))


def test_adapter_names_lose_the_adapter_name_as_peft_saves_them():
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert (
        adapter_file_name(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    )
    assert adapter_file_name("model.norm.weight") == "model.norm.weight"


class _FakeChild:
    """Stands for the generation child (pure logic: what reaches it): reads each file when it
    is asked to load it, as the child's engine process does."""

    def __init__(self):
        self.requests, self.loaded, self.adapters = [], {}, []

    def handle(self, request):
        from safetensors.torch import load_file

        self.requests.append(request)
        if request["op"] == "load_weights":
            self.loaded.update(load_file(request["path"]))
        if request["op"] == "load_adapter":
            folder = Path(request["path"])
            self.adapters.append((json.loads((folder / "adapter_config.json").read_text()),
                                  load_file(folder / ADAPTER_FILE)))  # fmt: skip
            return {"ok": True, "lora_id": len(self.adapters)}
        return {"ok": True}

    def close(self):
        self.requests.append({"op": "exit"})


def _tiny_llama():
    """A tiny Llama in memory (no folder, no tokenizer: the sync needs its weights only)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, tie_word_embeddings=False)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).eval()


def _engine(model, lora=None):
    named = {n: p for n, p in model.named_parameters() if lora is None or ".lora_" in n}
    shapes = {n: torch.empty(p.shape, device="meta") for n, p in named.items()}
    config = model.peft_config["default"] if lora else None
    return VllmEngine(_FakeChild(), EngineSpec(), shapes, [2], config)


def test_a_full_sync_reaches_the_child_whole_one_shm_file_per_bucket():
    model = _tiny_llama()
    engine = _engine(model)
    try:
        stats = sync_weights(LocalTransport(engine), model.named_parameters(), 3,
                             bucket_bytes=1 << 12)  # fmt: skip
        child = engine.child
        loads = [r for r in child.requests if r["op"] == "load_weights"]
        assert stats.buckets > 10 and 0 < len(loads) <= stats.buckets
        assert child.requests[0] == {"op": "begin_weights"}
        assert child.requests[-1] == {"op": "weights_loaded"}
        assert all(r["path"].startswith(str(engine.shm)) for r in loads)
        assert str(engine.shm).startswith("/dev/shm/") and not any(engine.shm.iterdir())
        named = dict(model.named_parameters())
        assert set(child.loaded) == set(named)
        for name, value in child.loaded.items():
            assert torch.equal(value, named[name].detach()), name
        assert engine.version == 3 and stats.metrics()["sync/bytes"] == stats.bytes > 0
    finally:
        engine.close()
    assert not engine.shm.exists()


def test_a_lora_sync_is_one_adapter_folder_under_a_new_id():
    import peft

    from ray_trainer._lora.config import wrap

    model = wrap(_tiny_llama(), {"r": 4, "lora_alpha": 8})
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()
    engine = _engine(model, lora=True)
    adapter = [(n, p) for n, p in model.named_parameters() if ".lora_" in n]
    try:
        for version in (1, 2):
            sync_weights(LocalTransport(engine), adapter, version, bucket_bytes=4096)
        child = engine.child
        assert [r["op"] for r in child.requests] == ["load_adapter", "load_adapter"]
        assert engine.lora_id == 2 and engine.version == 2
        config, tensors = child.adapters[-1]
        assert config["r"] == 4 and config["peft_type"] == "LORA"
        expected = peft.get_peft_model_state_dict(model)
        assert set(tensors) == set(expected)
        for name, value in tensors.items():
            assert torch.equal(value, expected[name]), name
        assert not any(engine.shm.iterdir())  # each folder removed once loaded
        with pytest.raises(WeightSyncError, match="not a LoRA adapter weight"):
            engine.begin_sync(3)
            engine.load_bucket(next(buckets([("model.norm.weight", torch.zeros(32))])))
    finally:
        engine.close()


def test_the_request_lines():
    spec = EngineSpec(ModelSpec(model="m"), device="cpu", vllm={"max_model_len": 128})
    start = start_request(spec, Path("/models/m"), 16)
    assert start == {"op": "rollout_start", "model": "/models/m", "max_lora_rank": 16, "seed": 0,
                     "engine": {"dtype": "float32", "device": "cpu", "max_model_len": 128},
                     "remove_at_exit": []}  # fmt: skip
    kwargs = llm_kwargs(start)  # the child's side of it
    assert kwargs["skip_tokenizer_init"] and kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30 and kwargs["max_lora_rank"] == 16
    gpu = llm_kwargs({**start, "engine": {"device": "cuda", "gpu_memory_utilization": 0.3}})
    assert gpu["gpu_memory_utilization"] == 0.3 and "kv_cache_memory_bytes" not in gpu
    params = SamplingParams(num_generations=2, max_completion_length=5, temperature=0.7, seed=9)
    line = sample_request([[1, 2], [1, 2], [3], [3]], params, [2, 7])
    assert line["seeds"] == [9, 10, 11, 12] and line["stop_token_ids"] == [2, 7]
    assert (line["max_tokens"], line["temperature"], line["top_k"]) == (5, 0.7, 0)
    assert json.loads(json.dumps(line)) == line  # one JSON line
    assert vllm_lora_rank(4) == 8 and vllm_lora_rank(8, {"q_proj": 24}) == 32
    with pytest.raises(ValueError, match=r"unknown settings \['gpus'\]"):
        EngineSpec(vllm={"gpus": 1})
    with pytest.raises(ValueError, match="gpu_memory_utilization'] must be in"):
        EngineSpec(vllm={"gpu_memory_utilization": 30})


def test_a_sample_becomes_a_completion_up_to_its_first_end_token():
    stop = completion_of(4, [1], {"ids": [5, 2, 6], "logprobs": [-1.0, -2.0, -3.0],
                                  "finish_reason": "stop"}, [2, 7], 3)  # fmt: skip
    assert (stop.completion_ids, stop.logprobs, stop.truncated, stop.version) == (
        [5, 2], [-1.0, -2.0], False, 3)  # fmt: skip
    cut = completion_of(4, [1], {"ids": [5, 6], "logprobs": [-1.0, -2.0],
                                 "finish_reason": "length"}, [2], 0)  # fmt: skip
    assert cut.truncated and cut.completion_ids == [5, 6]
    # The last token may be an end token at the length limit: it ended, it is not truncated.
    ended = completion_of(0, [1], {"ids": [5, 2], "logprobs": [-1.0, -2.0],
                                   "finish_reason": "length"}, [2], 0)  # fmt: skip
    assert not ended.truncated


def test_auto_picks_vllm_where_its_environment_is_configured(monkeypatch):
    monkeypatch.delenv(PYTHON_ENV, raising=False)
    assert vllm_python(EngineSpec()) is None  # the project's env has no vLLM
    assert resolve_backend("auto") == "hf"
    assert resolve_backend("auto", EngineSpec(python="/venv-vllm/bin/python")) == "vllm"
    monkeypatch.setenv(PYTHON_ENV, "/env/bin/python")
    assert resolve_backend("auto") == "vllm" and vllm_python(EngineSpec()) == "/env/bin/python"
    assert vllm_python(EngineSpec(python="/mine")) == "/mine"
    assert resolve_backend("vllm") == "vllm" and resolve_backend("hf") == "hf"
    monkeypatch.delenv(PYTHON_ENV)
    with pytest.raises(RuntimeError, match="no vLLM environment: build it with"):
        VllmEngine.build(EngineSpec(ModelSpec(model="m")))


def test_the_child_refuses_rollout_ops_before_its_engine_and_without_vllm():
    session = Session()
    answer = session.handle({"op": "sample", "prompts": [[1]]})
    assert answer["ok"] is False and "send rollout_start first" in answer["error"]
    answer = session.handle({"op": "rollout_start", "model": "m"})
    assert answer["ok"] is False and answer["kind"] == "missing_backend"
    assert "vllm_env.sh" in answer["error"]
    answer = session.handle({"op": "train"})
    assert "'rollout_start'" in answer["error"] and "'load_weights'" in answer["error"]


def test_the_probe_at_a_temperature_from_every_tokens_log_probs():
    logits = torch.randn(50, dtype=torch.float64) * 3
    raw = torch.log_softmax(logits, -1)  # what vLLM's prompt_logprobs give
    for temperature in (0.3, 0.7, 1.5):
        expected = torch.log_softmax(logits / temperature, -1)
        got = [at_temperature(dict(enumerate(raw.tolist())), t, temperature) for t in (0, 17, 49)]
        assert got == pytest.approx(expected[[0, 17, 49]].tolist(), abs=1e-12)


def test_the_child_removes_the_engines_folders_when_it_ends(tmp_path, monkeypatch):
    """The rollout actor may be killed (a run's engines end with their worker group) and never
    close its engine: the child, which outlives it for a moment (its input's end, the SIGTERM
    of its parent's death), removes the folders `rollout_start` named."""
    import sys
    import types

    from callbacks.builtin.generation.child.generation_child import rollout

    folders = [tmp_path / "ray-trainer-rollout-1-x", tmp_path / "ray-trainer-vllm-model-y"]
    for folder in folders:
        (folder / "sub").mkdir(parents=True)
        (folder / "sub" / "f.safetensors").write_bytes(b"x")
    start = start_request(EngineSpec(ModelSpec(model="m"), device="cpu"), folders[1], None,
                          remove_at_exit=folders)  # fmt: skip
    assert start["remove_at_exit"] == [str(f) for f in folders]
    # The child's side, with a stand-in for vllm.LLM (no vLLM in this environment).
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: object()))
    monkeypatch.setattr(rollout, "AT_EXIT", [])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # restored after: it sets "0"
    engine = rollout.RolloutLLM(start)
    assert [str(f) for f in folders] == rollout.AT_EXIT and all(f.exists() for f in folders)
    engine.close()
    assert not any(f.exists() for f in folders) and rollout.AT_EXIT == []
    rollout.remove_at_exit()  # again (the SIGTERM after the input's end): nothing left to do


def test_a_new_engine_removes_the_folders_of_engines_whose_process_ended(tmp_path):
    """Killed with its worker group, a run's engine never removes its /dev/shm folder, and its
    child may be killed too (Ray ends a dead worker's children): the next engine does."""
    import subprocess
    import sys

    from ray_trainer._rollout.shm import remove_stale

    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = tmp_path / f"ray-trainer-rollout-{ended.stdout.strip()}-abcd1234"
    live = tmp_path / f"ray-trainer-rollout-{os.getpid()}-abcd1234"
    other = tmp_path / "ray-trainer-rollout-notapid-x"
    for folder in (dead, live, other):
        (folder / "adapter-v1").mkdir(parents=True)
    assert remove_stale(tmp_path, "ray-trainer-rollout") == [dead]
    assert not dead.exists() and live.exists() and other.exists()


# ---- weights posted during a request: taken between two of vLLM's decoding steps ---------------


def test_a_completion_records_the_version_of_its_first_token_and_where_newer_ones_took_over():
    sample = {"ids": [5, 6, 7, 8, 2, 9], "logprobs": [-1.0] * 6, "finish_reason": "stop"}
    # 2 tokens under version 3, then 4 from the first pause, 5 from the second
    c = completion_of(0, [1], sample, [2], 3, [(2, 4), (3, 5)])
    assert (c.completion_ids, c.version, c.newer_versions) == ([5, 6, 7, 8, 2], 3, [(2, 4), (3, 5)])
    # no token before the first pause: all of it is version 4's, then 5's from token 1
    c = completion_of(0, [1], sample, [2], 3, [(0, 4), (1, 5)])
    assert (c.version, c.newer_versions) == (4, [(1, 5)])
    # ended (at its end token) before the pause: one version
    c = completion_of(0, [1], sample, [2], 3, [(5, 4)])
    assert (c.version, c.newer_versions) == (3, [])
    # no change: as before
    assert completion_of(0, [1], sample, [2], 3).newer_versions == []


class _PausingChild(_FakeChild):
    """The child's side of a paused sample: the first answer to ``sample`` is a pause; what
    comes until ``resume`` is recorded; ``resume`` answers the sample (rows' ``at``)."""

    def __init__(self, pauses=1):
        super().__init__()
        self.pauses = pauses

    def handle(self, request):
        op = request["op"]
        if op in ("sample", "resume") and self.pauses:
            self.pauses -= 1
            self.requests.append(request)
            return {"ok": True, "paused": True}
        if op in ("sample", "resume"):
            self.requests.append(request)
            n = 2
            return {"ok": True, "pauses": [True], "completions": [
                {"ids": [5, 6, 7], "logprobs": [-1.0] * 3, "finish_reason": "length", "at": [a]}
                for a in (1, 3)][:n]}  # fmt: skip
        return super().handle(request)


def test_weights_posted_during_a_request_load_between_two_decoding_steps_then_it_goes_on():
    model = _tiny_llama()
    engine = _engine(model)
    engine.child = _PausingChild()
    loaded = []

    def boundary():  # the rollout actor's: loads what was posted (here at the first pause)
        if engine.child.requests and engine.child.requests[-1]["op"] == "sample":
            sync_weights(LocalTransport(engine), model.named_parameters(), 7, bucket_bytes=1 << 16)
            loaded.append(engine.version)

    engine.on_boundary = boundary
    try:
        engine.posted()
        assert engine.pause_file.exists()  # the child looks for it after each decoding step
        params = SamplingParams(num_generations=2, max_completion_length=3, seed=1)
        got = engine.generate([[1, 2]], params)
        assert not engine.pause_file.exists()  # a post before the request: taken before it
        ops = [r["op"] for r in engine.child.requests]
        assert ops[0] == "sample" and ops[1] == "begin_weights" and ops[-2] == "weights_loaded"
        assert ops[-1] == "resume" and loaded == [7]
        # row 0 had 1 token before the pause, row 1 all 3 (finished before it)
        assert [(c.version, c.newer_versions) for c in got] == [(0, [(1, 7)]), (0, [])]
        assert engine.version == 7
    finally:
        engine.close()


def test_a_failed_load_during_a_pause_aborts_the_request():
    engine = _engine(_tiny_llama())
    engine.child = _PausingChild()

    def boundary():
        if engine.child.requests and engine.child.requests[-1]["op"] == "sample":
            raise WeightSyncError("the bucket of version 3 is not the one expected")

    engine.on_boundary = boundary
    try:
        with pytest.raises(WeightSyncError, match="not the one expected"):
            engine.generate([[1, 2]], SamplingParams(num_generations=2, max_completion_length=3))
        assert [r["op"] for r in engine.child.requests] == ["sample", "abort"]
    finally:
        engine.close()


class _FakeVllmEngine:
    """Stands for vLLM's ``LLMEngine`` with its core in-process (pure logic): each `step`
    decodes one token for every running request; a token is ``100 + the weights' number``, so
    what sampled each token shows; `collective_rpc`'s reload ends bump that number; LoRA ids
    hold adapters by path."""

    def __init__(self):
        self.weights, self.running, self.loras, self.resets = 0, {}, {}, []

    def add_request(self, rid, prompt, params, lora_request=None):
        self.running[rid] = {"prompt": prompt["prompt_token_ids"], "params": params, "ids": [],
                             "lora": lora_request}  # fmt: skip

    def has_unfinished_requests(self):
        return bool(self.running)

    def abort_request(self, ids):
        for rid in ids:
            self.running.pop(rid, None)

    def step(self):
        import types

        outs = []
        for rid, r in list(self.running.items()):
            if r["params"].prompt_logprobs is not None:  # a score: prompt log-probs at once
                n = len(r["prompt"])
                logprobs = [None] + [{t: types.SimpleNamespace(logprob=-float(self.weights))}
                                     for t in r["prompt"][1:]]  # fmt: skip
                del self.running[rid]
                outs.append(types.SimpleNamespace(request_id=rid, finished=True,
                                                  prompt_logprobs=logprobs[:n], outputs=[]))  # fmt: skip
                continue
            lora = r["lora"] and self.loras[r["lora"].lora_int_id]
            r["ids"].append(100 + self.weights + (1000 if lora == "new" else 0))
            done = len(r["ids"]) == r["params"].max_tokens
            if done:
                del self.running[rid]
            sample = types.SimpleNamespace(
                token_ids=list(r["ids"]), finish_reason="length" if done else None,
                logprobs=[{t: types.SimpleNamespace(logprob=-0.5)} for t in r["ids"]])  # fmt: skip
            outs.append(types.SimpleNamespace(request_id=rid, finished=done, outputs=[sample]))
        return outs

    def add_lora(self, request):
        self.loras[request.lora_int_id] = request.lora_path
        return True

    def remove_lora(self, lora_id):
        self.loras.pop(lora_id)


class _FakeLLM:
    def __init__(self):
        self.llm_engine = _FakeVllmEngine()

    def collective_rpc(self, fn, args=()):
        if fn.__name__ == "finish_reload":
            self.llm_engine.weights += 1
        return [0]

    def reset_prefix_cache(self):
        reset = not self.llm_engine.running  # vLLM refuses while requests hold blocks
        self.llm_engine.resets.append(reset)
        return reset


class _ScriptedWire:
    """The child's wire with the parent's requests scripted; what it answers is kept."""

    def __init__(self, requests):
        self.requests, self.answers = list(requests), []

    def read(self):
        return self.requests.pop(0) if self.requests else None

    def write(self, response):
        self.answers.append(response)


def _child_rollout(monkeypatch, tmp_path, requests):
    import sys
    import types

    from callbacks.builtin.generation.child.generation_child import rollout

    def params(**kw):
        return types.SimpleNamespace(prompt_logprobs=kw.get("prompt_logprobs"), **{
            k: v for k, v in kw.items() if k != "prompt_logprobs"})  # fmt: skip

    lora = types.SimpleNamespace(LoRARequest=lambda name, i, path: types.SimpleNamespace(
        lora_name=name, lora_int_id=i, lora_path=path))  # fmt: skip
    fake = types.SimpleNamespace(LLM=lambda **kw: _FakeLLM(), SamplingParams=params)
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.SimpleNamespace(request=lora))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    monkeypatch.setattr(rollout, "AT_EXIT", [])
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    wire = _ScriptedWire(requests)
    session = Session(wire)
    pause = tmp_path / "posted"
    start = {"op": "rollout_start", "model": "m", "pause_file": str(pause)}
    monkeypatch.setattr("callbacks.builtin.generation.child.generation_child.session.vllm_missing",
                        lambda: None)  # fmt: skip
    assert session.handle(start)["ok"]
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the core in the child itself
    return session, wire, pause


def _sample_line(max_tokens=4, rows=2):
    return {"op": "sample", "prompts": [[1, 2]] * rows, "seeds": list(range(rows)),
            "max_tokens": max_tokens, "temperature": 1.0}  # fmt: skip


def test_the_child_pauses_a_sample_between_two_steps_and_serves_the_weights_and_probe(
    monkeypatch, tmp_path
):
    """The child's side: after each decoding step it looks for the pause file; found, it
    answers "paused", serves the full-weight ops and the probe (whose forward steps the paused
    rows too, on the new weights), then goes on at "resume"; each row says how many of its
    tokens came before the pause, and the prefix cache is reset once no row runs."""
    served = [{"op": "begin_weights"}, {"op": "load_weights", "path": "/dev/null"},
              {"op": "weights_loaded"}, {"op": "score", "prompt": [1], "completion": [7, 8]},
              {"op": "sample", "prompts": [[1]]}, {"op": "resume"}]  # fmt: skip
    session, wire, pause = _child_rollout(monkeypatch, tmp_path, served)
    engine = session._rollout.llm.llm_engine
    original = engine.step
    steps = []

    def step():  # the parent posts weights while the first step runs
        steps.append(1)
        if len(steps) == 1:
            pause.touch()
        return original()

    engine.step = step
    answer = session.handle(_sample_line(max_tokens=4))
    assert wire.answers[0] == {"ok": True, "paused": True} and not pause.exists()
    assert [a["ok"] for a in wire.answers[1:4]] == [True, True, True]
    assert wire.answers[3]["prefix_cache_reset"] is False  # rows hold blocks: reset later
    assert wire.answers[4] == {"ok": True, "logprobs": [-1.0, -1.0]}  # the new weights' probe
    assert "a sample is paused" in wire.answers[5]["error"]  # one sample at a time
    assert answer["ok"] and answer["pauses"] == [True]
    completions = answer["completions"]
    # one token before the pause (weights 0), one during the probe's step and two after (1)
    assert [c["ids"] for c in completions] == [[100, 101, 101, 101]] * 2
    assert [c["at"] for c in completions] == [[1], [1]]
    assert engine.resets == [False, True] and not engine.running
    # outside a pause, resume and abort are refused
    assert "no sample is paused" in session.handle({"op": "resume"})["error"]


def test_the_child_replaces_the_adapter_under_the_rows_id_in_a_pause_and_aborts_on_request(
    monkeypatch, tmp_path
):
    served = [{"op": "load_adapter", "path": "new"}, {"op": "resume"},
              {"op": "abort"}]  # fmt: skip
    session, wire, pause = _child_rollout(monkeypatch, tmp_path, served)
    rollout = session._rollout
    assert rollout.handle({"op": "load_adapter", "path": "old"}) == {"ok": True, "lora_id": 1}
    engine = rollout.llm.llm_engine
    original = engine.step
    count = []

    def step():
        count.append(1)
        if len(count) in (2, 3):  # pauses after steps 2 (adapter replaced) and 3 (aborted)
            pause.touch()
        return original()

    engine.step = step
    answer = session.handle(_sample_line(max_tokens=6, rows=1))
    assert wire.answers[0] == {"ok": True, "paused": True}
    assert wire.answers[1] == {"ok": True, "lora_id": 1}  # the same id: the rows keep it
    assert engine.loras == {1: "new"}
    assert wire.answers[2] == {"ok": True, "paused": True}
    assert answer == {"ok": False, "kind": "aborted",
                      "error": "the paused sample was aborted; its rows dropped"}  # fmt: skip
    assert not engine.running  # its rows aborted
