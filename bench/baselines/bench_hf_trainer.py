"""This runner against Hugging Face `Trainer`: same model, data, batch, steps and callbacks.

Both sides train the demo's `TinyCausalLM` on its `AdditionDataset` with 2 CPU processes (gloo
DDP), per-device batch 64, AdamW lr 2e-3 (weight decay 0.01 on matrices), 50 warm-up steps then
linear decay, grad clip 1.0, seed 42, logging every 50 steps, no evaluation or saving:

* HF Trainer (baseline): `torchrun --nproc_per_node 2 bench/baselines/_hf_trainer_worker.py`, with a
  `TrainerCallback` recording step-begin times, one keeping the logged loss, and HF's
  PrinterCallback printing each log;
* this runner: `run_training` in a fresh Python process that starts its own embedded Ray, with
  `StepTimer` (rank 0), `LossKeeper` (rank 0) and `ProgressBar` (callback actor); once as it
  comes (the embedded Ray with its dashboard) and once with `dashboard=False` (on 2 cores, the
  dashboard's processes take CPU time from the two workers);
* HF Trainer beside an idle Ray: the baseline again while an embedded Ray as `run_training`
  starts it (the machine's cores, its dashboard) idles in a process of its own: what Ray's
  daemons alone take from HF Trainer's throughput.

Where the CPU goes (`CpuSampler`: the CPU time of each process of a side, its command and
everything under it, sampled each 0.5 s while it runs): the training ranks' CPU-seconds per
steady-state step, and the side's other processes' CPU (Ray's daemons, Ray Train's controller,
the callback actor, the driver; torchrun's launcher; the idle Ray beside HF Trainer) as a share
of the machine's cores over the same steps. Where the ranks' CPU per step is the same on both
sides and the runner's step is slower, the difference is the other processes' share of cores
the ranks would have used.

Each side runs as a subprocess launched by this script, so both start-up times are measured the
same way: from launching the command to the first step's begin (`time.perf_counter` is
CLOCK_MONOTONIC on Linux, shared by the processes of one machine). Throughput is tokens/s over
the steady-state steps (after `--skip` warm-up steps): the non-pad input tokens of a global batch
(the demo's mean per item x 2 x 64, the same count for both sides) over the median step time.
Rounds alternate the sides; medians are reported with the ratio runner / HF.

Usage: python bench/baselines/bench_hf_trainer.py [--steps 200] [--skip 20] [--rounds 2] [--json OUT]
       [--num-workers 2] [--smoke]

``--smoke`` (`run_all.py --smoke`, in CI): one round of HF Trainer and `run_training` (the side the
target reads); no `dashboard=False` side, no HF Trainer beside an idle Ray.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402
from _support import (  # noqa: E402
    LossKeeper,
    StepTimer,
    emit,
    free_port,
    machine,
    steady_step_seconds,
    table,
)

# Ranks per side (`--num-workers`): 2 fills this machine's 2 cores (the case measured in
# docs/benchmarks.md); 1 leaves a core to whatever else runs (Ray's own processes).
NUM_WORKERS = 2
BATCH_SIZE = 64


def runner_side(steps: int, out: str, dashboard: bool, workers: int = NUM_WORKERS) -> None:
    """In the subprocess: one `run_training` with the runner's equivalent callbacks."""
    from callbacks import ProgressBar
    from ray_trainer import run_training

    with tempfile.TemporaryDirectory(prefix="bench_hf_runner_") as storage:
        run_training(
            max_steps=steps,
            batch_size=BATCH_SIZE,
            learning_rate=2e-3,
            weight_decay=0.01,
            warmup_steps=50,
            lr_schedule="linear",
            max_grad_norm=1.0,
            seed=42,
            num_workers=workers,
            log_every_steps=50,
            save_at_end=False,
            storage_path=storage,
            dashboard=dashboard,
            callbacks=[StepTimer(out), LossKeeper(), ProgressBar()],
        )


