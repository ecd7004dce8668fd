"""Elastic training: what losing a node and getting it back costs, on a real local cluster.

A real Ray cluster as `cluster.yaml` shapes it (`ray start --head` on 127.0.0.2 offering no
CPU, as the cluster tests start it; two worker nodes of one CPU each on 127.0.0.3 and
127.0.0.4) runs the tiny regression model with ``num_workers=[1, 2]``, a checkpoint every
``--save-every`` steps and each step paced to ``--step-s``. The orchestrator (this process,
which never joins the cluster) kills the second node's raylet once rank 0 has finished
``--lose-at``; once the smaller group has trained ``--away`` steps it starts the node again.
An uninterrupted run with both nodes up, same seed and global batch, is the baseline.

Reported, from every rank's event log (`time.monotonic`, one clock on one host):

* the time from the node's loss to the first step of the smaller group, and from its return
  (the new raylet up) to the first step of the larger one;
* the steps trained again at each change (the last step before it minus the step resumed from),
  beside what periodic saves alone would have cost (the last step before it, modulo
  ``--save-every``): the difference is the save the callback actor asks for when a node joins;
* the largest relative difference between the logged loss of a step and the baseline's (the
  losses after each change are those of the uninterrupted run, up to the reduction order).

Not in CI; in ``make bench`` (about 8 minutes): ``python bench/faults/bench_elastic.py [--json OUT]``.
``--smoke`` (`run_all.py --smoke`, in CI) is its smallest piece: the same cluster, without its
dashboard, and the uninterrupted run of 6 steps over both nodes, no node lost; its table has
the one row.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401

TESTS = os.path.join(ROOT, "tests", "support")  # the test suite's local cluster, tiny model
sys.path.insert(0, TESTS)

from _support import emit, machine, table  # noqa: E402
from driver_process import start_driver  # noqa: E402

NODE_A, NODE_B = "127.0.0.3", "127.0.0.4"


def records(folder: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in glob.glob(os.path.join(folder, "all_ranks-*.jsonl")):
        with open(path) as f:
            for line in f:
                with contextlib.suppress(ValueError):  # a line being written
                    out.append(json.loads(line))
    return out


def steps_of(rs: list[dict[str, Any]], attempt: int) -> list[dict[str, Any]]:
    return sorted(
        (
            r
            for r in rs
            if r["event"] == "on_step_end" and r["rank"] == 0 and r["attempt"] == attempt
        ),
        key=lambda r: r["t"],
    )


def small_steps(rs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank 0's steps on a group of one worker."""
    ones = {r["attempt"] for r in rs if r["event"] == "on_train_begin" and r["world_size"] == 1}
    return [r for a in sorted(ones) for r in steps_of(rs, a)]


