"""In the rollout actor (or any process holding the engine): the ``"vllm"`` rollout engine.

vLLM starts processes of its own and needs its own environment (``.venv-vllm/``, built by
``bench/eval/vllm_env.sh``), so it runs in the generation child that ``GenerationEval`` runs:
``callbacks/builtin/generation/child/``, under the vLLM env's interpreter, spoken to in JSON lines
(its rollout ops: ``generation_child/rollout.py``). This engine, in the actor, is the child's
client:

- ``build`` builds the model as the trainer builds it (its `ModelSpec`, a state dict), saves it as
  a Hugging Face folder the child's vLLM starts from (a local folder is used as it is), and takes
  the weights' names and shapes (the LoRA adapter's, for LoRA) for the sync's checks;
- ``generate`` sends prompts as token ids, one row per completion with its own seed, and builds
  `Completion`s from vLLM's sampled ids and its sampling log-probs at the temperature. Weights
  posted while it runs (``posted``: the rollout actor's ``post``) are taken between two of
  vLLM's decoding steps: the child pauses the request (its rows kept in vLLM's batch), this
  engine loads them through the same ops as any sync, then the request goes on; each
  completion records the version of its first token and where newer weights took over
  (`Completion.newer_versions`);
- ``logprobs`` (the probe) is vLLM's teacher-forced ``prompt_logprobs``;
- a sync's buckets are checked here (`shm.ShmReceiver`) and their tensors written to shared
  memory, one safetensors file per bucket that the child loads into its weights in place; a LoRA
  sync writes the adapter into a folder there that the child loads as a new LoRA id, the base
  untouched. The engine is never restarted for new weights.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from callbacks.builtin.generation.child.generation_child.vllm_engine import (
    vllm_lora_rank as child_lora_rank,
)
from callbacks.builtin.generation.process import ChildProcess
from ray_trainer._rollout.engine import (
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    sample_rows,
    token_ids,
)
from ray_trainer._rollout.engine_hf import _eos_ids
from ray_trainer._rollout.shm import (
    ADAPTER_FILE,
    BEGIN_REQUEST,
    END_REQUEST,
    PAUSE_FILE,
    ShmReceiver,
    adapter_file_name,
    adapter_request,
    load_request,
    shm_folder,
    write_safetensors,
)
from ray_trainer._rollout.types import Completion
from ray_trainer._rollout.weights import Bucket, WeightSyncError

#: The environment variable naming the vLLM env's interpreter (as ``make test-vllm`` sets it).
PYTHON_ENV = "RAY_TRAINER_VLLM_PYTHON"


class VllmError(RuntimeError):
    """The vLLM child refused a request or failed; the message is its answer."""


def vllm_python(spec: EngineSpec) -> str | None:
    """The interpreter the child runs under: the spec's ``python``, else the environment's
    ``RAY_TRAINER_VLLM_PYTHON``, else this one where vLLM is importable here; None: none."""
    if spec.python:
        return spec.python
    if os.environ.get(PYTHON_ENV):
        return os.environ[PYTHON_ENV]
    import importlib.util

    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class VllmEngine(RolloutEngine):
    """The ``"vllm"`` backend: vLLM in the generation child, driven from this process.

    Args:
        child: the generation child (a started ``ChildProcess``) with its engine up.
        spec: the engine's settings.
        shapes: the weights a sync must cover (``meta`` tensors by name): every weight, or
            the LoRA adapter's.
        eos_token_ids: the tokens that end a completion.
        lora_config: the adapter's peft config (LoRA), written beside each synced adapter.
        folders: what the engine made and removes at ``close`` (the saved model, the shm folder).
    """

    backend = "vllm"

    def __init__(
        self,
        child: Any,
        spec: EngineSpec,
        shapes: dict[str, Any],
        eos_token_ids: list[int],
        lora_config: Any = None,
        folders: list[Path] | None = None,
        start_seconds: float = 0.0,
        shm: Path | None = None,
    ) -> None:
        self.child = child
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.lora_config = lora_config
        self.lora = lora_config is not None
        self.device = spec.device or "cpu"
        self.start_seconds = start_seconds
        self.folders = list(folders or [])
        self.shm = shm if shm is not None else shm_folder()
        if self.shm not in self.folders:
            self.folders.append(self.shm)
        what = "the LoRA adapter" if self.lora else "every weight"
        self._receiver = ShmReceiver(shapes, what)
        self._adapter: list[tuple[str, str, list[int], Any]] = []
        self._written = 0
        self.lora_id: int | None = None
        #: Created by `posted`: the child pauses its request at its next decoding step's end.
        self.pause_file = self.shm / PAUSE_FILE

    @classmethod
    def build(cls, spec: EngineSpec, state_dict: dict[str, Any] | None = None) -> VllmEngine:
        """The engine of `spec`: its model built as the trainer builds it (with `state_dict`'s
        weights when given), saved where vLLM can start from it, and the child started."""
        import torch

        python = vllm_python(spec)
        if python is None:
            raise RuntimeError(
                "rollout backend 'vllm': no vLLM environment: build it with `bash "
                f"bench/eval/vllm_env.sh` and set {PYTHON_ENV} (or EngineSpec.python) to the "
                "interpreter it prints, or use rollout backend 'hf'"
            )
        model = spec.model.build_model()
        if not callable(getattr(model, "save_pretrained", None)):
            raise ValueError(
                f"the 'vllm' rollout engine starts vLLM from a Hugging Face model folder, and "
                f"{type(model).__name__} is not a transformers model: use a Hugging Face model "
                "(a name or folder, or a factory returning one), or rollout backend 'hf'"
            )
        if state_dict is not None:
            model.load_state_dict(state_dict)
        eos = _eos_ids(model, spec)
        folders: list[Path] = []
        folder = _local_folder(spec) if state_dict is None else None
        if folder is None:  # a factory, a hub name or other weights: saved for vLLM once
            saved = Path(tempfile.mkdtemp(prefix="ray-trainer-vllm-model-"))
            folders.append(saved)
            model.save_pretrained(saved, safe_serialization=True)
            folder = saved
        lora_config = rank = None
        named = dict(model.named_parameters())
        if spec.lora is not None:
            from ray_trainer._lora.config import wrap

            wrapped = wrap(model, spec.lora)
            lora_config = wrapped.peft_config["default"]
            rank = vllm_lora_rank(lora_config.r, lora_config.rank_pattern)
            named = {n: p for n, p in wrapped.named_parameters() if ".lora_" in n}
        shapes = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in named.items()}
        del model, named
        shm = shm_folder()
        folders.append(shm)
        child = ChildProcess(python, spec.timeout_s, who="the 'vllm' rollout engine")
        try:
            # The child removes them too when it ends: this actor may be killed (a run's
            # engines end with their worker group) and never reach `close`.
            request = start_request(spec, folder, rank, remove_at_exit=folders)
            answer = _ask(child, {**request, "pause_file": str(shm / PAUSE_FILE)})
        except BaseException:
            child.close()
            for f in folders:
                shutil.rmtree(f, ignore_errors=True)
            raise
        return cls(
            child, spec, shapes, eos, lora_config, folders, answer.get("seconds", 0.0), shm=shm
        )

    # ---- sampling ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> list[Completion]:
        self.pause_file.unlink(missing_ok=True)  # what was posted before is taken just below
        self.boundary()  # weights posted before the request: taken before it
        self._check_ready()
        rows = sample_rows(prompts, params, prompt_indices)
        first = self.version
        answer = _ask(
            self.child, sample_request([ids for _, ids in rows], params, self.eos_token_ids)
        )
        after: list[int] = []  # the version held after each pause
        try:
            while answer.get("paused"):  # weights posted during it: taken between two steps
                self.boundary()
                self._check_ready()
                after.append(self.version)
                answer = _ask(self.child, {"op": "resume"})
        except BaseException:
            with contextlib.suppress(Exception):  # the rows dropped; refused if not paused
                _ask(self.child, {"op": "abort"})
            raise
        out = answer["completions"]
        if len(out) != len(rows):
            raise VllmError(f"{len(rows)} completions asked, {len(out)} came back")
        changed = answer.get("pauses") or []
        completions = []
        for (index, ids), sample in zip(rows, out, strict=True):
            at = sample.get("at") or []
            changes = [(a, v) for a, v, c in zip(at, after, changed, strict=False) if c]
            completions.append(
                completion_of(index, ids, sample, self.eos_token_ids, first, changes)
            )
        return completions

    def posted(self) -> None:
        """Weights were posted while a request runs: the child pauses it at its next decoding
        step's end (it looks for this file after each step) and this engine's request thread
        takes them (`boundary`) before the request goes on."""
        self.pause_file.touch()

    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> list[float]:
        self._check_ready()
        prompt = token_ids(prompt_ids, "probe")
        request = {"op": "score", "prompt": prompt, "completion": [int(t) for t in completion_ids],
                   "temperature": float(temperature)}  # fmt: skip
        return [float(v) for v in _ask(self.child, request)["logprobs"]]

    # ---- weights -------------------------------------------------------------------------------

    def receiver(self) -> ShmReceiver:
        """Checks each bucket; its tensors go to the child through shared memory."""
        return self._receiver

    def begin_sync(self, version: int) -> None:
        """Open a sync; full weights: the child sets its layers aside for vLLM's reload (from
        here until the sync ends the engine does not sample)."""
        self._receiver.begin(version)
        self._adapter = []
        self._written = 0
        if not self.lora:
            _ask(self.child, dict(BEGIN_REQUEST))

    def load_bucket(self, bucket: Bucket) -> int:
        """Check `bucket`; full weights: the tensors it completed written to a file of shared
        memory and loaded by the child at once (the file removed after); LoRA: kept for the end
        of the sync (the adapter is loaded whole, under one new id)."""
        nbytes = self._receiver.load(bucket)
        whole = self._receiver.take()
        if self.lora:
            import numpy as np

            self._adapter += [(adapter_file_name(n), d, s, np.array(b)) for n, d, s, b in whole]
        elif whole:
            path = self.shm / f"v{self._receiver.pending}-{self._written:05d}.safetensors"
            try:
                write_safetensors(path, whole)
                _ask(self.child, load_request(path))
            finally:
                path.unlink(missing_ok=True)
            self._written += 1
        return nbytes

    def finish_sync(self, version: int) -> dict[str, Any]:
        """Check that the sync covered every weight it must; then full weights: the child ends
        the load (post-load processing, prefix cache reset); LoRA: the adapter written to shared
        memory and loaded as a new LoRA id. Then `version` is the engine's."""
        started = time.perf_counter()
        summary = self._receiver.finish(version)
        if self.lora:
            folder = self.shm / f"adapter-v{version}"
            folder.mkdir()
            try:
                write_safetensors(folder / ADAPTER_FILE, self._adapter)
                self.lora_config.save_pretrained(str(folder))
                self.lora_id = int(_ask(self.child, adapter_request(folder))["lora_id"])
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            self._adapter = []
        else:
            _ask(self.child, dict(END_REQUEST))
        self.version = version
        return {**summary, "load_seconds": time.perf_counter() - started, "lora_id": self.lora_id}

    def close(self) -> None:
        """End the child (and vLLM's processes) and remove the files the engine made."""
        with contextlib.suppress(Exception):
            self.child.close()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)

    def _check_ready(self) -> None:
        if self._receiver.syncing:
            raise WeightSyncError(
                f"the weights of version {self._receiver.pending} are being synced (or their "
                "sync failed half way): finish that sync, or start a new one, before sampling"
            )


