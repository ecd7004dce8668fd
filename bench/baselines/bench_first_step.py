"""Time to the first step of `make demo` against torchrun's, from the command's launch.

* torchrun (baseline): ``python -m torch.distributed.run --nproc_per_node 2
  bench/baselines/_torchrun_demo.py``: the demo's model and data, DDP over gloo, AdamW, one step, written
  by hand (what a user of plain PyTorch runs);
* ``make demo``: ``python -m ray_trainer.cli demo --num-workers 2`` (the embedded Ray with its
  dashboard, the CLI's default callbacks, the demo's validation of its inputs), one step, with
  a rank-0 step timer added through ``--set callbacks=...``.

Each is a fresh process tree launched by this script; the figure is the time from the launch to
the first step's begin (``time.perf_counter`` is CLOCK_MONOTONIC, shared by the processes of a
machine). Rounds alternate the sides; medians, and the difference to torchrun.

Usage: python bench/baselines/bench_first_step.py [--rounds 3] [--workers 2] [--json OUT]

``--workers`` (2: `make demo`'s) is the processes of each side (`run_all.py --smoke`: 1).
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
from _support import emit, free_port, machine, table  # noqa: E402

SIDES = {
    "torchrun": "torchrun, the demo's first step by hand (baseline)",
    "demo": "`make demo` (`python -m ray_trainer.cli demo --num-workers {workers}`)",
}


def command(side: str, out: str, storage: str, workers: int = 2) -> list[str]:
    if side == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(workers),
            "--master_port", str(free_port()), os.path.join(HERE, "_torchrun_demo.py"), "--out", out,
        ]  # fmt: skip
    timer = json.dumps([{"class": "_support:StepTimer", "path": out}])
    return [
        sys.executable, "-m", "ray_trainer.cli", "demo", "--num-workers", str(workers), "--max-steps",
        "1", "--quiet", "--set", f"callbacks={timer}", "--set", f"storage_path={storage}",
        "--set", "save_at_end=false",
    ]  # fmt: skip


def first_step(side: str, tmp: str, r: int, workers: int = 2) -> float:
    """Seconds from launching `side` to its first step's begin."""
    out, log = os.path.join(tmp, f"{side}-{r}.json"), os.path.join(tmp, f"{side}-{r}.log")
    # Every bench folder: the demo's `--set callbacks=` names `_support:StepTimer`, in bench/.
    path = [*_bench_path.FOLDERS, os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    with open(log, "w") as f:
        started = time.perf_counter()
        proc = subprocess.run(
            command(side, out, os.path.join(tmp, f"runs-{r}"), workers),
            stdout=f, stderr=subprocess.STDOUT, env=env, check=False,
        )  # fmt: skip
    if proc.returncode != 0 or not os.path.exists(out):
        with open(log) as f:
            raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{f.read()[-3000:]}")
    with open(out) as f:
        return json.load(f)["times"][0] - started


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="processes of each side")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    samples: dict[str, list[float]] = {k: [] for k in SIDES}
    with tempfile.TemporaryDirectory(prefix="bench_first_step_") as tmp:
        for r in range(opts.rounds):
            order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
            for side in order:
                samples[side].append(first_step(side, tmp, r, opts.workers))
            print(", ".join(f"{k} {v[-1]:.1f} s" for k, v in samples.items()), flush=True)
    base = statistics.median(samples["torchrun"])
    rows = []
    for key, label in SIDES.items():
        med = statistics.median(samples[key])
        rows.append(
            {
                "configuration": label.format(workers=opts.workers),
                "to first step (s)": f"{med:.1f}",
                "vs torchrun (s)": f"{med - base:+.1f}",
                "ratio": f"{med / base:.2f}",
            }
        )
    report = {"machine": machine(), "samples_s": samples, "table": table(rows)}
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
