"""Where the CPU goes during the steady-state steps of bench_hf_trainer.py's sides.

Runs one side of ``bench_hf_trainer.py`` (``hf``, ``runner`` or ``runner_no_dashboard``) as that
benchmark does, samples every process's CPU time (``/proc/PID/stat``: utime + stime) every
0.25 s meanwhile, and reports, per kind of process (training ranks, raylet, GCS, dashboard and
its agents, Ray Train's controller, the callback actor, ...), the share of the machine's cores
each used between the first counted step and the last (the steps' timestamps come from the
side's own step timer, on the same monotonic clock), with the training ranks' torch thread
counts. Used for docs/benchmarks.md's "where the time goes" section.

Usage: python bench/baselines/profile_cpu.py [--side runner] [--steps 200] [--skip 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
import bench_hf_trainer as bench  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")
KINDS = (  # (pattern on the command line, kind), first match wins
    (r"RayTrainWorker|_hf_trainer_worker", "training ranks"),
    (r"TrainController", "Ray Train controller"),
    (r"CallbackActor", "callback actor"),
    (r"TrainStateActor", "Ray Train state actor"),
    (r"raylet", "raylet"),
    (r"gcs_server", "GCS"),
    (r"dashboard/agent|dashboard_agent", "dashboard agent"),
    (r"runtime_env/agent|runtime_env_agent", "runtime env agent"),
    (r"dashboard\.py|dashboard/dashboard", "dashboard"),
    (r"log_monitor", "log monitor"),
    (r"monitor\.py", "autoscaler monitor"),
    (r"ray::", "other Ray workers"),
    (r"torch\.distributed\.run|bench_hf_trainer\.py", "driver / launcher"),
)


def kind_of(cmdline: str) -> str:
    for pattern, kind in KINDS:
        if re.search(pattern, cmdline):
            return kind
    return "other: " + cmdline[:60]


def snapshot() -> dict[int, tuple[str, float]]:
    """Every process: (kind, CPU seconds so far)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if not cmd:
            continue
        out[int(pid)] = (kind_of(cmd), (int(fields[11]) + int(fields[12])) / TICK)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--side", default="runner", choices=["hf", "runner", "runner_no_dashboard"])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip", type=int, default=20)
    opts = parser.parse_args()
    samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), snapshot()))
            stop.wait(0.25)

    threading.Thread(target=sample, daemon=True).start()
    with tempfile.TemporaryDirectory(prefix="profile_cpu_") as tmp:
        out, log = os.path.join(tmp, "out.json"), os.path.join(tmp, "log")
        times, _, _ = bench.launch(opts.side, opts.steps, out, log)
        with open(out) as f:
            info = json.load(f)
    stop.set()
    t0, t1 = times[opts.skip], times[-1]
    first = min(samples, key=lambda s: abs(s[0] - t0))
    last = min(samples, key=lambda s: abs(s[0] - t1))
    span = last[0] - first[0]
    used: dict[str, float] = defaultdict(float)
    for pid, (kind, cpu) in last[1].items():
        used[kind] += cpu - first[1].get(pid, (kind, 0.0))[1] if pid in first[1] else 0.0
    cores = os.cpu_count() or 1
    step = bench.steady_step_seconds(times, opts.skip)
    print(f"side {opts.side}: median step {step * 1e3:.1f} ms over {span:.1f} s sampled")
    if isinstance(info, dict):
        print("threads:", {k: v for k, v in info.items() if k != "times"})
    print("| process | CPU s | share of the machine |")
    print("|---|---:|---:|")
    for kind, cpu in sorted(used.items(), key=lambda kv: -kv[1]):
        if cpu >= 0.01:
            print(f"| {kind} | {cpu:.2f} | {cpu / (span * cores):.1%} |")


if __name__ == "__main__":
    main()
