"""A big data file in the driver: peak memory and preparation time against the file's size.

For each size (default 0.1, 1 and 4 GiB) a JSONL file of generated ``{"text": ...}`` records
(about 1 KiB each, reused between runs when it is already there) goes through what a run does
with its data before the first step, in a fresh driver process each (so its peak is its own):

* before Ray: ``plan_data`` (format detection, the tokenizer, the scan that checks every record
  and cuts the file into pieces);
* on an embedded Ray (``num_cpus`` = the machine's cores): ``prepare_data`` (the preparation
  tasks encode every piece into the token cache, the driver reads each piece of the local file
  and ships it to them).

Reported per size: the driver's peak RSS (psutil, sampled every 10 ms, so the figure includes
the pages of Ray's object store that the driver's process touches; and ``ru_maxrss``), before
Ray and in all, and the seconds of each phase. The baseline is the smallest file: a driver whose
memory is flat keeps the ratio of peak RSS near 1 while the file grows 40x. Target (issue 48):
peak driver RSS under 500 MiB at every size (the issue's is 10 GiB; its memory is per sample,
not per byte: see docs/benchmarks.md). The token caches are deleted after each size.

Usage: python bench/data/bench_data_scale.py [--sizes 0.1 1 4] [--dir /tmp/ray_trainer_scale]
       [--record-bytes 1024] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import string
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, machine, table  # noqa: E402

GIB = 2**30
TARGET_MIB = 500


def generate(path: str, size: int, record_bytes: int) -> None:
    """A JSONL file of `size` bytes (to within a record) of ``{"text": ...}`` records, written
    from a pool of lines so that writing 4 GiB takes seconds, not minutes."""
    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(500)]
    pool = []
    for _ in range(256):
        text, n = [], 0
        while n < record_bytes - 16:
            word = rng.choice(words)
            text.append(word)
            n += len(word) + 1
        pool.append((json.dumps({"text": " ".join(text)}) + "\n").encode())
    block = b"".join(pool)  # ~256 KiB
    tmp = path + ".part"
    with open(tmp, "wb") as f:
        written = 0
        while written < size:
            f.write(block)
            written += len(block)
    os.replace(tmp, path)


class PeakRss:
    """The process's RSS, sampled every 10 ms on a thread; `peak` so far."""

    def __init__(self) -> None:
        import psutil

        self.process = psutil.Process()
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.process.memory_info().rss)


def child(path: str, storage: str, cpus: int) -> dict:
    """One driver: plan, then prepare on an embedded Ray; its own peaks and times."""
    rss = PeakRss()
    from _support import init_ray

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._driver.data import plan_data, prepare_data

    args = TrainingArgs(data=path, storage_path=storage)
    started = time.perf_counter()
    plans = plan_data(args)
    planned = time.perf_counter()
    before_ray = max(rss.peak, rss.process.memory_info().rss)
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    import ray

    init_ray(cpus)
    ray_up = time.perf_counter()
    prepare_data(plans, args)
    prepared = time.perf_counter()
    peak = rss.stop()
    source = plans["data"].source
    out = {
        "records": source.records,
        "pieces": len(source.pieces),
        "samples": plans["data"].samples,
        "plan_s": planned - started,
        "ray_init_s": ray_up - planned,
        "prepare_s": prepared - ray_up,
        "rss_before_ray": before_ray,
        "rss_peak": peak,
        "maxrss_before_ray": maxrss_before,
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    ray.shutdown()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.1, 1, 4], help="GiB")
    parser.add_argument("--dir", default="/tmp/ray_trainer_scale")
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "STORAGE"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(*opts.child, opts.cpus)), flush=True)
        return
    os.makedirs(opts.dir, exist_ok=True)
    rows, raw = [], {}
    for gib in opts.sizes:
        path = os.path.join(opts.dir, f"data-{gib:g}GiB.jsonl")
        if not os.path.exists(path):
            started = time.perf_counter()
            generate(path, int(gib * GIB), opts.record_bytes)
            print(f"generated {path} in {time.perf_counter() - started:.0f} s", flush=True)
        storage = os.path.join(opts.dir, "storage")
        shutil.rmtree(storage, ignore_errors=True)  # a cache miss: every piece is encoded
        cmd = [sys.executable, __file__, "--child", path, storage, "--cpus", str(opts.cpus)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        shutil.rmtree(storage, ignore_errors=True)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"size {gib:g} GiB failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        result = json.loads(line[len("RESULT ") :])
        result["file_bytes"] = os.path.getsize(path)
        raw[f"{gib:g}"] = result
        print(f"{gib:g} GiB: {json.dumps(result)}", flush=True)
    base = raw[f"{opts.sizes[0]:g}"]["rss_peak"]
    mib = 2**20
    for gib in opts.sizes:
        r = raw[f"{gib:g}"]
        label = f"{r['file_bytes'] / GIB:.2f} GiB" + (" (baseline)" if gib == opts.sizes[0] else "")
        rows.append(
            {
                "JSONL file": label,
                "records": f"{r['records']:,}",
                "peak RSS before Ray (MiB)": f"{r['rss_before_ray'] / mib:.0f}",
                "peak RSS in all (MiB)": f"{r['rss_peak'] / mib:.0f}",
                "ratio to the smallest": f"{r['rss_peak'] / base:.2f}x",
                "ru_maxrss (MiB)": f"{r['maxrss'] / mib:.0f}",
                "plan_data (s)": f"{r['plan_s']:.1f}",
                "prepare_data (s)": f"{r['prepare_s']:.1f}",
                "MiB/s prepared": f"{r['file_bytes'] / mib / (r['plan_s'] + r['prepare_s']):.1f}",
            }
        )
    worst = max(r["rss_peak"] for r in raw.values()) / mib
    report = {
        "machine": machine(),
        "table": table(rows),
        "ratios": {row["JSONL file"]: float(row["ratio to the smallest"][:-1]) for row in rows},
        "raw": raw,
        "target_mib": TARGET_MIB,
        "worst_peak_mib": round(worst, 1),
        "target_met": worst < TARGET_MIB,
    }
    emit(report, opts.json)


if __name__ == "__main__":
    main()
