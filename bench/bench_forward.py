"""Rank-0 cost per event forwarded to the callback actor: batched vs one actor call per event.

Measured in one run, in the driver process (the role of rank 0), as CPU time of the sending
process per event (`time.process_time`), so that the actor's own work does not count:

* batched: `EventForwarder.push` for every event (to_wire + append; one `.remote()` call per
  batch of up to 64 events or per 20 ms) and a `poll_control()` per step, as the loop does;
* per event: one fire-and-forget `actor.push.remote()` per event (the naive design).

Both send to the same real `CallbackActor` running an actor-side callback subscribed to the
events. Usage: python bench/bench_forward.py [--events 20000] [--per-step 8] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback, TrainingContext  # noqa: E402


class Sink(TrainerCallback):
    """Actor-side: subscribes to the forwarded events and does nothing."""

    def on_step_end(self, context, **kwargs):
        pass

    def on_log(self, context, **kwargs):
        pass

    def on_before_forward(self, context, **kwargs):
        pass


def bench_batched(actor_name: str, namespace: str, n: int, per_step: int) -> float:
    from ray_trainer._forward import EventForwarder

    fwd = EventForwarder(
        actor_name,
        frozenset({"on_step_end", "on_log", "on_before_forward"}),
        attempt=0,
        namespace=namespace,
    )
    ctx = TrainingContext(global_step=0, loss=1.0, run_name="bench", args={"lr": 1e-3})
    start = time.process_time()
    for i in range(n):
        ctx.global_step = i // per_step
        fwd.push("on_before_forward" if i % per_step else "on_step_end", ctx, {})
        if i % per_step == per_step - 1:
            fwd.poll_control()  # what the loop does at each step boundary
    used = time.process_time() - start
    fwd.close(timeout=120)
    assert fwd.undelivered == 0
    return used / n


def bench_per_event(actor, n: int) -> float:
    import ray

    ctx = TrainingContext(global_step=0, loss=1.0, run_name="bench", args={"lr": 1e-3})
    refs = []
    start = time.process_time()
    for i in range(n):
        ctx.global_step = i
        refs.append(actor.push.remote(1, i + 1, [("on_step_end", ctx.to_wire(), {})]))
    used = time.process_time() - start
    ray.get(refs)
    return used / n


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--per-step", type=int, default=8, help="events per simulated step")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import ray

    from ray_trainer._actor import NAMESPACE, actor_name, start_actor
    from ray_trainer._placement import pack

    init_ray(num_cpus=2)
    ref = ray.put(pack({"core": [], "user": [Sink()], "global": []}))
    actor, _ = start_actor(ref, "bench", tempfile.mkdtemp(), push_wait_s=0.0)
    batched, single = [], []
    for _ in range(opts.rounds):
        batched.append(bench_batched(actor_name("bench"), NAMESPACE, opts.events, opts.per_step))
        single.append(bench_per_event(actor, max(2_000, opts.events // 10)))
    ray.shutdown()
    b, s = statistics.median(batched), statistics.median(single)
    rows = [
        {
            "sending": "one actor call per event (baseline)",
            "rank-0 CPU per event (µs)": f"{s * 1e6:.1f}",
            "ratio": "1.00",
        },
        {
            "sending": f"batched EventForwarder ({opts.per_step} events/step)",
            "rank-0 CPU per event (µs)": f"{b * 1e6:.1f}",
            "ratio": f"{b / s:.3f}",
        },
    ]
    report = {
        "machine": machine(),
        "batched_s": batched,
        "per_event_s": single,
        "table": table(rows, ["sending", "rank-0 CPU per event (µs)", "ratio"]),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
