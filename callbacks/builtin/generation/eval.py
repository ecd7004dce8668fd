"""Runs in the eval task (built in the driver): ``GenerationEval``, answers generated and scored.

An ``EvalOnSave`` function that generates an answer to each prompt with the checkpoint's
``hf/`` export, scores the answers and keeps every one in ``<checkpoint>/eval/<name>.jsonl``.
The generating is the generation child's (``child/generation_child``): its ``Session`` in this
process (the ``hf`` backend), or the child run as a subprocess of another interpreter
(``python=``, vLLM's environment, see ``process``),
spoken to in JSON lines. Only the standard library is imported here at the top; pyarrow (data
files, bucket uploads) and the generation libraries are imported when they are needed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from callbacks.builtin.generation.process import ChildDied, ChildProcess
from callbacks.builtin.generation.prompts import read_rows, reference_of
from callbacks.builtin.generation.samples import (
    SAMPLES_KEY,
    local_samples,
    samples_of,
    write_samples,
)
from callbacks.builtin.lm_eval import _TOKENIZER_FILES, _default_device, _fetch

__all__ = [
    "BUILTIN_METRICS", "ChildDied", "GenerationEval", "local_samples", "normalize", "samples_of",
]  # fmt: skip

logger = logging.getLogger("callbacks")

#: The built-in metrics, each ``(answer, reference) -> bool`` on normalized text.
BUILTIN_METRICS: dict[str, Callable[[str, str], bool]] = {
    "exact_match": lambda answer, reference: answer == reference,
    "contains": lambda answer, reference: reference in answer,
}
_BACKENDS = ("auto", "hf", "vllm")
_ENGINE_KEYS = (
    "device", "dtype", "kv_cache_memory_bytes", "gpu_memory_utilization", "max_model_len",
    "enforce_eager", "batch_size",
)  # fmt: skip


def normalize(text: str) -> str:
    """What the built-in metrics compare: the text stripped, case-folded, with every run of
    whitespace made one space (``"  Paris\\n"`` and ``"paris"`` are equal)."""
    return " ".join(str(text).split()).casefold()


class GenerationEval:
    """An evaluation function for ``EvalOnSave``: generates an answer to each prompt with the
    checkpoint's ``hf/`` export, scores it, and returns the averages as flat names
    ``<name>/<metric>`` (``generation/exact_match``), ready for ``EarlyStopping`` and
    ``checkpoint_score_attribute``.

    Runs in the evaluation task, wherever Ray places it, on the task's GPU (``num_gpus`` of
    ``EvalOnSave``) or its CPU; built in the driver, where the prompts (a data file too) are
    read and checked, and travel with the function. The returned metrics:
    ``<name>/<metric>`` for each built-in metric and each key of ``score``'s dicts, averaged
    over the rows; ``<name>/answer_tokens_mean``, ``<name>/length_stopped`` (the fraction of
    answers cut at ``max_new_tokens``), ``<name>/vllm`` (1.0 when vLLM generated, else 0.0),
    ``<name>/engine_reused`` (1.0 when a kept engine answered without starting again),
    ``<name>/load_s`` and ``<name>/generate_s`` (seconds); and ``<name>/samples``, the one value
    that is not a number: where the samples file is (``<checkpoint>/eval/<name>.jsonl``, one
    line per row: prompt, answer, reference, scores, finish reason), which ``MLflowLogger``
    and ``WandbLogger`` log.

    Backends: ``"hf"`` generates with transformers in the task's own process; ``"vllm"`` with
    vLLM in a subprocess; ``"auto"`` (default) vLLM when it is importable, else transformers.
    ``python="/venv/bin/python"`` runs the generation in a subprocess of that interpreter (a
    separate environment holding vLLM, say), for any backend.

    Args:
        prompts: a list of prompts, each a string, a list of chat messages
            (``[{"role": "user", "content": ...}]``, rendered with the checkpoint's chat
            template), or a dict with ``"prompt"`` (a string or messages) or ``"messages"``,
            and optionally ``"reference"``; or the path of a JSONL, JSON, CSV or Parquet file of
            such rows (read here, at construction).
        name: the metrics' prefix and the samples file's name.
        references: one reference answer per prompt (a string, or a list of accepted ones);
            instead of the rows' ``"reference"``.
        max_new_tokens, temperature (0: greedy), top_p, seed, stop: the sampling.
        score: ``score(prompt, answer, reference) -> dict[str, float]``, called per row in the
            evaluation task; must be picklable.
        metrics: built-in metric names, on normalized text (``normalize``): ``"exact_match"``
            (the answer is the reference) and ``"contains"`` (the answer contains it). Default:
            ``("exact_match",)`` when the rows have references, else none.
        backend: ``"auto"``, ``"hf"`` or ``"vllm"``.
        python: the interpreter to run the generation in, on the evaluating node.
        engine: engine options: ``dtype``, ``kv_cache_memory_bytes``,
            ``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``, ``batch_size``
            (transformers: prompts per batch), ``device`` (default ``"cuda"`` when the task
            sees a GPU, else ``"cpu"``).
        keep_engine: keep the engine loaded between evaluations: ``EvalOnSave`` then runs this
            function in one evaluator actor for the run, with its resources held from the
            start; see ``_warm_handle``.
        timeout_s: the longest one generation request may take in a subprocess (loading
            included) before the subprocess is killed.
        base_model: the base model of a PEFT adapter export on the evaluating node, instead of
            the adapter's ``base_model_name_or_path``.
        hf_dir: the export's folder inside a checkpoint.

    Example:
        >>> run_training(model="my-org/chat-model", save_every_steps=500, callbacks=[
        ...     EvalOnSave(GenerationEval("eval/questions.jsonl", max_new_tokens=64,
        ...                               metrics=["exact_match", "contains"]), num_gpus=1)])
    """

    def __init__(
        self,
        prompts: Sequence[Any] | str | os.PathLike[str],
        *,
        name: str = "generation",
        references: Sequence[Any] | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop: Sequence[str] | None = None,
        score: Callable[[Any, str, Any], dict[str, float]] | None = None,
        metrics: Sequence[str] | None = None,
        backend: str = "auto",
        python: str | os.PathLike[str] | None = None,
        engine: dict[str, Any] | None = None,
        keep_engine: bool = False,
        timeout_s: float = 3600.0,
        base_model: str | None = None,
        hf_dir: str = "hf",
    ) -> None:
        if not name or not isinstance(name, str) or "/" in name or name.startswith("."):
            raise ValueError(f"GenerationEval: name must be a plain word like 'qa', got {name!r}")
        self.name = name
        self.rows = read_rows(prompts)
        if references is not None:
            if isinstance(references, str) or len(references) != len(self.rows):
                got = "a string" if isinstance(references, str) else f"{len(references)}"
                raise ValueError(
                    f"GenerationEval: references must be a list of one reference per prompt "
                    f"({len(self.rows)}), got {got}"
                )
            for row, reference in zip(self.rows, references, strict=True):
                row["reference"] = reference_of(reference, f"references[{row['row']}]")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"GenerationEval: max_new_tokens must be >= 1, got {max_new_tokens}")
        if not temperature >= 0:
            raise ValueError(f"GenerationEval: temperature must be >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"GenerationEval: top_p must be in (0, 1], got {top_p}")
        if score is not None and not callable(score):
            raise TypeError(
                "GenerationEval: score must be a function (prompt, answer, reference) -> dict "
                f"of floats, got {type(score).__name__}"
            )
        if backend not in _BACKENDS:
            raise ValueError(f"GenerationEval: backend must be one of {_BACKENDS}, got {backend!r}")
        unknown = sorted(set(engine or {}) - set(_ENGINE_KEYS))
        if unknown:
            raise ValueError(
                f"GenerationEval: unknown engine option(s) {unknown}; the options are "
                f"{', '.join(_ENGINE_KEYS)}"
            )
        if not timeout_s > 0:
            raise ValueError(f"GenerationEval: timeout_s must be > 0, got {timeout_s}")
        self.metrics = _metrics(metrics, self.rows)
        self.max_new_tokens = max_new_tokens
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        self.seed = int(seed)
        self.stop = list(stop) if stop else None
        self.score = score
        self.backend = backend
        self.python = os.fspath(python) if python is not None else None
        self.engine = dict(engine or {})
        self.keep_engine = bool(keep_engine)
        self.timeout_s = float(timeout_s)
        self.base_model = base_model
        self.hf_dir = hf_dir
        self._warm: Any = None  # keep_engine: the session kept between evaluations
        self._restarted = False  # keep_engine: its one restart after a death is used

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_warm": None}  # a session never travels

    def __call__(
        self,
        checkpoint_path: str,
        step: int,
        checkpoint_uri: str | None = None,
        filesystem: Any = None,
    ) -> dict[str, Any]:
        """Runs in the evaluation task: generate, score, keep the samples, return the metrics.

        `checkpoint_path` is a local folder holding the checkpoint; `checkpoint_uri` the
        checkpoint's own path or URI when that folder is a downloaded copy (the samples file
        goes there), on `filesystem` when given (a ``pyarrow.fs.FileSystem``).
        """
        request = self.request(checkpoint_path)
        answer = self._generate(request)
        rows = self._scored(answer, step)
        metrics = self._averages(rows, answer)
        where = write_samples(
            rows, checkpoint_path, checkpoint_uri, f"eval/{self.name}.jsonl", filesystem
        )
        if where is not None:
            metrics[f"{self.name}/{SAMPLES_KEY}"] = where
        return metrics

    # ---- the request -------------------------------------------------------------------------

    def request(self, checkpoint_path: str) -> dict[str, Any]:
        """The child's ``generate`` request for the checkpoint at `checkpoint_path` (local)."""
        model, adapter, rank, tokenizer = self.resolve_model(checkpoint_path)
        engine = {"dtype": "auto", "enforce_eager": False, **self.engine}
        engine.setdefault("device", _device())
        return {
            "op": "generate",
            "model": model,
            "adapter": adapter,
            "adapter_rank": rank,
            "tokenizer": tokenizer,
            "backend": self._backend_asked(),
            "prompts": [
                {"messages": r["messages"]} if r["messages"] is not None else {"text": r["prompt"]}
                for r in self.rows
            ],
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "engine": engine,
        }

    def resolve_model(self, checkpoint_path: str) -> tuple[str, str | None, int | None, str | None]:
        """(model folder, adapter folder, adapter rank, tokenizer folder) of the checkpoint's
        export: the export itself, or its base model (copied here from a bucket) plus the
        adapter, unmerged, when the export is a PEFT adapter."""
        hf = os.path.join(checkpoint_path, self.hf_dir)
        adapter_config = os.path.join(hf, "adapter_config.json")
        if os.path.isfile(adapter_config):
            with open(adapter_config) as f:
                config = json.load(f)
            base = self.base_model or config.get("base_model_name_or_path")
            if not base:
                raise ValueError(
                    f"GenerationEval: the adapter in {hf} names no base model; pass "
                    "base_model=<the base model's name or path on the evaluating node>"
                )
            if "://" in str(base):  # a LoRA run's base on a bucket: loaders open folders only
                base = _fetch(str(base))
            has_tokenizer = any(os.path.isfile(os.path.join(hf, n)) for n in _TOKENIZER_FILES)
            rank = config.get("r")
            return str(base), hf, int(rank) if rank else None, hf if has_tokenizer else None
        if not os.path.isfile(os.path.join(hf, "config.json")):
            raise FileNotFoundError(
                f"GenerationEval: {checkpoint_path} has no Hugging Face export in {self.hf_dir}/ "
                "(no config.json); GenerationEval needs a Hugging Face model trained with "
                "save_hf_format=True"
            )
        return hf, None, None, None

    def _backend_asked(self) -> str:
        """The request's backend: ``"auto"`` in this process without vLLM is transformers."""
        if self.backend == "auto" and self.python is None and not _has_vllm():
            return "hf"
        return self.backend

    # ---- generating --------------------------------------------------------------------------

    def _generate(self, request: dict[str, Any]) -> dict[str, Any]:
        """The child's answer to `request`; an error answer raised, named for its kind."""
        if self.keep_engine:
            answer = self._warm_handle(request)
        else:
            session = self._session(request["backend"])
            try:
                answer = session.handle(request)
            finally:  # a subprocess always ends with its evaluation
                session.close()
        if not isinstance(answer, dict):
            raise RuntimeError(f"GenerationEval: the generation answered {answer!r}")
        if answer.get("ok"):
            if len(answer.get("answers") or []) != len(self.rows):
                raise RuntimeError(
                    f"GenerationEval: {len(self.rows)} prompts but "
                    f"{len(answer.get('answers') or [])} answers came back"
                )
            return answer
        kind, error = answer.get("kind"), answer.get("error")
        if kind == "bad_rows":
            bad = answer.get("rows") or []
            details = "; ".join(
                f"row {b.get('row')}: {b.get('prompt_tokens')} prompt tokens + "
                f"{b.get('max_new_tokens')} new > {b.get('limit')}"
                for b in bad[:10]
            )
            more = f" (and {len(bad) - 10} more)" if len(bad) > 10 else ""
            raise ValueError(
                f"GenerationEval {self.name!r}: prompts too long for the model: {details}{more}; "
                "shorten those prompts, lower max_new_tokens, or raise engine max_model_len "
                f"where the model allows it ({error})"
            )
        if kind == "missing_backend":
            raise RuntimeError(f"GenerationEval {self.name!r}: {error}")
        if kind == "unsupported":
            raise RuntimeError(
                f"GenerationEval {self.name!r}: vLLM cannot run this model: {error}; use "
                "backend='auto' (falls back to transformers) or backend='hf'"
            )
        raise RuntimeError(f"GenerationEval {self.name!r}: generation failed: {error}")

    def _session(self, backend: str) -> Any:
        """Where the request goes: the child's ``Session`` in this process, or the child run
        as a subprocess of ``python`` (given, or this interpreter for vLLM)."""
        python = self.python
        if python is None and (backend == "vllm" or (backend == "auto" and _has_vllm())):
            python = sys.executable  # vLLM starts its own processes: never inside the task's
        if python is None:
            from callbacks.builtin.generation.child.generation_child.session import Session

            return Session()
        return ChildProcess(python, self.timeout_s)

    # ---- keep_engine: the warm engine --------------------------------------------------------

    @property
    def persistent(self) -> bool:
        """Whether ``EvalOnSave`` keeps this function in one evaluator actor for the run
        (``keep_engine=True``), so that what it keeps between calls survives."""
        return self.keep_engine

    def _warm_handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """``keep_engine=True``: the request goes to the session kept since the first
        evaluation, whose engine stays loaded (the child reloads a checkpoint's weights in
        place, resets the prefix cache, and gives each adapter a new LoRA id). A session whose
        process died is started again once for the run and the request sent again; a second
        death is this evaluation's error. A request that fails any other way (a timeout, a
        cancelled evaluation) drops the session: the next evaluation starts a fresh one."""
        while True:
            if self._warm is None:
                self._warm = self._session(request["backend"])
            try:
                return self._warm.handle(request)
            except ChildDied as e:
                self.close()
                if self._restarted:
                    raise RuntimeError(
                        f"GenerationEval {self.name!r}: the kept engine died again after its "
                        f"restart: {e}"
                    ) from e
                self._restarted = True
                logger.warning("GenerationEval %r: the kept engine died; starting it again: %s",
                               self.name, str(e).splitlines()[0])  # fmt: skip
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Ends the kept session and its engine (the evaluator actor calls it at the end of
        the run; a one-off evaluation's session ends with it)."""
        warm, self._warm = self._warm, None
        if warm is not None:
            warm.close()

    # ---- scoring -----------------------------------------------------------------------------

    def _scored(self, answer: dict[str, Any], step: int) -> list[dict[str, Any]]:
        """One sample per row: prompt, answer, reference, scores, finish reason."""
        out = []
        lists = {
            key: list(answer.get(key) or [None] * len(self.rows))
            for key in ("answers", "prompt_tokens", "answer_tokens", "finish_reasons")
        }
        for i, row in enumerate(self.rows):
            text = str(lists["answers"][i])
            prompt = row["messages"] if row["messages"] is not None else row["prompt"]
            scores: dict[str, float] = {}
            if row["reference"] is not None:
                accepted = (
                    row["reference"] if isinstance(row["reference"], list) else [row["reference"]]
                )
                said = normalize(text)
                for metric in self.metrics:
                    ok = any(BUILTIN_METRICS[metric](said, normalize(r)) for r in accepted)
                    scores[metric] = float(ok)
            if self.score is not None:
                scores.update(_user_scores(self.score, prompt, text, row, self.metrics))
            out.append(
                {
                    "row": row["row"],
                    "step": step,
                    "prompt": prompt,
                    "answer": text,
                    "reference": row["reference"],
                    "scores": scores,
                    "finish_reason": lists["finish_reasons"][i],
                    "prompt_tokens": lists["prompt_tokens"][i],
                    "answer_tokens": lists["answer_tokens"][i],
                    "backend": answer.get("backend"),
                }
            )
        return out

    def _averages(self, rows: list[dict[str, Any]], answer: dict[str, Any]) -> dict[str, Any]:
        sums: dict[str, list[float]] = collections.defaultdict(list)
        for row in rows:
            for key, value in row["scores"].items():
                sums[key].append(value)
        p = f"{self.name}/"
        metrics: dict[str, Any] = {p + k: sum(v) / len(v) for k, v in sums.items()}
        tokens = [t for t in (r["answer_tokens"] for r in rows) if t is not None]
        if tokens:
            metrics[p + "answer_tokens_mean"] = sum(tokens) / len(tokens)
        metrics[p + "length_stopped"] = sum(r["finish_reason"] == "length" for r in rows) / len(
            rows
        )
        metrics[p + "vllm"] = 1.0 if answer.get("backend") == "vllm" else 0.0
        # keep_engine: 1.0 when the kept vLLM engine answered without starting again.
        metrics[p + "engine_reused"] = 1.0 if (answer.get("engine") or {}).get("reused") else 0.0
        seconds = answer.get("seconds") or {}
        for key in ("load", "generate"):
            if isinstance(seconds.get(key), (int, float)):
                metrics[f"{p}{key}_s"] = float(seconds[key])
        if answer.get("fallback"):
            logger.warning("GenerationEval %r: not vLLM: %s", self.name, answer["fallback"])
        return metrics


def _metrics(metrics: Sequence[str] | None, rows: list[dict[str, Any]]) -> tuple[str, ...]:
    with_reference = [r["row"] for r in rows if r["reference"] is not None]
    if metrics is None:
        return ("exact_match",) if with_reference else ()
    names = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    unknown = [m for m in names if m not in BUILTIN_METRICS]
    if unknown:
        raise ValueError(
            f"GenerationEval: unknown metric(s) {unknown}; the built-in metrics are "
            f"{sorted(BUILTIN_METRICS)}; compute others with score=fn(prompt, answer, reference)"
        )
    missing = [r["row"] for r in rows if r["reference"] is None]
    if names and missing:
        raise ValueError(
            f"GenerationEval: metrics {list(names)} need a reference for every row; rows "
            f"{missing[:10]} have none: give each a 'reference' (or references=[...])"
        )
    return names


# ---- in the evaluation task -------------------------------------------------------------------


def _user_scores(
    score: Callable[..., Any], prompt: Any, answer: str, row: dict[str, Any], builtin: tuple
) -> dict[str, float]:
    got = score(prompt, answer, row["reference"])
    if not isinstance(got, dict):
        raise TypeError(
            f"GenerationEval: score returned a {type(got).__name__} for row {row['row']}; it "
            "must return a dict of floats"
        )
    out = {}
    for key, value in got.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            with contextlib.suppress(TypeError, ValueError):
                value = float(value)
        if not isinstance(value, (int, float)) or key in builtin:
            raise ValueError(
                f"GenerationEval: score's {key!r} for row {row['row']} is {value!r}; each value "
                "must be a number, under a name that is not a built-in metric's"
            )
        out[str(key)] = float(value)
    return out


def _device() -> str:
    try:
        return _default_device()
    except ImportError:  # no torch in the task: the subprocess's interpreter decides
        return "cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