# ---- the request lines and their answers (pure; tests/unit/test_rollout_engine_vllm.py) ---------


def start_request(
    spec: EngineSpec, folder: Path, lora_rank: int | None, remove_at_exit: list[Path] = ()
) -> dict[str, Any]:
    """The ``rollout_start`` line: the model folder, vLLM's settings, the LoRA rank, and the
    engine's folders that the child removes when it ends, however it ends."""
    import torch

    device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
    engine = {"dtype": spec.dtype, "device": "cpu" if device == "cpu" else "cuda", **spec.vllm}
    return {"op": "rollout_start", "model": str(folder), "engine": engine,
            "max_lora_rank": lora_rank, "seed": 0,
            "remove_at_exit": [str(f) for f in remove_at_exit]}  # fmt: skip


def sample_request(
    rows: list[list[int]], params: SamplingParams, eos_token_ids: list[int]
) -> dict[str, Any]:
    """The ``sample`` line: one row per completion, row ``i`` seeded ``params.seed + i`` (the
    same seed, weights and prompts: the same completions)."""
    return {
        "op": "sample",
        "prompts": rows,
        "seeds": [params.seed + i for i in range(len(rows))],
        "max_tokens": params.max_completion_length,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "stop_token_ids": list(eos_token_ids),
    }


