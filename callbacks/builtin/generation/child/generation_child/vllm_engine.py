"""Runs in the generation subprocess: the ``vllm`` backend, one engine kept warm across requests.

Imported by the eval task too, for ``CPU_KV_CACHE_BYTES`` and ``vllm_lora_rank`` (``LmEval``),
never to start an engine there: vLLM starts processes of its own, so it runs in a subprocess.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .files import folder_signature, read_json
from .tokens import tokenizer_source

CPU_KV_CACHE_BYTES = 1 << 30
#: vLLM accepts these LoRA ranks only; an adapter's r is rounded up to the next one.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_CONFIG_KEYS_IGNORED = ("_name_or_path", "name_or_path", "transformers_version", "architectures")


class VllmEngine:
    """Runs in the generation subprocess: one ``vllm.LLM``, kept warm across requests."""

    def __init__(self, req: dict[str, Any], tokenizer: Any):
        from vllm import LLM

        # apply_model (below) sends a function to vLLM's worker process: by reference, which
        # vLLM allows only with this set (the processes are this child's own).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        config = read_json(Path(req["model"]) / "config.json")
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.key = _engine_key(req, tokenizer)
        self.lora_rank = _lora_rank(req) if req["adapter"] else None
        self.weights = folder_signature(req["model"])
        self.adapter: tuple[str, str] | None = None
        self.lora_id = 0
        self.llm = LLM(**_llm_kwargs(req))

    def fits(self, req: dict[str, Any], tokenizer: Any) -> bool:
        """Whether this engine can answer ``req`` (same shape and settings) after a reload; a
        LoRA engine also answers requests without an adapter."""
        if _engine_key(req, tokenizer) != self.key:
            return False
        return not req["adapter"] or bool(self.lora_rank and _lora_rank(req) <= self.lora_rank)

    def prepare(self, req: dict[str, Any]) -> dict[str, Any]:
        """Load the request's weights in place if they changed (then reset the prefix cache,
        whose keys/values came from the old weights); a new LoRA id if the adapter changed."""
        reset = False
        weights = folder_signature(req["model"])
        if weights != self.weights:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": req["model"]})
            if self.tied:
                self.llm.apply_model(refresh_tied_head)
            reset = bool(self.llm.reset_prefix_cache())
            if not reset:  # only when requests run, and none does between two generate calls
                raise RuntimeError("vLLM did not reset its prefix cache after a weight reload")
            self.weights = weights
        lora_id = None
        if req["adapter"]:
            adapter = (str(Path(req["adapter"]).resolve()), folder_signature(req["adapter"]))
            if adapter != self.adapter:  # vLLM caches adapters by id: a new one, a new id
                self.adapter, self.lora_id = adapter, self.lora_id + 1
            lora_id = self.lora_id
        return {"lora_id": lora_id, "prefix_cache_reset": reset}

    def generate(
        self, req: dict[str, Any], rows: list[list[int]], stop_ids: list[int]
    ) -> tuple[list[tuple[list[int], str]], int]:
        """(new token ids, finish reason) per row, and how many prompt tokens the prefix cache
        had. The prompts go as token ids, so both backends see the same tokens."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = SamplingParams(
            temperature=float(req["temperature"]),
            top_p=float(req["top_p"]) if req["temperature"] else 1.0,
            seed=int(req["seed"]),
            max_tokens=req["max_new_tokens"],
            stop_token_ids=stop_ids,
            stop=req["stop"] or None,
        )
        lora = None
        if req["adapter"] and self.adapter:
            lora = LoRARequest(f"adapter-{self.lora_id}", self.lora_id, self.adapter[0])
        prompts = [{"prompt_token_ids": ids} for ids in rows]
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
        cached = sum(getattr(o, "num_cached_tokens", None) or 0 for o in outs)
        answers = [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
        return [(ids, reason or "length") for ids, reason in answers], cached

    def close(self) -> None:
        """Shut the engine process down now rather than at garbage collection."""
        llm, self.llm = self.llm, None
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()


def refresh_tied_head(model: Any) -> bool:
    """Runs in vLLM's worker process, after an in-place reload of a model whose head is its
    input embedding. The head's weight is the reloaded embedding's, but vLLM's CPU build keeps
    a prepacked copy of it for its matmul, made at load time, which the reload does not remake
    for a head that the checkpoint does not hold: answers then came from the old head (a tied
    Llama's warm answers differed from a cold engine's, all parameters equal). Redo it."""
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if method is None:
        return False
    method.process_weights_after_loading(head)
    return True


def _llm_kwargs(req: dict[str, Any]) -> dict[str, Any]:
    engine = req["engine"]
    kwargs: dict[str, Any] = {
        "model": req["model"],
        "tokenizer": tokenizer_source(req),
        "dtype": engine["dtype"],
        "enforce_eager": bool(engine["enforce_eager"]),
        "seed": int(req["seed"]),
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
    if req["adapter"]:
        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=_lora_rank(req))
    return kwargs


def _lora_rank(req: dict[str, Any]) -> int:
    rank = req["adapter_rank"] or read_json(Path(req["adapter"]) / "adapter_config.json").get("r")
    return vllm_lora_rank(rank)


def vllm_lora_rank(rank: int | None) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of rank `rank`: the next rank vLLM takes."""
    rank = max(8, int(rank or 8))
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def _engine_key(req: dict[str, Any], tokenizer: Any) -> str:
    """What must be equal for a warm engine: the model's shape, tokenizer and engine settings."""
    config = read_json(Path(req["model"]) / "config.json") or {"model": req["model"]}
    shape = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_IGNORED}
    # The vocabulary, not the tokenizer's files (saving one again rewrites its config): the
    # prompts go as ids and the child decodes, so vLLM's tokenizer only matches stop strings.
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    tokenizer = hashlib.sha256(vocab.encode()).hexdigest()
    engine = {k: v for k, v in req["engine"].items() if k != "batch_size"}
    return json.dumps([shape, tokenizer, engine], sort_keys=True, default=str)


# -- small helpers --------------------------------------------------------------------------------
