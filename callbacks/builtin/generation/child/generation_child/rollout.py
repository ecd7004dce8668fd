"""Runs in the generation subprocess: the rollout engine's ops (GRPO's ``"vllm"`` backend).

The same child and the same JSON-lines wire as ``GenerationEval``; these ops serve the rollout
engine of ray-trainer's ``_rollout/engine_vllm.py``, which runs in the rollout actor and sends
prompts as token ids. One ``vllm.LLM``, started once, is kept for the run: new weights are
loaded into it in place, never by starting another.

- ``{"op": "rollout_start", "model", "engine", "max_lora_rank", "seed", "remove_at_exit"}``:
  start the engine on a Hugging Face folder (no tokenizer needed: ids in, ids out) ->
  ``{"seconds"}``; the folders of ``remove_at_exit`` (the engine's shared-memory folder, a model
  it saved) are removed when this child ends, however it ends (`remove_at_exit`): the rollout
  actor may be killed without closing its engine.
- ``{"op": "sample", "prompts": [[ids], ...], "seeds", "max_tokens", "temperature", "top_p",
  "top_k", "stop_token_ids"}``: one completion per row, each with its seed -> ``{"completions":
  [{"ids", "logprobs", "finish_reason"}]}``; the log-probs are vLLM's sampling log-probs at the
  temperature (``logprobs_mode="processed_logprobs"``, as TRL starts vLLM).
- ``{"op": "score", "prompt", "completion", "temperature"}``: the completion's teacher-forced
  log-probs, from vLLM's ``prompt_logprobs`` -> ``{"logprobs"}``.
- ``{"op": "begin_weights"}``, then ``{"op": "load_weights", "path"}`` per file, then
  ``{"op": "weights_loaded"}``: a full sync, in vLLM's engine process, with vLLM's own in-place
  reload (``model_executor/model_loader/reload``): the layers set aside, each file's tensors (a
  safetensors file in ``/dev/shm``, by their Hugging Face names) given to the model's
  ``load_weights`` (which knows its fused layers), a layer processed for its kernels once all
  its weights have come, the rest at the end; then the prefix cache (keys and values of the old
  weights) reset. Between the first and the last the engine must not sample.
- ``{"op": "load_adapter", "path"}``: the LoRA adapter folder loaded under a new LoRA id (the
  previous one removed); later samples and scores use it -> ``{"lora_id"}``.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from typing import Any

from .request import Refusal
from .vllm_engine import CPU_KV_CACHE_BYTES, refresh_tied_head

OPS = ("rollout_start", "sample", "score", "begin_weights", "load_weights", "weights_loaded",
       "load_adapter")  # fmt: skip
#: The engine settings ``rollout_start`` takes, with their defaults.
ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": None,
    "enforce_eager": True,
    "kv_cache_memory_bytes": None,  # on CPU None means 1 GiB (vLLM would take most of the RAM)
    "gpu_memory_utilization": None,  # on a shared GPU: the engine's share of its memory
    "device": "cpu",
}


#: The folders this child removes when it ends (the engine's, from ``rollout_start``).
AT_EXIT: list[str] = []


def remove_at_exit() -> None:
    """Remove the folders of `AT_EXIT` (at this child's end: its close, its input's end, or
    the SIGTERM its parent's death sends)."""
    while AT_EXIT:
        shutil.rmtree(AT_EXIT.pop(), ignore_errors=True)


class RolloutLLM:
    """Runs in the generation subprocess: one ``vllm.LLM`` for a run's rollouts."""

    def __init__(self, request: dict[str, Any]) -> None:
        from vllm import LLM

        # collective_rpc (below) sends functions to vLLM's engine process by reference, which
        # vLLM allows only with this set (the processes are this child's own).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        AT_EXIT.extend(str(f) for f in request.get("remove_at_exit") or [])
        started = time.perf_counter()
        self.lora_id = 0  # 0: no adapter (vLLM's LoRA ids start at 1)
        self.adapter: str | None = None
        self.llm = LLM(**llm_kwargs(request))
        self.seconds = time.perf_counter() - started

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "sample":
            return {"ok": True, "completions": self.sample(request)}
        if op == "score":
            return {"ok": True, "logprobs": self.score(request)}
        if op == "begin_weights":
            self.llm.collective_rpc(begin_reload)
            return {"ok": True}
        if op == "load_weights":
            started = time.perf_counter()
            count = self.llm.collective_rpc(load_file, args=(str(request["path"]),))[0]
            return {"ok": True, "tensors": count, "seconds": time.perf_counter() - started}
        if op == "weights_loaded":
            self.llm.collective_rpc(finish_reload)
            return {"ok": True, "prefix_cache_reset": bool(self.llm.reset_prefix_cache())}
        if op == "load_adapter":
            return {"ok": True, "lora_id": self.load_adapter(str(request["path"]))}
        raise Refusal("error", f"unknown rollout op {op!r}")

    def sample(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        from vllm import SamplingParams

        prompts = request["prompts"]
        seeds = request.get("seeds") or [0] * len(prompts)
        if len(seeds) != len(prompts):
            raise Refusal("error", f"{len(prompts)} prompts but {len(seeds)} seeds")
        params = [
            SamplingParams(
                n=1,
                temperature=float(request["temperature"]),
                top_p=float(request.get("top_p", 1.0)),
                top_k=int(request.get("top_k") or 0) or -1,
                seed=int(seed),
                max_tokens=int(request["max_tokens"]),
                stop_token_ids=[int(t) for t in request.get("stop_token_ids") or []],
                logprobs=0,  # the sampled token's own log-prob
                skip_special_tokens=False,
                detokenize=False,
            )
            for seed in seeds
        ]
        outs = self.llm.generate(
            [{"prompt_token_ids": [int(t) for t in p]} for p in prompts],
            params,
            use_tqdm=False,
            lora_request=self._lora(),
        )
        completions = []
        for out in outs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [
                _picked(step, token) for step, token in zip(sample.logprobs, ids, strict=True)
            ]
            completions.append(
                {"ids": ids, "logprobs": logprobs, "finish_reason": sample.finish_reason}
            )
        return completions

    def score(self, request: dict[str, Any]) -> list[float]:
        """The completion's log-probs after the prompt at the temperature: vLLM's prompt
        log-probs of the whole sequence (raw, the model's ``log_softmax(logits)``); at another
        temperature than 1 every token's (``prompt_logprobs=-1``), rescaled: a log-softmax's
        values differ from the logits by one constant per position, so ``log_softmax(l / T)``
        of them is ``log_softmax(logits / T)``."""
        from vllm import SamplingParams

        prompt = [int(t) for t in request["prompt"]]
        completion = [int(t) for t in request["completion"]]
        temperature = float(request.get("temperature", 1.0))
        every = temperature != 1.0
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=-1 if every else 0, detokenize=False
        )
        out = self.llm.generate(
            [{"prompt_token_ids": prompt + completion}],
            params,
            use_tqdm=False,
            lora_request=self._lora(),
        )[0]
        steps = out.prompt_logprobs[len(prompt) :]
        if not every:
            return [_picked(step, token) for step, token in zip(steps, completion, strict=True)]
        return [
            at_temperature({t: lp.logprob for t, lp in step.items()}, token, temperature)
            for step, token in zip(steps, completion, strict=True)
        ]

    def load_adapter(self, path: str) -> int:
        """Load the adapter folder under a new LoRA id now (not at the first sample), so the
        folder may go once this returns; the previous id is removed (vLLM caches by id)."""
        old = self.lora_id
        self.lora_id, self.adapter = old + 1, path
        if not self.llm.llm_engine.add_lora(self._lora()):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
        if old:
            self.llm.llm_engine.remove_lora(old)
        return self.lora_id

    def _lora(self) -> Any:
        if not self.lora_id:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"rollout-{self.lora_id}", self.lora_id, self.adapter)

    def close(self) -> None:
        """Shut the engine process down now rather than at garbage collection; remove the
        engine's folders."""
        llm, self.llm = self.llm, None
        try:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        finally:
            remove_at_exit()


