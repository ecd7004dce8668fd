"""Rank-0 cost of forwarding events to the callback actor: batched vs one actor call per event.

Measured in one run, in the driver process (the role of rank 0), against the same real
`CallbackActor` running an actor-side callback subscribed to the events. Steps are paced as in
training: the step's events, then the step's poll, then `--step-ms` of sleep standing for the
step's compute, so the time window batches as it would in a run (a tight loop without pacing
would fill every batch and flatter the batched figure). Two loads:

* light: 2 events per step (`on_step_end` and one more), what a logger or a progress bar asks;
* heavy: 48 events per step (a callback on the per-micro-batch events, 8 micro-batches).

Two ways of sending:

* batched: `EventForwarder.push` per event (to_wire + append; one `.remote()` call per batch of
  up to 256 events or per 250 ms) and `poll_control()` once per step, as the loop does;
* per event: one fire-and-forget `actor.push.remote()` per event (the naive design; baseline).

Figures: CPU per event of the loop's thread (`time.thread_time`: what the loop pays inline) and of
the whole sending process (`time.process_time`: Ray's own threads too; the actor's work is in
another process), and the process's CPU as a share of one core over the paced run.

Usage: python bench/runner/bench_event_forwarder.py [--events 4000] [--step-ms 50] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback, TrainingContext  # noqa: E402

LOADS = {"light": 2, "heavy": 48}  # events per step


class Sink(TrainerCallback):
    """Actor-side: subscribes to the forwarded events and does nothing."""

    def on_step_end(self, context, **kwargs):
        pass

    def on_log(self, context, **kwargs):
        pass

    def on_before_forward(self, context, **kwargs):
        pass


class Meter:
    """Thread CPU, process CPU and wall time over a paced run."""

    def __enter__(self) -> Meter:
        self.thread, self.process = time.thread_time(), time.process_time()
        self.wall = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.thread = time.thread_time() - self.thread
        self.process = time.process_time() - self.process
        self.wall = time.perf_counter() - self.wall


def _event(i: int, per_step: int) -> str:
    return "on_step_end" if i % per_step == 0 else "on_before_forward"


_ATTEMPTS = iter(range(1, 1_000_000))  # each sender its own attempt: the actor dedups by it


def bench_batched(actor_name: str, namespace: str, n: int, per_step: int, step_s: float) -> Meter:
    from ray_trainer._worker.step.event_forwarder import EventForwarder

    fwd = EventForwarder(
        actor_name,
        frozenset({"on_step_end", "on_log", "on_before_forward"}),
        attempt=next(_ATTEMPTS),
        namespace=namespace,
    )
    ctx = TrainingContext(global_step=0, loss=1.0, run_name="bench", args={"lr": 1e-3})
    with Meter() as meter:
        for i in range(n):
            ctx.global_step = i // per_step
            fwd.push(_event(i, per_step), ctx, {})
            if i % per_step == per_step - 1:
                fwd.poll_control()  # what the loop does once per step
                time.sleep(step_s)  # the step's compute
    fwd.close(timeout=120)
    assert fwd.undelivered == 0
    return meter


def bench_per_event(actor, n: int, per_step: int, step_s: float) -> Meter:
    import ray

    from ray_trainer._contract import EventBatch

    ctx = TrainingContext(global_step=0, loss=1.0, run_name="bench", args={"lr": 1e-3})
    refs = []
    attempt = next(_ATTEMPTS)
    with Meter() as meter:
        for i in range(n):
            ctx.global_step = i // per_step
            batch = EventBatch(attempt, i + 1, [(_event(i, per_step), ctx.to_wire(), {})])
            refs.append(actor.push.remote(batch))
            if i % per_step == per_step - 1:
                time.sleep(step_s)
    ray.get(refs)
    return meter


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=4_000, help="events per heavy run")
    parser.add_argument("--step-ms", type=float, default=50.0, help="simulated step compute")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import ray

    from ray_trainer._actor.actor import start_actor
    from ray_trainer._contract import NAMESPACE, actor_name
    from ray_trainer._placement import pack

    init_ray(num_cpus=2)
    packed = pack({"core": [], "user": [Sink()], "global": []})
    actor, ready = start_actor(packed, "bench", tempfile.mkdtemp(), push_wait_s=0.0)
    ray.get(ready)
    step_s = opts.step_ms / 1e3
    samples: dict[str, list[Meter]] = {}
    counts: dict[str, int] = {}
    for _ in range(opts.rounds):
        for load, per_step in LOADS.items():
            n = opts.events if load == "heavy" else max(per_step, opts.events // 20)
            counts[load] = n
            samples.setdefault(f"{load}/batched", []).append(
                bench_batched(actor_name("bench"), NAMESPACE, n, per_step, step_s)
            )
            samples.setdefault(f"{load}/per_event", []).append(
                bench_per_event(actor, n, per_step, step_s)
            )
    ray.shutdown()

    def per_event(key: str, field: str) -> float:
        load = key.split("/")[0]
        return statistics.median(getattr(m, field) for m in samples[key]) / counts[load]

    def core_share(key: str) -> float:
        return statistics.median(m.process / m.wall for m in samples[key])

    rows, ratios = [], {}
    for load, per_step in LOADS.items():
        base = per_event(f"{load}/per_event", "process")
        for how, label in (
            ("per_event", "one actor call per event (baseline)"),
            ("batched", "batched EventForwarder"),
        ):
            key = f"{load}/{how}"
            name = f"{label}, {per_step} events per {opts.step_ms:g} ms step"
            ratio = per_event(key, "process") / base
            ratios[name] = ratio
            rows.append(
                {
                    "sending": name,
                    "loop thread CPU per event (µs)": f"{per_event(key, 'thread') * 1e6:.1f}",
                    "process CPU per event (µs)": f"{per_event(key, 'process') * 1e6:.1f}",
                    "ratio": f"{ratio:.3f}",
                    "process CPU, share of a core": f"{core_share(key) * 100:.2f}%",
                }
            )
    report = {
        "machine": machine(),
        "step_ms": opts.step_ms,
        "events": counts,
        "samples": {
            k: [{"thread": m.thread, "process": m.process, "wall": m.wall} for m in v]
            for k, v in samples.items()
        },
        "baseline": "one actor call per event (baseline)",
        "ratios": ratios,
        "table": table(rows),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