class CpuSampler:
    """The CPU time of a side's processes (those `watch` names and every process under them),
    sampled each `interval_s` in a thread while the side runs: afterwards, the CPU-seconds each
    kind of process spent inside a time window (the steady-state steps), linearly interpolated
    between samples. Kinds: the training ranks (HF's torchrun children, the runner's Ray Train
    workers) and the rest of the side (Ray's daemons, Ray Train's controller, the callback actor,
    the driver; torchrun's launcher). Nothing else on the machine counts."""

    def __init__(self, interval_s: float = 0.5) -> None:
        import threading

        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.roots: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def watch(self, pid: int) -> None:
        """Count `pid` and every process under it (a side's command; the idle Ray)."""
        self.roots.append(pid)

    def _run(self) -> None:
        import psutil

        while True:
            at, seen = time.perf_counter(), {}
            for proc in self._tree():
                try:
                    with proc.oneshot():
                        cmdline, times = proc.cmdline(), proc.cpu_times()
                except psutil.Error:  # gone meanwhile
                    continue
                kind = rank_kind(" ".join(cmdline))
                seen[proc.pid] = (kind, times.user + times.system)
            self.samples.append((at, seen))
            if self._stop.wait(self.interval_s):
                return

    def _tree(self) -> list:
        import psutil

        procs = []
        for pid in list(self.roots):
            try:
                root = psutil.Process(pid)
                procs += [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
        return procs

    def window(self, start: float, end: float) -> dict[str, float]:
        """CPU-seconds by kind between `start` and `end` (perf_counter times)."""
        spent: dict[str, float] = {"ranks": 0.0, "other": 0.0}
        for pid in {pid for _, seen in self.samples for pid in seen}:
            points = [(at, seen[pid]) for at, seen in self.samples if pid in seen]
            # A Ray worker's title is set after its start: a rank if any sample says so.
            kind = "ranks" if any(k == "ranks" for _, (k, _) in points) else "other"
            spent[kind] += _at(points, end) - _at(points, start)
        return spent


def rank_kind(cmdline: str) -> str:
    """The kind of a process by its command line: a training rank's ("ranks") or not."""
    if "RayTrainWorker" in cmdline:  # a Ray Train worker's process title
        return "ranks"
    if "_hf_trainer_worker.py" in cmdline and "torch.distributed.run" not in cmdline:
        return "ranks"  # torchrun's children (the launcher runs the same script name)
    return "other"


def _at(points: list[tuple[float, tuple[str, float]]], t: float) -> float:
    """A process's CPU time at `t`, interpolated between its samples (0 before its first)."""
    before = [(at, cpu) for at, (_, cpu) in points if at <= t]
    after = [(at, cpu) for at, (_, cpu) in points if at > t]
    if not before:
        return 0.0
    if not after:
        return before[-1][1]
    (t0, c0), (t1, c1) = before[-1], after[0]
    return c0 + (c1 - c0) * (t - t0) / (t1 - t0)


def idle_ray() -> subprocess.Popen:
    """An embedded Ray as `run_training` starts it (the machine's cores, the dashboard), idle,
    in a process of its own until killed: the daemons without a run (the `hf_beside_ray` side)."""
    code = "import os, ray, sys; ray.init(num_cpus=os.cpu_count()); print('up', flush=True); "
    code += "sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    if proc.stdout.readline().strip() != "up":
        raise RuntimeError("the idle Ray did not start")
    time.sleep(5)  # its dashboard and agents finish starting: steady daemons from here
    return proc


def launch(
    side: str, steps: int, out: str, log: str, workers: int = NUM_WORKERS, sampler=None
) -> tuple[list[float], float, float]:
    """Run one side as a subprocess; returns (step-begin times, launch time, exit time)."""
    if side.startswith("hf"):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(workers),
            "--master_port",
            str(free_port()),
            os.path.join(HERE, "_hf_trainer_worker.py"),
            "--steps",
            str(steps),
            "--batch-size",
            str(BATCH_SIZE),
            "--out",
            out,
        ]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--side", side]
        cmd += ["--steps", str(steps), "--out", out, "--num-workers", str(workers)]
    # The Ray workers the runner side starts inherit PYTHONPATH: they import `_support` (bench/).
    path = [*_bench_path.FOLDERS, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    if side.startswith("hf"):  # one compute thread a rank, as a runner rank has (1 CPU): what
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets for 2 ranks, not for 1
    beside = idle_ray() if side == "hf_beside_ray" else None
    if beside is not None and sampler is not None:
        sampler.watch(beside.pid)
    try:
        with open(log, "w") as f:
            started = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            if sampler is not None:
                sampler.watch(proc.pid)
            proc.wait()
            ended = time.perf_counter()
    finally:
        if beside is not None:
            beside.communicate("", timeout=60)  # its stdin closed: it shuts its Ray down
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"{side} side failed (exit {proc.returncode}):\n{tail}")
    with open(out) as f:
        data = json.load(f)
    times = data["times"] if isinstance(data, dict) else data
    return times, started, ended