def llm_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a ``rollout_start`` request."""
    engine = request.get("engine") or {}
    unknown = sorted(set(engine) - set(ENGINE_DEFAULTS))
    if unknown:
        raise Refusal(
            "error", f"engine: unknown settings {unknown}; known: {list(ENGINE_DEFAULTS)}"
        )
    engine = {**ENGINE_DEFAULTS, **engine}
    kwargs: dict[str, Any] = {
        "model": str(request["model"]),
        "skip_tokenizer_init": True,  # prompts are token ids, completions stay token ids
        "dtype": engine["dtype"],
        "enforce_eager": bool(engine["enforce_eager"]),
        "seed": int(request.get("seed") or 0),
        "logprobs_mode": "processed_logprobs",  # at the temperature, as TRL starts vLLM
        "max_logprobs": -1,  # the probe at a temperature asks every token's
    }
    if engine["max_model_len"]:
        kwargs["max_model_len"] = int(engine["max_model_len"])
    if engine["device"] == "cpu":
        kwargs["kv_cache_memory_bytes"] = int(engine["kv_cache_memory_bytes"] or CPU_KV_CACHE_BYTES)
    else:
        if engine["gpu_memory_utilization"]:
            kwargs["gpu_memory_utilization"] = float(engine["gpu_memory_utilization"])
        if engine["kv_cache_memory_bytes"]:
            kwargs["kv_cache_memory_bytes"] = int(engine["kv_cache_memory_bytes"])
    if request.get("max_lora_rank"):
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=int(request["max_lora_rank"]))
    return kwargs


def at_temperature(logprobs: dict[int, float], token: int, temperature: float) -> float:
    """``log_softmax(logits / temperature)`` at `token`, from one position's log-probs of every
    token (``log_softmax(logits)``: the logits less one constant, which the softmax ignores)."""
    scaled = {t: v / temperature for t, v in logprobs.items()}
    top = max(scaled.values())
    return scaled[token] - top - math.log(sum(math.exp(v - top) for v in scaled.values()))


def _picked(step: Any, token: int) -> float:
    """The log-prob of `token` in one position's ``{token: Logprob}``."""
    return float(step[token].logprob)


# -- in vLLM's engine process (sent by collective_rpc: the worker is the first argument) ----------


def begin_reload(worker: Any) -> None:
    """A full sync starts: vLLM's in-place reload set up (each layer's loaders deferred until
    all of its weights have come)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_file(worker: Any, path: str) -> int:
    """Give the tensors of the safetensors file at `path` to the model's ``load_weights``,
    by their Hugging Face names (it maps them onto its fused layers)."""
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config

    model = worker.model_runner.get_model()
    with set_current_vllm_config(worker.vllm_config), safe_open(path, "pt", device="cpu") as f:
        names = list(f.keys())
        model.load_weights((name, f.get_tensor(name)) for name in names)
    return len(names)


def finish_reload(worker: Any) -> None:
    """A full sync ends: the layers not processed yet processed, as vLLM's reload ends. A
    head tied to the input embedding gets no weight of its own (the trainer sends it once, as
    the embedding), so its prepacked CPU copy is remade from the new embedding."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    runner = worker.model_runner
    model = runner.get_model()
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, runner.model_config)
        if getattr(runner.model_config.hf_config, "tie_word_embeddings", False):
            refresh_tied_head(model)
