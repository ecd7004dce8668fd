"""Runs in the eval task (built in the driver): ``LmEval``, lm-evaluation-harness.

An ``EvalOnSave`` function that evaluates a checkpoint's ``hf/`` export; lm-eval, pyarrow and
torch are imported only when it runs, in the eval task.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from callbacks.builtin.common import as_float

__all__ = ["LmEval", "flat_lm_eval_metrics"]

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
        model_args: more arguments for lm-eval's ``hf`` model (``{"dtype": "bfloat16"}``);
            they override the ones above.
        device: default ``"cuda"`` when the task sees a GPU, else ``"cpu"``.
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
        **evaluate_kwargs: Any,
    ) -> None:
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

    def __call__(self, checkpoint_path: str, step: int) -> dict[str, float]:
        """Runs in the evaluation task: evaluate the checkpoint at `checkpoint_path` (local)."""
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


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
