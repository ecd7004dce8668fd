"""Runs in the generation subprocess: the rollout engine's ops (GRPO's ``"vllm"`` backend).

The same child and the same JSON-lines wire as ``GenerationEval``; these ops serve the rollout
engine of ray-trainer's ``_rollout/engine_vllm.py``, which runs in the rollout actor and sends
prompts as token ids. One ``vllm.LLM``, started once, is kept for the run: new weights are
loaded into it in place, never by starting another.

- ``{"op": "rollout_start", "model", "engine", "max_lora_rank", "seed", "remove_at_exit",
  "pause_file"}``: start the engine on a Hugging Face folder (no tokenizer needed: ids in, ids
  out) -> ``{"seconds"}``; the folders of ``remove_at_exit`` (the engine's shared-memory folder,
  a model it saved) are removed when this child ends, however it ends (`remove_at_exit`): the
  rollout actor may be killed without closing its engine. vLLM's engine core runs in this
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a sample steps it itself, one decoding step
  per call, so nothing runs between two steps unless this process runs it.
- ``{"op": "sample", "prompts": [[ids], ...], "seeds", "max_tokens", "temperature", "top_p",
  "top_k", "stop_token_ids"}``: one completion per row, each with its seed -> ``{"completions":
  [{"ids", "logprobs", "finish_reason", "at"}], "pauses"}``; the log-probs are vLLM's sampling
  log-probs at the temperature (``logprobs_mode="processed_logprobs"``, as TRL starts vLLM).
  **Paused between two decoding steps**: where ``pause_file`` exists after a step (the parent
  creates it when weights are posted during the request) and rows are unfinished, the child
  removes it and answers ``{"ok": true, "paused": true}`` instead; it then answers the
  requests that come (the weight ops below, ``score``), with the unfinished rows kept in
  vLLM's batch, until ``{"op": "resume"}``, whose answer is the sample's (or its next pause);
  ``{"op": "abort"}`` ends the sample instead (its rows aborted, refused as ``"aborted"``).
  Each completion's ``at`` gives, per pause, how many of its tokens were sampled before it;
  ``pauses`` says, per pause, whether the unfinished rows' weights changed in it (full
  weights, or the adapter under the rows' LoRA id; a first adapter leaves them on the base).
  After a sample that crossed a change, the prefix cache (keys and values of the old weights)
  is reset once no row runs.
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

import contextlib
import math
import os
import shutil
import time
from typing import Any

from .request import Refusal
from .vllm_engine import CPU_KV_CACHE_BYTES, refresh_tied_head

OPS = ("rollout_start", "sample", "score", "begin_weights", "load_weights", "weights_loaded",
       "load_adapter", "resume", "abort")  # fmt: skip
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
    """Runs in the generation subprocess: one ``vllm.LLM`` for a run's rollouts.

    Args:
        request: the ``rollout_start`` request.
        wire: the subprocess's wire (``main.Wire``): a sample paused between two decoding steps
            answers what comes meanwhile through it; None (imported): never paused.
        dispatch: answers one request during a pause (the session's ``handle``).
    """

    def __init__(self, request: dict[str, Any], wire: Any = None, dispatch: Any = None) -> None:
        # The engine core in this process: a sample steps it, so a pause between two steps is
        # a pause (a core of its own would go on decoding while weights load).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        # collective_rpc (below) sends functions to vLLM's engine process by reference, which
        # vLLM allows only with this set (the processes are this child's own).
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        AT_EXIT.extend(str(f) for f in request.get("remove_at_exit") or [])
        started = time.perf_counter()
        self.lora_id = 0  # 0: no adapter (vLLM's LoRA ids start at 1)
        self.adapter: str | None = None
        self.wire, self.dispatch = wire, dispatch
        self.pause_file = request.get("pause_file") if wire is not None else None
        self._latest: dict[str, Any] = {}  # each running request's last output (cumulative)
        self._ids = 0  # request ids: one counter for samples and scores
        self._paused = False
        self._changed = False  # in this pause, the unfinished rows' weights changed
        self._stale_cache = False  # the prefix cache holds keys and values of older weights
        self.llm = LLM(**llm_kwargs(request))
        self.seconds = time.perf_counter() - started

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op in ("resume", "abort"):
            raise Refusal("error", f"{op}: no sample is paused")
        if op == "sample" and self._paused:
            raise Refusal("error", "sample: a sample is paused; resume or abort it first")
        if op == "sample":
            completions, pauses = self.sample(request)
            return {"ok": True, "completions": completions, "pauses": pauses}
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
            self._changed = self._paused
            return {"ok": True, "prefix_cache_reset": self._reset_prefix_cache()}
        if op == "load_adapter":
            return {"ok": True, "lora_id": self.load_adapter(str(request["path"]))}
        raise Refusal("error", f"unknown rollout op {op!r}")

    def sample(self, request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[bool]]:
        """The rows' completions, and per pause whether their weights changed in it."""
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
        rows = self._add([[int(t) for t in p] for p in prompts], params)
        at: list[list[int]] = []  # per pause: each row's tokens before it
        pauses: list[bool] = []

        def between_steps() -> None:
            if self.pause_file is None or not os.path.exists(self.pause_file):
                return
            at.append([self._tokens(r) for r in rows])
            pauses.append(self._pause())

        try:
            self._drive(rows, between_steps)
        except BaseException:
            self.llm.llm_engine.abort_request(rows)  # those finished are no longer known: ignored
            raise
        finally:
            outs = [self._latest.pop(r, None) for r in rows]
        if self._stale_cache and not self.llm.llm_engine.has_unfinished_requests():
            self._reset_prefix_cache()
        completions = []
        for i, out in enumerate(outs):
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [
                _picked(step, token) for step, token in zip(sample.logprobs, ids, strict=True)
            ]
            completions.append({"ids": ids, "logprobs": logprobs, "at": [a[i] for a in at],
                                "finish_reason": sample.finish_reason})  # fmt: skip
        return completions, pauses

    def score(self, request: dict[str, Any]) -> list[float]:
        """The completion's log-probs after the prompt at the temperature: vLLM's prompt
        log-probs of the whole sequence (raw, the model's ``log_softmax(logits)``); at another
        temperature than 1 every token's (``prompt_logprobs=-1``), rescaled: a log-softmax's
        values differ from the logits by one constant per position, so ``log_softmax(l / T)``
        of them is ``log_softmax(logits / T)``. During a paused sample its rows decode beside
        it, on the weights just loaded."""
        from vllm import SamplingParams

        prompt = [int(t) for t in request["prompt"]]
        completion = [int(t) for t in request["completion"]]
        temperature = float(request.get("temperature", 1.0))
        every = temperature != 1.0
        params = SamplingParams(
            max_tokens=1, temperature=0.0, prompt_logprobs=-1 if every else 0, detokenize=False
        )
        (rid,) = self._add([prompt + completion], [params])
        try:
            self._drive([rid])
        finally:
            out = self._latest.pop(rid, None)
        steps = out.prompt_logprobs[len(prompt) :]
        if not every:
            return [_picked(step, token) for step, token in zip(steps, completion, strict=True)]
        return [
            at_temperature({t: lp.logprob for t, lp in step.items()}, token, temperature)
            for step, token in zip(steps, completion, strict=True)
        ]

    def _add(self, prompts: list[list[int]], params: list[Any]) -> list[str]:
        """Add one vLLM request per prompt (under the current adapter); their ids."""
        engine, lora = self.llm.llm_engine, self._lora()
        ids = []
        for prompt, param in zip(prompts, params, strict=True):
            self._ids += 1
            ids.append(f"r{self._ids}")
            engine.add_request(ids[-1], {"prompt_token_ids": prompt}, param, lora_request=lora)
        return ids

    def _drive(self, ids: list[str], between_steps: Any = None) -> None:
        """Step the engine until the requests `ids` have finished, keeping each request's last
        output (every running request's: a score during a paused sample steps its rows too);
        `between_steps()` after each step while some of them run."""
        engine = self.llm.llm_engine
        unfinished = set(ids)
        while unfinished:
            if not engine.has_unfinished_requests():
                raise RuntimeError(
                    f"vLLM has no request left, but {sorted(unfinished)} did not finish"
                )
            for out in engine.step():
                self._latest[out.request_id] = out
                if out.finished:
                    unfinished.discard(out.request_id)
            if between_steps is not None and unfinished:
                between_steps()

    def _tokens(self, request_id: str) -> int:
        out = self._latest.get(request_id)
        return 0 if out is None else len(out.outputs[0].token_ids)

    def _pause(self) -> bool:
        """Paused between two decoding steps: say so, answer what comes until ``resume``
        (``abort``: refused, the sample ends); whether the rows' weights changed meanwhile."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pause_file)
        self._paused, self._changed = True, False
        try:
            self.wire.write({"ok": True, "paused": True})
            while True:
                request = self.wire.read()
                if request is None:
                    raise EOFError("the input ended while a sample was paused")
                op = request.get("op") if isinstance(request, dict) else None
                if op == "resume":
                    return self._changed
                if op == "abort":
                    raise Refusal("aborted", "the paused sample was aborted; its rows dropped")
                self.wire.write(self.dispatch(request))
        finally:
            self._paused = False

    def _reset_prefix_cache(self) -> bool:
        """Reset the prefix cache (keys and values of older weights); refused while a request
        holds blocks (a paused sample's rows): then it is reset when the sample ends."""
        reset = bool(self.llm.reset_prefix_cache())
        self._stale_cache = not reset
        return reset

    def load_adapter(self, path: str) -> int:
        """Load the adapter folder under a new LoRA id now (not at the first sample), so the
        folder may go once this returns; the previous id is removed (vLLM caches by id).
        During a paused sample whose rows hold an adapter, the new adapter replaces it under
        the same id, so the rows decode on it from their next step; the prefix cache, keyed by
        that id, is reset when the sample ends."""
        engine = self.llm.llm_engine
        if self._paused and self.lora_id:
            engine.remove_lora(self.lora_id)
            self.adapter = path
            if not engine.add_lora(self._lora()):
                raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
            self._changed, self._stale_cache = True, True
            return self.lora_id
        old = self.lora_id
        self.lora_id, self.adapter = old + 1, path
        if not engine.add_lora(self._lora()):
            raise RuntimeError(f"vLLM did not load the LoRA adapter in {path}")
        if old:
            engine.remove_lora(old)
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
