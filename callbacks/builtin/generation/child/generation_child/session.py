"""Runs in the generation subprocess (or in the eval task, imported): the child's ``Session``.

It answers one request at a time and keeps its vLLM engine warm between them; the wire and
the requests are described in the package's docstring.
"""

from __future__ import annotations

import sys
import time
import traceback
from typing import Any

from .files import versions
from .hf import hf_generate, load_hf_model
from .request import Refusal, check_request, pick_backend, refuse_long_rows, vllm_missing
from .rollout import OPS as ROLLOUT_OPS
from .rollout import RolloutLLM
from .tokens import encode, finish, load_tokenizer, stop_token_ids
from .vllm_engine import VllmEngine


class Session:
    """Runs in the generation subprocess (or the eval task): answers requests, keeps vLLM warm.

    Example:
        >>> session = Session()
        >>> session.handle({"op": "generate", "model": path, "backend": "hf",
        ...                 "prompts": [{"text": "the cat"}], "max_new_tokens": 8})
        >>> session.close()
    """

    def __init__(self, wire: Any = None) -> None:
        #: The subprocess's wire (``main.Wire``), through which a rollout sample paused between
        #: two decoding steps answers the requests that come meanwhile; None: imported, no wire.
        self.wire = wire
        self._engine: VllmEngine | None = None
        self._rollout: RolloutLLM | None = None  # the rollout engine's (its ops: rollout.py)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """One request's response; never raises (errors are ``ok: false`` responses)."""
        try:
            op = request.get("op") if isinstance(request, dict) else None
            if op == "hello":
                return {"ok": True, "python": sys.executable, "versions": versions()}
            if op == "generate":
                return self._generate(request)
            if op == "exit":
                return {"ok": True}
            if op in ROLLOUT_OPS:
                return self._rollout_op(request)
            ops = ", ".join(repr(o) for o in ("hello", "generate", "exit", *ROLLOUT_OPS))
            raise Refusal("error", f"unknown op {op!r}: send one of {ops}")
        except Refusal as refusal:
            return refusal.response()
        except Exception as exc:  # the response says it; the traceback: stderr
            traceback.print_exc(file=sys.stderr)
            return {"ok": False, "kind": "error", "error": f"{type(exc).__name__}: {exc}"}

    def close(self) -> None:
        """Stop the vLLM engines (their engine processes with them), if any is running."""
        if self._engine is not None:
            self._engine.close()
            self._engine = None
        if self._rollout is not None:
            self._rollout.close()
            self._rollout = None

    def _rollout_op(self, request: dict[str, Any]) -> dict[str, Any]:
        """A rollout engine's op: ``rollout_start`` starts its engine (once), the others use it."""
        if request["op"] == "rollout_start":
            if self._rollout is not None:
                raise Refusal("error", "rollout_start: this child's rollout engine is running")
            missing = vllm_missing()
            if missing:
                raise Refusal("missing_backend", missing)
            self._rollout = RolloutLLM(request, self.wire, self.handle)
            return {"ok": True, "seconds": self._rollout.seconds, "versions": versions()}
        if self._rollout is None:
            raise Refusal("error", f"{request['op']}: send rollout_start first")
        return self._rollout.handle(request)

    def _vllm_outputs(
        self, req: dict[str, Any], tokenizer: Any, rows: list[list[int]], stop_ids: list[int]
    ) -> tuple[list[tuple[list[int], str]], dict[str, Any], float]:
        """The rows' outputs from the warm engine (started or reloaded first, as needed)."""
        if self._engine is not None and not self._engine.fits(req, tokenizer):
            self.close()  # another shape or other engine settings: a new engine
        reused = self._engine is not None
        if self._engine is None:
            self._engine = VllmEngine(req, tokenizer)
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
        req = check_request(request)
        backend, fallback = pick_backend(req)
        started = time.perf_counter()
        tokenizer = load_tokenizer(req)
        rows = [encode(tokenizer, prompt) for prompt in req["prompts"]]
        refuse_long_rows(req, rows)
        stop_ids = stop_token_ids(tokenizer, req["model"])
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
            model = load_hf_model(req)
            loaded = time.perf_counter()
            outputs = hf_generate(model, tokenizer, req, rows, stop_ids)
            engine = {"reused": False, "lora_id": None, "prefix_cache_reset": False,
                      "cached_prompt_tokens": 0}  # fmt: skip
            del model
        done = time.perf_counter()
        finished = [
            finish(tokenizer, ids, reason, stop_ids, req["stop"]) for ids, reason in outputs
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