def wait_for(driver: subprocess.Popen, predicate: Any, what: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if driver.poll() is not None:
            raise RuntimeError(f"the run ended before {what}:\n{driver.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the run never reached {what}")
        time.sleep(0.1)  # polling the event logs


def finish(driver: subprocess.Popen) -> str:
    out, _ = driver.communicate(timeout=600)
    if driver.returncode != 0 or "OUTCOME" not in out:
        raise RuntimeError(f"the run failed:\n{out[-3000:]}")
    return out


def losses(rs: list[dict[str, Any]]) -> dict[int, float]:
    """Each step's logged loss, as the last attempt that logged it saw it."""
    out = {}
    for r in sorted(rs, key=lambda r: (r["attempt"], r["t"])):
        if r["event"] == "on_log" and r["rank"] == 0:
            out[r["step"]] = r["loss"]
    return out


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from local_cluster import LocalCluster

    work = tempfile.mkdtemp(prefix="elastic")
    fields = {
        "num_workers": [1, 2],
        "placement_strategy": "SPREAD",  # a worker on each node
        "elastic_resize_interval_s": opts.resize_interval,
        "max_steps": opts.max_steps,
        "save_every_steps": opts.save_every,
        "log_every_steps": 1,
        "learning_rate": 0.01,
        "storage_path": os.path.join(work, "storage"),
        "worker_start_timeout_s": 60,
    }
    # The smaller group holds its steps some way after the node's return, until the group has
    # grown (so a slow resize cannot let the run end first; the times measured end earlier).
    hold = {"_hold_while_small": [opts.hold_at, 2], "_step_s": opts.step_s}
    # --smoke: no dashboard (nothing of its run reads it; its head and nine module processes)
    cluster = LocalCluster(num_cpus=0, fast_failure_detection=True, dashboard=not opts.smoke)
    try:  # a start that times out leaves its daemons running: stopped below too
        cluster.start()
        cluster.add_node(NODE_A, num_cpus=1)
        cluster.add_node(NODE_B, num_cpus=1)
        base_dir = os.path.join(work, "baseline")
        baseline = {**fields, "run_name": "baseline", "_records": base_dir, "_step_s": opts.step_s}
        launched = time.monotonic()
        finish(start_driver(cluster, baseline))
        if opts.smoke:
            return smoke_report(records(base_dir), launched, opts, work)

        folder = os.path.join(work, "elastic")
        driver = start_driver(
            cluster, {**fields, **hold, "run_name": "elastic", "_records": folder}
        )
        wait_for(driver, lambda: any(r["step"] >= opts.lose_at for r in steps_of(records(folder), 0)),
                 f"step {opts.lose_at}")  # fmt: skip
        lost_at = time.monotonic()
        cluster.raylet(NODE_B).kill()
        wait_for(
            driver, lambda: len(small_steps(records(folder))) >= opts.away, "the smaller group"
        )
        at_join = small_steps(records(folder))[-1]["step"]  # the node joins during add_node
        cluster.add_node(NODE_B, num_cpus=1)
        back_at = time.monotonic()
        out = finish(driver)
        with open(os.path.join(work, "elastic-driver.log"), "w") as f:  # kept with --keep
            f.write(out)
    finally:
        cluster.stop()

    rs, base = records(folder), records(base_dir)
    # The attempts that trained (a start that failed while Ray Train still saw the lost node
    # has no on_train_begin): the first on one worker, and the first on two after it.
    begins = {r["attempt"]: r for r in rs if r["event"] == "on_train_begin" and r["rank"] == 0}
    small = min((a for a, r in begins.items() if r["world_size"] == 1), default=None)
    grown = min((a for a, r in begins.items() if small is not None and a > small), default=None)
    if small is None or grown is None or begins[grown]["world_size"] != 2:
        sizes = {a: r["world_size"] for a, r in begins.items()}
        raise RuntimeError(f"expected sizes 2, 1, 2; got {sizes}:\n{out[-3000:]}")

    def last_step_before(attempt: int) -> int:
        return max(r["step"] for a in begins if a < attempt for r in steps_of(rs, a))

    shrink_first, grow_first = steps_of(rs, small)[0], steps_of(rs, grown)[0]
    redone_shrink = last_step_before(small) - begins[small]["step"]
    redone_grow = last_step_before(grown) - begins[grown]["step"]
    want, got = losses(base), losses(rs)
    worst = max(abs(got[s] - want[s]) / max(abs(want[s]), 1e-12) for s in want)
    # The save the callback actor asked for when the node joined: one off the periodic steps.
    join_saves = sorted(
        r["step"]
        for r in rs
        if r["event"] == "on_save" and r["rank"] == 0 and r["attempt"] == small
        and r["step"] % opts.save_every and r["step"] >= at_join
    )  # fmt: skip
    rows = [
        {
            "change": "node lost: 2 -> 1 workers",
            "to first step (s)": round(shrink_first["t"] - lost_at, 1),
            "steps trained again": redone_shrink,
            "with periodic saves only": last_step_before(small) % opts.save_every,
        },
        {
            "change": "node back: 1 -> 2 workers",
            "to first step (s)": round(grow_first["t"] - back_at, 1),
            "steps trained again": redone_grow,
            "with periodic saves only": last_step_before(grown) % opts.save_every,
        },
    ]
    report = {
        "name": "elastic",
        "machine": machine(),
        "baseline": "an uninterrupted run on both nodes, same seed and global batch",
        "rows": rows,
        "worker_sizes": [begins[a]["world_size"] for a in sorted(begins)],
        "node_joined_at_step": at_join,
        "saves_asked_on_join": join_saves,
        "failed_attempts": sorted(set(range(max(begins) + 1)) - set(begins)),
        "attempts": max(begins) + 1,
        "max_loss_rel_diff": worst,
        "options": vars(opts),
        "table": table(rows)
        + f"\n\nlargest relative loss difference to the uninterrupted run: {worst:.1e}"
        + f" (over {len(want)} steps; sizes {[begins[a]['world_size'] for a in sorted(begins)]})"
        + f"\nthe node joined at step {at_join}; saves asked on its join at steps {join_saves};"
        + f" attempts that never trained: {sorted(set(range(max(begins) + 1)) - set(begins))}",
    }
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return report


def smoke_report(
    rs: list[dict[str, Any]], launched: float, opts: argparse.Namespace, work: str
) -> dict[str, Any]:
    """`--smoke`: the uninterrupted run's records as a report of the same shape, no node lost
    (the cluster, the driver, both workers over the two nodes, the event logs, the table)."""
    begins = {r["attempt"]: r for r in rs if r["event"] == "on_train_begin" and r["rank"] == 0}
    sizes = [begins[a]["world_size"] for a in sorted(begins)]
    if sizes != [2]:
        raise RuntimeError(f"expected one attempt on 2 workers, got sizes {sizes}")
    first = steps_of(rs, min(begins))[0]
    rows = [
        {
            "change": "none (--smoke: no node lost)",
            "to first step (s)": round(first["t"] - launched, 1),
            "steps trained again": 0,
            "with periodic saves only": 0,
        }
    ]
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "name": "elastic",
        "machine": machine(),
        "baseline": "an uninterrupted run on both nodes, same seed and global batch",
        "rows": rows,
        "worker_sizes": sizes,
        "steps_logged": len(losses(rs)),
        "options": vars(opts),
        "table": table(rows) + f"\n\n--smoke: {len(losses(rs))} steps logged, sizes {sizes}",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-steps", type=int, default=240)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--lose-at", type=int, default=110)
    p.add_argument("--away", type=int, default=10, help="steps of the smaller group")
    p.add_argument("--resize-interval", type=float, default=5.0)
    p.add_argument("--step-s", type=float, default=0.5, help="each step paced to this long")
    p.add_argument(
        "--hold-at",
        type=int,
        default=220,
        help="the smaller group holds its steps from here until it has grown (so that a slow "
        "resize cannot let the run end first)",
    )
    p.add_argument("--quick", action="store_true", help="a shorter run (smoke test)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the cluster and the uninterrupted run only, 6 steps: no node lost (run_all.py "
        "--smoke)",
    )
    p.add_argument("--keep", action="store_true", help="keep the work folder")
    p.add_argument("--json", help="write the report here")
    opts = p.parse_args()
    if opts.quick:
        opts.max_steps, opts.step_s = 120, 0.25
        opts.save_every, opts.lose_at, opts.away, opts.hold_at = 50, 55, 10, 110
    if opts.smoke:
        opts.max_steps, opts.step_s, opts.save_every = 6, 0.0, 3
    emit(run(opts), opts.json)


if __name__ == "__main__":
    main()
