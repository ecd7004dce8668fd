"""Cost per event of ``CallbackManager.fire`` against a direct call loop and HF-style dispatch.

Run from the repository root (no Ray, no torch needed)::

    python3 bench/runner/bench_dispatch.py [--json OUT]

Every case runs 7 times (rounds interleave the cases); the table shows the median ns per event, net of the empty-loop
overhead, and its ratio to the direct method-call loop over the same 5 callbacks measured in
the same run. Compare ratios, not absolutes: a busy 2-core machine moves the absolute numbers.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from callbacks import CallbackManager, TrainerCallback, TrainerControl, TrainingContext
from callbacks._manager_async import AsyncCallbackManager

EVENT = "on_step_end"
N_CALLBACKS = 5


class Noop(TrainerCallback):
    """Overrides one hook; accepts both our (context) and HF's (args, state, control) calls."""

    def on_step_end(self, context, *args, **kwargs):
        return None


class HFStyleHandler:
    """A stand-in for transformers' ``CallbackHandler.call_event`` (written here, not imported)."""

    def __init__(self, callbacks: list, with_kwargs: bool) -> None:
        self.callbacks = callbacks
        self.with_kwargs = with_kwargs
        self.model = self.processing_class = self.optimizer = object()
        self.lr_scheduler = self.train_dataloader = self.eval_dataloader = None

    def call_event(self, event, args, state, control, **kwargs):
        for callback in self.callbacks:
            if self.with_kwargs:  # HF passes these six on every event
                result = getattr(callback, event)(
                    args,
                    state,
                    control,
                    model=self.model,
                    processing_class=self.processing_class,
                    optimizer=self.optimizer,
                    lr_scheduler=self.lr_scheduler,
                    train_dataloader=self.train_dataloader,
                    eval_dataloader=self.eval_dataloader,
                    **kwargs,
                )
            else:
                result = getattr(callback, event)(args, state, control, **kwargs)
            if result is not None:
                control = result
        return control


def make_cases() -> dict[str, Callable[[int], None]]:
    ctx = TrainingContext(global_step=10, loss=1.5, learning_rate=1e-4, batch_metrics={"acc": 0.5})
    cbs = [Noop() for _ in range(N_CALLBACKS)]
    fire0 = CallbackManager(cbs, global_callbacks=[]).fire  # fires on_log: nobody subscribes
    fire1 = CallbackManager([Noop()], global_callbacks=[]).fire
    fire5 = CallbackManager(cbs, global_callbacks=[]).fire
    hf = HFStyleHandler(cbs, with_kwargs=False).call_event
    hf6 = HFStyleHandler(cbs, with_kwargs=True).call_event
    args, state, control = object(), object(), TrainerControl()
    methods = [cb.on_step_end for cb in cbs]
    async_manager = AsyncCallbackManager(cbs, global_callbacks=[])

    def empty(n):
        for _ in range(n):
            pass

    def direct(n):
        for _ in range(n):
            for cb in cbs:
                cb.on_step_end(ctx)

    def fire_unsubscribed(n):
        for _ in range(n):
            fire0("on_log", ctx)

    def fire_one(n):
        for _ in range(n):
            fire1(EVENT, ctx)

    def fire_five(n):
        for _ in range(n):
            fire5(EVENT, ctx)

    def hf_getattr(n):
        for _ in range(n):
            hf(EVENT, args, state, control)

    def hf_getattr_kwargs(n):
        for _ in range(n):
            hf6(EVENT, args, state, control)

    def to_wire(n):
        for _ in range(n):
            ctx.to_wire()

    def async_five(n):
        fire = async_manager.fire
        for _ in range(n):
            fire(EVENT, ctx)
        assert async_manager.flush(60)

    assert len(methods) == N_CALLBACKS
    return {
        "empty loop (overhead, subtracted below)": empty,
        f"direct method calls, {N_CALLBACKS} callbacks (baseline)": direct,
        "`manager.fire`, no subscriber": fire_unsubscribed,
        "`manager.fire`, 1 subscriber": fire_one,
        f"`manager.fire`, {N_CALLBACKS} subscribers": fire_five,
        f"HF-style `getattr` dispatch, {N_CALLBACKS} callbacks": hf_getattr,
        f"HF-style `getattr` dispatch + its 6 kwargs, {N_CALLBACKS} callbacks": hf_getattr_kwargs,
        f"async `fire` + handling on the thread, {N_CALLBACKS} subscribers": async_five,
        "`context.to_wire()` (for reference)": to_wire,
    }


def calibrate(fn: Callable[[int], None], target_s: float) -> int:
    """How many iterations of ``fn`` take about ``target_s``."""
    n = 1000
    while True:
        start = time.perf_counter_ns()
        fn(n)
        elapsed = time.perf_counter_ns() - start
        if elapsed > target_s * 1e9 / 4 or n >= 10_000_000:
            return max(1000, int(n * target_s * 1e9 / max(elapsed, 1)))
        n *= 4


def measure(cases: dict[str, Callable[[int], None]], repeat: int, target_s: float) -> dict:
    """Median ns per iteration of each case over ``repeat`` rounds: (wall, process CPU).

    Wall time (``perf_counter_ns``) is the headline. Process CPU time is reported beside it:
    on a shared machine other processes inflate wall time but not our CPU time. The rounds
    interleave the cases, so load from elsewhere hits all of them alike.
    """
    sizes = {name: calibrate(fn, target_s) for name, fn in cases.items()}
    wall: dict[str, list[float]] = {name: [] for name in cases}
    cpu: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            n = sizes[name]
            start, start_cpu = time.perf_counter_ns(), time.process_time_ns()
            fn(n)
            cpu[name].append((time.process_time_ns() - start_cpu) / n)
            wall[name].append((time.perf_counter_ns() - start) / n)
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in cases}


def machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="OUT", help="also write the numbers to this file")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--target-s", type=float, default=0.02, help="seconds per run")
    options = parser.parse_args()

    cases = make_cases()
    raw = measure(cases, options.repeat, options.target_s)
    names = list(raw)
    overhead, overhead_cpu = raw[names[0]]
    base, base_cpu = (raw[names[1]][0] - overhead), (raw[names[1]][1] - overhead_cpu)
    rows = []
    for name in names[1:]:
        ns, ns_cpu = raw[name][0] - overhead, raw[name][1] - overhead_cpu
        rows.append(
            {
                "case": name,
                "ns_per_event": ns,
                "ratio": ns / base,
                "cpu_ns_per_event": ns_cpu,
                "cpu_ratio": ns_cpu / base_cpu,
            }
        )
    date = datetime.date.today().isoformat()
    print(f"Dispatch cost per event, {date}, {machine()}")
    print(
        f"median of {options.repeat} interleaved runs, net of the empty-loop overhead "
        f"({overhead:.0f} ns); wall = perf_counter_ns, CPU = process_time_ns\n"
    )
    print("| case | ns/event | vs direct calls | CPU ns/event | CPU vs direct |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['case']} | {row['ns_per_event']:,.0f} | {row['ratio']:.2f}x "
            f"| {row['cpu_ns_per_event']:,.0f} | {row['cpu_ratio']:.2f}x |"
        )
    if options.json:
        out = {
            "date": date,
            "machine": machine(),
            "repeat": options.repeat,
            "loop_overhead_ns": overhead,
            "rows": rows,
        }
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
