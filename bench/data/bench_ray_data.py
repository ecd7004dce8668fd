"""A Ray Dataset as the data against the same records as Parquet files: encoding time, driver memory.

For each size (default 0.05, 0.2 and 1 GiB) a folder of Parquet files of generated
``{"text": ...}`` records (about 1 KiB each; the files reused between runs when already there)
is encoded into a run's token cache twice, each time by a fresh driver process (so that its
peak is its own) on an embedded Ray (``num_cpus`` = the machine's cores):

* ``files``: ``data=<the folder>``, the file source: ``plan_data`` (detection, the scan of every
  record in the driver, before Ray), then ``prepare_data`` (the driver reads each piece of the
  local files and ships it to a preparation task);
* ``ray.data``: ``data=ray.data.read_parquet(<the folder>)``: ``plan_data`` (the first record
  through Ray Data, the plan's fingerprint, no scan), then ``prepare_data`` (one ``map_batches``
  pass: Ray Data's tasks read, check and encode every batch into the cache; the driver reads
  their small results in order).

Reported per size and source: the encoding time (``plan_data`` + ``prepare_data``, Ray's start
left out) and the driver's peak RSS (psutil, sampled every 10 ms, the pages of Ray's object store
the driver touches included), each with its ratio to the file source's of the same size, measured
in the same run. The two caches must hold the same samples (their ``lengths.npy`` is compared);
both are deleted after each size.

Usage: python bench/data/bench_ray_data.py [--sizes 0.05 0.2 1] [--dir /tmp/ray_trainer_ray_data]
       [--record-bytes 1024] [--cpus N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import string
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, machine, table  # noqa: E402
from bench_data_scale import PeakRss  # noqa: E402

GIB = 2**30
MIB = 2**20
FILE_BYTES = 64 * MIB  # a Parquet file of the folder holds about this much text
SOURCES = ("files", "ray.data")


def generate(folder: str, size: int, record_bytes: int) -> None:
    """A folder of Parquet files holding `size` bytes of text (to within a record) in
    ``{"text": ...}`` records, from a pool of texts so that a GiB takes seconds."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(500)]
    pool = [
        " ".join(rng.choice(words) for _ in range(record_bytes // 6)) for _ in range(256)
    ]  # ~record_bytes each
    per_file = max(1, FILE_BYTES // record_bytes)
    records = max(1, size // record_bytes)
    tmp = folder + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for n, start in enumerate(range(0, records, per_file)):
        count = min(per_file, records - start)
        texts = [pool[(start + i) % len(pool)] for i in range(count)]
        pq.write_table(pa.table({"text": texts}), os.path.join(tmp, f"part-{n:04d}.parquet"),
                       row_group_size=4096)  # fmt: skip
    os.replace(tmp, folder)


def child(kind: str, folder: str, storage: str, cpus: int) -> dict:
    """One driver: the data planned and encoded from `kind`; its own peak and times."""
    rss = PeakRss()
    from _support import init_ray

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._driver.data import plan_data, prepare_data

    if kind == "files":
        data, ray_s = folder, 0.0
    else:  # a Ray Dataset exists only with Ray up
        started = time.perf_counter()
        init_ray(cpus)
        ray_s = time.perf_counter() - started
        import ray.data

        data = ray.data.read_parquet(folder)
    args = TrainingArgs(data=data, storage_path=storage)
    started = time.perf_counter()
    plans = plan_data(args)
    planned = time.perf_counter()
    if kind == "files":
        init_ray(cpus)
        ray_s = time.perf_counter() - planned
    ready = time.perf_counter()
    caches = prepare_data(plans, args)
    prepared = time.perf_counter()
    peak = rss.stop()
    import ray

    ray.shutdown()
    meta = plans["data"].meta
    return {
        "records": meta["records"],
        "samples": meta["samples"],
        "tokens": meta["tokens"],
        "cache": caches["data"],
        "plan_s": planned - started,
        "prepare_s": prepared - ready,
        "encode_s": (planned - started) + (prepared - ready),
        "ray_init_s": ray_s,
        "rss_peak": peak,
    }


def _same_samples(a: str, b: str) -> bool:
    import numpy as np

    return all(
        np.array_equal(np.load(os.path.join(a, name)), np.load(os.path.join(b, name)))
        for name in ("lengths.npy", "targets.npy")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.05, 0.2, 1], help="GiB")
    parser.add_argument("--dir", default="/tmp/ray_trainer_ray_data")
    parser.add_argument("--record-bytes", type=int, default=1024)
    parser.add_argument("--cpus", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "DIR", "STORAGE"),
                        help=argparse.SUPPRESS)  # fmt: skip
    opts = parser.parse_args()
    if opts.child:
        print("RESULT " + json.dumps(child(*opts.child, opts.cpus)), flush=True)
        return
    os.makedirs(opts.dir, exist_ok=True)
    rows, raw, ratios = [], {}, {}
    for gib in opts.sizes:
        folder = os.path.join(opts.dir, f"parquet-{gib:g}GiB")
        if not os.path.exists(folder):
            started = time.perf_counter()
            generate(folder, int(gib * GIB), opts.record_bytes)
            print(f"generated {folder} in {time.perf_counter() - started:.0f} s", flush=True)
        found = {}
        for kind in SOURCES:
            storage = os.path.join(opts.dir, f"storage-{kind}")
            shutil.rmtree(storage, ignore_errors=True)  # a cache miss: every record is encoded
            cmd = [sys.executable, __file__, "--child", kind, folder, storage,
                   "--cpus", str(opts.cpus)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(
                    f"{kind} at {gib:g} GiB failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
                )
            found[kind] = json.loads(line[len("RESULT ") :])
            print(f"{gib:g} GiB, {kind}: {json.dumps(found[kind])}", flush=True)
        same = _same_samples(found["files"]["cache"], found["ray.data"]["cache"])
        for kind in SOURCES:
            shutil.rmtree(os.path.join(opts.dir, f"storage-{kind}"), ignore_errors=True)
        if not same or found["files"]["samples"] != found["ray.data"]["samples"]:
            sys.exit(f"{gib:g} GiB: the Ray Dataset's cache differs from the files': {found}")
        raw[f"{gib:g}"] = found
        base = found["files"]
        for kind in SOURCES:
            r = found[kind]
            label = f"{gib:g} GiB, {kind}" + (" (baseline)" if kind == "files" else "")
            time_ratio = r["encode_s"] / base["encode_s"]
            rss_ratio = r["rss_peak"] / base["rss_peak"]
            ratios[f"{label}: encoding time"] = round(time_ratio, 3)
            ratios[f"{label}: peak driver RSS"] = round(rss_ratio, 3)
            rows.append(
                {
                    "size, source": label,
                    "records": f"{r['records']:,}",
                    "plan_data (s)": f"{r['plan_s']:.1f}",
                    "prepare_data (s)": f"{r['prepare_s']:.1f}",
                    "encoding (s)": f"{r['encode_s']:.1f}",
                    "time ratio to files": f"{time_ratio:.2f}x",
                    "peak driver RSS (MiB)": f"{r['rss_peak'] / MIB:.0f}",
                    "RSS ratio to files": f"{rss_ratio:.2f}x",
                }
            )
    report = {
        "machine": machine(),
        "table": table(rows),
        "ratios": ratios,
        "raw": raw,
        "worst_ray_peak_mib": round(max(r["ray.data"]["rss_peak"] for r in raw.values()) / MIB, 1),
    }
    emit(report, opts.json)


if __name__ == "__main__":
    main()
