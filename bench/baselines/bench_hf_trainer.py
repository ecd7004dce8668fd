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
  dashboard's processes take CPU time from the two workers).

Each side runs as a subprocess launched by this script, so both start-up times are measured the
same way: from launching the command to the first step's begin (`time.perf_counter` is
CLOCK_MONOTONIC on Linux, shared by the processes of one machine). Throughput is tokens/s over
the steady-state steps (after `--skip` warm-up steps): the non-pad input tokens of a global batch
(the demo's mean per item x 2 x 64, the same count for both sides) over the median step time.
Rounds alternate the sides; medians are reported with the ratio runner / HF.

Usage: python bench/baselines/bench_hf_trainer.py [--steps 200] [--skip 20] [--rounds 2] [--json OUT]
       [--num-workers 2] [--smoke]

``--smoke`` (`run_all.py --smoke`, in CI): one round of HF Trainer and `run_training` (the side the
target reads); no `dashboard=False` side.
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


def launch(
    side: str, steps: int, out: str, log: str, workers: int = NUM_WORKERS
) -> tuple[list[float], float, float]:
    """Run one side as a subprocess; returns (step-begin times, launch time, exit time)."""
    if side == "hf":
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
    if side == "hf":  # one compute thread a rank, as a runner rank has (a worker of 1 CPU): what
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun sets for 2 ranks, not for 1
    with open(log, "w") as f:
        started = time.perf_counter()
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
        ended = time.perf_counter()
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
    }
    if opts.smoke:  # the baseline and the side the target reads
        opts.rounds = 1
        del sides["runner_no_dashboard"]
    step_s: dict[str, list[float]] = {k: [] for k in sides}
    startup_s: dict[str, list[float]] = {k: [] for k in sides}
    total_s: dict[str, list[float]] = {k: [] for k in sides}
    with tempfile.TemporaryDirectory(prefix="bench_hf_") as tmp:
        for r in range(opts.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                out = os.path.join(tmp, f"{side}-{r}.json")
                log = os.path.join(tmp, f"{side}-{r}.log")
                times, started, ended = launch(side, opts.steps, out, log, opts.num_workers)
                step_s[side].append(steady_step_seconds(times, skip=opts.skip))
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
        "baseline": sides["hf"],
        "ratios": ratios,
        "higher_is_better": True,
        "table": table(rows),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
