"""Chaos run: a run of several minutes on a local Ray cluster while its processes are killed.

A real Ray head (`ray start --head` on 127.0.0.2, its own ports and temp dir, as the cluster
tests start it) runs one training run (2 gloo workers, a checkpoint every ``--save-every``
steps, each step paced to ``--step-s``). At random steps the orchestrator (this process,
which never joins the cluster) injects one fault at a time, after the run has recovered from
the last:

* worker: SIGKILL to a random rank's training process (Ray Train restarts the workers from the
  latest checkpoint; ``max_failures`` is large);
* actor: SIGKILL to the run's callback actor (Ray restarts it; events wait for it);
* driver: SIGTERM to the driver process (what ``ray job stop`` sends): it saves at the next
  step boundary and returns; a new driver with the same ``run_name`` then continues.

It reports the faults injected, the checkpoints written (complete on storage, each verified)
and lost (reported saved by rank 0 but not complete on storage), half-written checkpoint
folders left behind, the ``on_save`` events the actor was handed and those lost (a complete
checkpoint whose ``on_save`` never reached the actor), the steps done twice, and whether the
run ended at ``max_steps``. Target: nothing lost, ended at max_steps. Not in CI, not in
``make bench``: ``python bench/faults/bench_chaos.py`` (about 5 minutes; ``--quick``, about 2).

Usage: python bench/faults/bench_chaos.py [--quick] [--faults 6] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402

TESTS = os.path.join(ROOT, "tests", "support")  # the test suite's local cluster, tiny model
sys.path.insert(0, TESTS)

from _chaos_support import read_ledger  # noqa: E402
from _support import emit, machine, table  # noqa: E402

KINDS = ("worker", "actor", "driver")
RUN_NAME = "chaos"

DRIVER = """
import json, os, sys
import ray
address, fields, ledgers = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
ray.init(address=address, runtime_env={"env_vars": {"PYTHONPATH": os.environ["CHAOS_PATH"]}})
from _chaos_support import ActorLedger, Beacon
from rt_support import SlowSteps, TinyDataset, TinyRegressor
from ray_trainer import run_training
result = run_training(
    model=TinyRegressor, data=lambda: TinyDataset(4096), batch_size=16,
    callbacks=[SlowSteps(fields.pop("step_s")), Beacon(ledgers), ActorLedger(ledgers)], **fields,
)
print("OUTCOME " + json.dumps({
    "global_step": result.global_step, "stopped_early": result.stopped_early,
    "stop_reason": result.stop_reason, "attempts": result.attempts,
    "undelivered_events": result.undelivered_events,
}), flush=True)
"""


@dataclass
class Fault:
    kind: str
    at_step: int  # planned: injected once rank 0 has finished this step
    injected_at: int | None = None  # the step rank 0 had finished when it was injected
    resumed_from: int | None = None  # the step training continued from (worker, driver)
    redone: int = 0  # steps taken again: the last one before the fault minus resumed_from
    detail: str = ""
    seen: int = 0  # rank 0's step records when it was injected
    killed_pid: int = 0  # the process the fault ended (rank 0's for a worker or driver fault)
    recovered: bool = False


@dataclass
class Chaos:
    cluster: Any
    fields: dict[str, Any]
    ledgers: str
    drivers: list[subprocess.Popen] = field(default_factory=list)
    outcomes: list[dict[str, Any]] = field(default_factory=list)

    def start_driver(self) -> None:
        paths = [*_bench_path.FOLDERS, TESTS, ROOT]
        env = {**self.cluster.env(), "CHAOS_PATH": os.pathsep.join(paths)}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (*paths, env.get("PYTHONPATH")) if p)
        log_path = os.path.join(self.ledgers, f"driver-{len(self.drivers)}.log")
        command = [sys.executable, "-c", DRIVER, self.cluster.gcs_address]
        command += [json.dumps(self.fields), self.ledgers]
        with open(log_path, "w") as log:
            driver = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.drivers.append(driver)

    @property
    def driver(self) -> subprocess.Popen:
        return self.drivers[-1]

    def outcome(self) -> dict[str, Any] | None:
        """The OUTCOME line of the current driver once it exited (None before)."""
        if self.driver.poll() is None:
            return None
        with open(os.path.join(self.ledgers, f"driver-{len(self.drivers) - 1}.log")) as f:
            out = f.read()
        line = next((x for x in out.splitlines() if x.startswith("OUTCOME ")), None)
        if line is None:
            raise RuntimeError(f"driver exited {self.driver.returncode}:\n{out[-4000:]}")
        return json.loads(line[len("OUTCOME ") :])

    def steps(self) -> list[dict[str, Any]]:
        return read_ledger(os.path.join(self.ledgers, "steps.jsonl"))

    def actor_records(self) -> list[dict[str, Any]]:
        return read_ledger(os.path.join(self.ledgers, "actor.jsonl"))

    def inject(self, fault: Fault, rng: random.Random, done: int) -> None:
        fault.injected_at = done
        ranks = read_ledger(os.path.join(self.ledgers, "ranks.jsonl"))
        if fault.kind == "worker":
            rank = rng.randrange(self.fields["num_workers"])
            pid = _last(ranks, rank=rank)["pid"]
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"SIGKILL rank {rank} (pid {pid})"
        elif fault.kind == "actor":
            pid = _last(self.actor_records())["pid"]
            os.kill(pid, signal.SIGKILL)
            fault.detail = f"SIGKILL the callback actor (pid {pid})"
        else:
            self.driver.send_signal(signal.SIGTERM)
            fault.detail = f"SIGTERM the driver (pid {self.driver.pid}), then a new driver"
        fault.killed_pid = pid if fault.kind == "actor" else _last(ranks, rank=0)["pid"]

    def check_recovered(self, fault: Fault) -> None:
        """A worker or driver fault is over once a new rank 0 has taken 3 steps; an actor
        fault once the restarted actor has handled an event."""
        if fault.kind == "actor":
            fault.recovered = any(r["pid"] != fault.killed_pid for r in self.actor_records())
            return
        steps = self.steps()
        new = [r["step"] for r in steps if r["pid"] != fault.killed_pid and r["step"] > 0]
        old = [r["step"] for r in steps if r["pid"] == fault.killed_pid]
        first_new = next(
            (i for i, r in enumerate(steps) if r["pid"] != fault.killed_pid and i >= fault.seen),
            None,
        )
        if first_new is None or len(steps) - first_new < 3:
            return
        fault.resumed_from = steps[first_new]["step"] - 1
        fault.redone = max(old) - fault.resumed_from if old else 0
        fault.recovered = bool(new)


def _last(records: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    return [r for r in records if all(r.get(k) == v for k, v in match.items())][-1]


def plan(rng: random.Random, count: int, max_steps: int, spacing: int) -> list[Fault]:
    """`count` faults, kinds in turn (shuffled), at random steps at least `spacing` apart in
    the middle 80% of the run."""
    kinds = [KINDS[i % len(KINDS)] for i in range(count)]
    rng.shuffle(kinds)
    lo, hi = max_steps // 10, max_steps * 9 // 10
    while True:
        steps = sorted(rng.sample(range(lo, hi), count))
        if all(b - a >= spacing for a, b in itertools.pairwise(steps)):
            return [Fault(k, s) for k, s in zip(kinds, steps, strict=True)]


def run(opts: argparse.Namespace) -> dict[str, Any]:
    from local_cluster import LocalCluster

    rng = random.Random(opts.seed)
    work = tempfile.mkdtemp(prefix="chaos")
    storage, ledgers = os.path.join(work, "storage"), os.path.join(work, "ledgers")
    os.makedirs(ledgers)
    fields = {
        "num_workers": 2,
        "max_steps": opts.max_steps,
        "save_every_steps": opts.save_every,
        "log_every_steps": 10,
        "max_failures": 100,
        "storage_path": storage,
        "run_name": RUN_NAME,
        "step_s": opts.step_s,
    }
    faults = plan(rng, opts.faults, opts.max_steps, spacing=2 * opts.save_every)
    cluster = LocalCluster(num_cpus=4)
    cluster.start()
    chaos = Chaos(cluster, fields, ledgers)
    started = time.monotonic()
    pending = list(faults)
    last_fault: Fault | None = None
    try:
        chaos.start_driver()
        while True:
            outcome = chaos.outcome()
            if outcome is not None:
                chaos.outcomes.append(outcome)
                if (
                    last_fault is not None
                    and last_fault.kind == "driver"
                    and outcome["stopped_early"]
                ):
                    chaos.start_driver()
                    continue
                break
            if time.monotonic() - started > opts.timeout_s:
                raise RuntimeError(f"the chaos run took over {opts.timeout_s} s")
            if last_fault is not None and not last_fault.recovered:
                chaos.check_recovered(last_fault)
            steps = chaos.steps()
            done = steps[-1]["step"] if steps else 0
            ready = last_fault is None or last_fault.recovered
            if pending and ready and done >= pending[0].at_step:
                fault = pending.pop(0)
                fault.seen = len(steps)
                chaos.inject(fault, rng, done)
                print(f"step {done}: {fault.detail}", flush=True)
                last_fault = fault
            time.sleep(0.2)  # polling the ledgers, not waiting for an outcome
    finally:
        for driver in chaos.drivers:
            if driver.poll() is None:
                driver.kill()
        cluster.stop()
    report = account(storage, ledgers, faults, chaos.outcomes, opts)
    report["wall_s"] = round(time.monotonic() - started, 1)
    if not opts.keep:
        shutil.rmtree(work, ignore_errors=True)
    return report


def account(
    storage: str,
    ledgers: str,
    faults: list[Fault],
    outcomes: list[dict[str, Any]],
    opts: argparse.Namespace,
) -> dict[str, Any]:
    """What was written, lost and delivered, from storage and the ledgers."""
    from ray_trainer._checkpoint import verify

    run_dir = os.path.join(storage, RUN_NAME)
    complete, half = set(), []
    for name in sorted(os.listdir(run_dir)):
        if not name.startswith("checkpoint_0"):
            continue
        try:
            complete.add(verify(os.path.join(run_dir, name)).global_step)
        except Exception as e:  # a folder that is not a complete checkpoint
            half.append(f"{name}: {e}")
    reported = {r["step"] for r in read_ledger(os.path.join(ledgers, "saves.jsonl"))}
    delivered = [
        r["step"] for r in read_ledger(os.path.join(ledgers, "actor.jsonl")) if r["event"] == "save"
    ]
    final = outcomes[-1] if outcomes else {}
    redone = sum(f.redone for f in faults)
    return {
        "faults": [vars(f) for f in faults],
        "faults_injected": sum(f.injected_at is not None for f in faults),
        "drivers": len(outcomes),
        "checkpoints_written": len(complete),
        "checkpoints_lost": sorted(reported - complete),
        "half_written_left": half,
        "on_save_delivered": len(set(delivered)),
        "on_save_lost": sorted(complete - set(delivered)),
        "on_save_repeated": len(delivered) - len(set(delivered)),
        "steps_redone": redone,
        "undelivered_events": sum(o.get("undelivered_events", 0) for o in outcomes),
        "ended_at_max_steps": final.get("global_step") == opts.max_steps
        and not final.get("stopped_early"),
        "final": final,
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="800 steps and 3 faults")
    parser.add_argument("--max-steps", type=int, default=3000)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--step-s", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--keep", action="store_true", help="keep the storage and ledgers")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if opts.quick:
        opts.max_steps, opts.faults = 800, 3
    report = run(opts)
    rows = [
        {"figure": "faults injected", "value": report["faults_injected"]},
        {"figure": "drivers (first + after each SIGTERM)", "value": report["drivers"]},
        {"figure": "checkpoints written (complete, verified)", "value": report["checkpoints_written"]},
        {"figure": "checkpoints lost", "value": len(report["checkpoints_lost"])},
        {"figure": "half-written checkpoint folders left", "value": len(report["half_written_left"])},
        {"figure": "on_save delivered to the actor", "value": report["on_save_delivered"]},
        {"figure": "on_save lost", "value": len(report["on_save_lost"])},
        {"figure": "on_save delivered twice", "value": report["on_save_repeated"]},
        {"figure": "steps done twice (since the last checkpoint)", "value": report["steps_redone"]},
        {"figure": "ended at max_steps", "value": report["ended_at_max_steps"]},
        {"figure": "wall time (s)", "value": report["wall_s"]},
    ]  # fmt: skip
    faults = table(
        [
            {"fault": f["kind"], "at step": f["injected_at"],
             "resumed from": "-" if f["resumed_from"] is None else f["resumed_from"],
             "steps redone": f["redone"], "what": f["detail"]}
            for f in report["faults"]
        ]
    )  # fmt: skip
    report.update(machine=machine(), table=table(rows) + "\n\n" + faults)
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