def tokens_per_item() -> float:
    """Mean non-pad input tokens of a demo training item (what both sides process)."""
    from ray_trainer._demo import build_demo

    ds = build_demo().train_dataset
    return float((ds.input_ids != ds.tokenizer.pad_id).sum()) / len(ds)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20, help="warm-up steps left out")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--num-workers", type=int, default=NUM_WORKERS, help="ranks per side")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="one round of HF Trainer and run_training only (run_all.py --smoke)",
    )
    parser.add_argument("--side", choices=["runner", "runner_no_dashboard"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.side:
        runner_side(opts.steps, opts.out, opts.side == "runner", opts.num_workers)
        return {}

    tokens_per_step = tokens_per_item() * BATCH_SIZE * opts.num_workers
    sides = {
        "hf": "HF Trainer, torchrun (baseline)",
        "runner": "run_training (this runner; its embedded Ray with the dashboard, the default)",
        "runner_no_dashboard": "run_training, `dashboard=False`",
        "hf_beside_ray": "HF Trainer, torchrun, beside an idle embedded Ray (its daemons)",
    }
    if opts.smoke:  # the baseline and the side the target reads
        opts.rounds = 1
        del sides["runner_no_dashboard"], sides["hf_beside_ray"]
    step_s: dict[str, list[float]] = {k: [] for k in sides}
    startup_s: dict[str, list[float]] = {k: [] for k in sides}
    total_s: dict[str, list[float]] = {k: [] for k in sides}
    # Per side, per round: the ranks' CPU-seconds per step, and the other processes' CPU-seconds
    # per second of the steady-state steps (cores' worth), from `CpuSampler`.
    rank_cpu: dict[str, list[float]] = {k: [] for k in sides}
    other_cores: dict[str, list[float]] = {k: [] for k in sides}
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        for r in range(opts.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                out = os.path.join(tmp, f"{side}-{r}.json")
                log = os.path.join(tmp, f"{side}-{r}.log")
                with CpuSampler() as sampler:
                    times, started, ended = launch(
                        side, opts.steps, out, log, opts.num_workers, sampler
                    )
                step_s[side].append(steady_step_seconds(times, skip=opts.skip))
                spent = sampler.window(times[opts.skip], times[-1])
                rank_cpu[side].append(spent["ranks"] / (len(times) - 1 - opts.skip))
                other_cores[side].append(spent["other"] / (times[-1] - times[opts.skip]))
                startup_s[side].append(times[0] - started)
                total_s[side].append(ended - started)
            print(
                f"round {r}: "
                + ", ".join(
                    f"{k} {tokens_per_step / v[-1]:,.0f} tok/s, start {startup_s[k][-1]:.1f} s"
                    for k, v in step_s.items()
                )
            )

    base_tps = tokens_per_step / statistics.median(step_s["hf"])
    rows, ratios = [], {}
    for key, label in sides.items():
        step = statistics.median(step_s[key])
        tps = tokens_per_step / step
        ratios[label] = tps / base_tps
        rows.append(
            {
                "configuration": label,
                "step (ms)": f"{step * 1e3:.1f}",
                "tokens/s": f"{tps:,.0f}",
                "ratio (tokens/s)": f"{tps / base_tps:.3f}",
                "start-up to first step (s)": f"{statistics.median(startup_s[key]):.1f}",
                "ranks' CPU per step (ms)": f"{statistics.median(rank_cpu[key]) * 1e3:.1f}",
                "other processes' CPU (% of the cores)": (
                    f"{statistics.median(other_cores[key]) / cores:.1%}"
                ),
            }
        )
    report = {
        "machine": machine(),
        "steps": opts.steps,
        "skip": opts.skip,
        "rounds": opts.rounds,
        "num_workers": opts.num_workers,
        "tokens_per_step": tokens_per_step,
        "step_s": step_s,
        "startup_s": startup_s,
        "total_s": total_s,
        "rank_cpu_s_per_step": rank_cpu,
        "other_cpu_cores": other_cores,
        "cores": cores,
        "baseline": sides["hf"],
        "ratios": ratios,
        "higher_is_better": True,
        "table": table(rows),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
