"""Shared parts of the benchmarks: callbacks that time steps, machine info, table printing.

Imported by the benchmark driver and, through PYTHONPATH (every bench folder, ``_bench_path``),
by Ray workers and the actor.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import time
from typing import Any

import _bench_path

from callbacks import TrainerCallback


class StepTimer(TrainerCallback):
    """Rank 0, in the training process: the time of each step begin, written at the end with
    the process's torch thread counts."""

    runs_on = "rank0"

    def __init__(self, path: str) -> None:
        self.path = path
        self.times: list[float] = []
        self.cpu: list[float] = []  # the loop thread's CPU time at each step begin

    def on_step_begin(self, context, **kwargs):
        self.times.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    def on_train_end(self, context, **kwargs):
        import torch

        with open(self.path, "w") as f:  # with what the process computes with
            json.dump(
                {
                    "times": self.times,
                    "cpu": self.cpu,
                    "torch_threads": torch.get_num_threads(),
                    "interop_threads": torch.get_num_interop_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                },
                f,
            )


class GradNormWatcher(TrainerCallback):
    """All ranks: reads the gradient norm after each optimizer step (a typical worker callback)."""

    runs_on = "all_ranks"

    def __init__(self) -> None:
        self.largest = 0.0

    def on_after_optimizer_step(self, context, **kwargs):
        norm = kwargs.get("grad_norm")
        if norm is not None:
            self.largest = max(self.largest, float(norm))


class LossKeeper(TrainerCallback):
    """Rank 0: keeps the last logged loss."""

    runs_on = "rank0"

    def __init__(self) -> None:
        self.last = None

    def on_log(self, context, **kwargs):
        self.last = context.loss


class SlowActorCallback(TrainerCallback):
    """Actor-side: sleeps on every step end (a slow logger or alerting hook)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, context, **kwargs):
        time.sleep(self.seconds)


def steady_step_seconds(times: list[float], skip: int) -> float:
    """Median step time after `skip` warm-up steps (from step-begin timestamps)."""
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1 :], strict=False)]
    return statistics.median(gaps)


def machine() -> str:
    import ray
    import torch

    try:
        import accelerate

        acc = accelerate.__version__
    except ImportError:
        acc = "?"
    cpu = platform.processor() or platform.machine()
    return (
        f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__}, "
        f"ray {ray.__version__}, accelerate {acc}"
    )


def table(rows: list[dict[str, Any]], columns: list[str] | None = None) -> str:
    """A markdown table; the columns default to the first row's keys, in order."""
    columns = columns if columns is not None else list(rows[0])
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        out.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now: torchrun's rendezvous port, so that a benchmark beside
    another one on the machine (a full run, a test) does not fail with EADDRINUSE."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_ray(num_cpus: int, extra_paths: tuple[str, ...] = ()) -> None:
    """An embedded Ray for one benchmark; its workers import bench/ modules via PYTHONPATH.
    Under ``RAY_ADDRESS`` (`run_all.py --smoke`: one Ray shared by every benchmark) it joins
    that cluster instead, whose size is its own (`num_cpus` is not asked for)."""
    import ray

    paths = [*_bench_path.FOLDERS, *extra_paths, os.environ.get("PYTHONPATH")]
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, paths))}}
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=runtime_env)
        return
    ray.init(
        num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, runtime_env=runtime_env
    )


def emit(report: dict[str, Any], json_path: str | None) -> dict[str, Any]:
    """Print a benchmark's machine line and table; write the report as JSON if asked."""
    print(report["machine"])
    print(report["table"])
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    return report