def completion_of(
    index: int,
    prompt: list[int],
    sample: dict[str, Any],
    eos_token_ids: list[int],
    version: int,
    changes: list[tuple[int, int]] = (),
) -> Completion:
    """The `Completion` of one sampled row: its ids up to and including the first end token
    (vLLM's own list holds it), truncated when it ended for its length. `version` held when
    the request began; `changes`: ``(tokens sampled before, version)`` per pause in which the
    row's weights changed: its tokens from there on are that version's."""
    ids, logprobs = list(sample["ids"]), list(sample["logprobs"])
    ends = set(eos_token_ids)
    stop = next((at for at, token in enumerate(ids) if token in ends), None)
    if stop is not None:
        ids, logprobs = ids[: stop + 1], logprobs[: stop + 1]
    truncated = stop is None and sample.get("finish_reason") == "length"
    newer: list[tuple[int, int]] = []
    for at, held in changes:
        if at <= 0:  # before its first token: all of it is the newer version's
            version = held
        elif at < len(ids) and held != (newer[-1][1] if newer else version):
            newer.append((int(at), int(held)))
    return Completion(
        index, list(prompt), ids, [float(v) for v in logprobs], truncated, version, newer
    )


def vllm_lora_rank(rank: int, pattern: dict[str, int] | None = None) -> int:
    """vLLM's ``max_lora_rank`` for an adapter: its largest rank (``rank_pattern`` included),
    rounded up to one vLLM takes, as the generation child rounds it."""
    return child_lora_rank(max([int(rank), *[int(r) for r in (pattern or {}).values()]]))


def _local_folder(spec: EngineSpec) -> Path | None:
    """The spec's model as a local Hugging Face folder with safetensors weights, else None."""
    model = spec.model.model
    if not isinstance(model, (str, os.PathLike)):
        return None
    folder = Path(model)
    if not (folder / "config.json").is_file() or not any(folder.glob("*.safetensors")):
        return None
    return folder.resolve()


def _ask(child: Any, request: dict[str, Any]) -> dict[str, Any]:
    answer = child.handle(request)
    if not answer.get("ok"):
        raise VllmError(
            f"the vLLM child refused {request.get('op')!r} ({answer.get('kind')}): "
            f"{answer.get('error')}"
        )
    return answer
