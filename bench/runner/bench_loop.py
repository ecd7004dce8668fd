"""Step time of the runner's loop against a bare accelerate loop, interleaved in short blocks.

One Ray Train run of 2 workers (gloo DDP, accelerate) on the demo model and data. Each worker
holds one model, optimizer and data stream per configuration, and takes `--block` optimizer
steps of each in turn, in a new random order every round: every configuration sees the same
processes and the same minutes of the machine's load, so slow drift and noisy neighbours cancel
out of the ratios (whole runs of the same loop, minutes apart, differ by up to 10% here). The
first step of each block is not counted: it absorbs what the previous configuration left running
(its callback actor's work, say); the configuration's own asynchronous work lands in its own
block, as it would in a run of its own.

Configurations:

* bare: a plain accelerate loop (prepare, forward, backward, clip, optimizer and scheduler
  step), no callbacks: what
  users write without this runner. The baseline.
* bare, again: a second, identical bare loop. Its ratio is the noise floor of the method.
* runner, no callbacks: the runner's own step (`train_step` + `after_boundary` from
  `ray_trainer/_worker/step/loop.py`: hooks, the per-step agreement all-reduce, on_log every 50
  steps), built by the worker's own `setup` from a `RunSpec` that `prepare_launch` made, as in
  `run_training` (so with its callback actor).
* runner + 3 worker-side callbacks: a step timer (rank 0), a grad-norm watcher (all ranks),
  a loss keeper (rank 0, on_log).
* ... + a slow actor-side callback: the same plus a callback on the callback actor that sleeps
  0.5 s on every step end, slower than the steps arrive, so the actor falls behind and the
  forwarding policy sheds events.
* runner + all built-in callbacks + the slow actor callback: ProgressBar, JsonlLogger,
  RayMetrics, EarlyStopping, DivergenceDetector and TensorBoardLogger (when tensorboard is
  installed), all on the callback actor, plus the slow callback.

Runs: `--runs` independent Ray Train runs (fresh worker processes, the configurations built in
another order each time), each reported, and the median over runs as the figure: within one
run, a configuration's own luck (where its model landed in memory, say) moves all its steps
together, and two identical bare loops can land 1.5% apart; only fresh runs average that out.

Timing: rank 0 times each step with `perf_counter` (fetching the batch included), and its
process CPU time. The first `--warmup` counted steps of each configuration are dropped; each configuration's figure is the mean of its steps without the
slowest 10% (hiccups of the shared machine), and the ratio is that figure over bare's. The
spread column gives the lowest and highest ratio over four consecutive quarters of the rounds.

Usage: python bench/runner/bench_loop.py [--runs 3] [--rounds 70] [--block 8] [--warmup 14]
       [--workers 2] [--json OUT]

``--workers 1`` (`run_all.py --smoke`, in CI): every configuration in one worker, no DDP.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import (  # noqa: E402
    GradNormWatcher,
    LossKeeper,
    SlowActorCallback,
    StepTimer,
    emit,
    init_ray,
    machine,
    table,
)

BARE = ("bare", "bare_again")
LABELS = {
    "bare": "bare accelerate loop, no callbacks (baseline)",
    "bare_again": "bare accelerate loop again (noise floor)",
    "runner": "runner loop, no callbacks",
    "runner_cb": "runner + 3 worker-side callbacks",
    "runner_cb_slow": "runner + 3 worker-side callbacks + slow actor callback (0.5 s/event)",
    "runner_full": "runner + all built-in callbacks + slow actor callback",
}
TRIM = 0.10  # the slowest share of each configuration's steps left out of its mean


def _forever(loader):
    """Batches without end: a new pass over the loader whenever one ends."""
    while True:
        yield from loader


def _runner_steps(loader):
    """The runner's steps without end: epoch after epoch."""
    epoch = 0
    while True:
        yield from loader.steps(epoch)
        epoch += 1


class BareLoop:
    """A plain accelerate training loop, one step per call."""

    def __init__(self, accelerator, seed: int, batch_size: int) -> None:
        import ray.train
        import torch
        from accelerate.utils import set_seed
        from torch.utils.data import DataLoader, DistributedSampler

        from ray_trainer._demo import build_demo

        ctx = ray.train.get_context()
        set_seed(seed)
        demo = build_demo()
        sampler = DistributedSampler(
            demo.train_dataset,
            num_replicas=ctx.get_world_size(),
            rank=ctx.get_world_rank(),
            seed=seed,
        )
        loader = DataLoader(demo.train_dataset, batch_size=batch_size, sampler=sampler)
        model = demo.model_factory()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        self.acc = accelerator
        self.model, self.optimizer = accelerator.prepare(model, optimizer)
        self.batches = _forever(loader)
        self.steps = 0

    def step(self) -> None:
        batch = next(self.batches)
        loss = self.model(**batch).loss
        self.acc.backward(loss)
        self.acc.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.steps % 50 == 0:
            self.acc.reduce(loss.detach(), reduction="mean").item()  # log the mean loss


class RunnerLoop:
    """The runner's loop for one run spec, one optimizer step per call."""

    def __init__(self, spec) -> None:
        from ray_trainer._worker import assemble
        from ray_trainer._worker.boundary import Schedule
        from ray_trainer._worker.step import loop

        self.loop = loop
        self.s = assemble.setup(spec)
        self.s.hooks.fire("on_init_end")
        self.s.hooks.fire("on_train_begin")
        self.steps = _runner_steps(self.s.loader)
        args = self.s.args
        self.schedule = Schedule(
            total_steps=self.s.total_steps,
            log_every_steps=args.log_every_steps,
            save_at_end=args.save_at_end,
        )

    def step(self) -> None:
        control = self.loop.train_step(self.s, next(self.steps))
        self.loop.after_boundary(self.s, control, self.schedule)

    def end(self) -> None:
        self.s.hooks.fire("on_train_end")
        self.s.hooks.close(timeout=self.s.args.callback_timeout_s)


def interleaved(config: dict) -> None:
    """Ray Train worker: build every configuration, then step them in rotating order."""
    import ray.train
    from accelerate import Accelerator

    rank = ray.train.get_context().get_world_rank()
    loops = {name: RunnerLoop(spec) for name, spec in config["specs"].items()}
    accelerator = Accelerator(cpu=True)
    loops.update({name: BareLoop(accelerator, 42, config["batch_size"]) for name in BARE})
    names = sorted(loops)
    times: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(7)  # the same sequence on every rank: the collectives must match
    profiler = cProfile.Profile() if rank == 0 and config["profile"] else None
    for _ in range(config["rounds"]):
        for name in order.sample(names, len(names)):
            profiling = profiler is not None and name == config["profile"]
            for i in range(config["block"]):
                started, cpu_started = time.perf_counter(), time.process_time()
                if profiling:
                    profiler.runcall(loops[name].step)
                else:
                    loops[name].step()
                if i > 0:  # the first step of a block absorbs the previous block's leftovers
                    times[name].append(time.perf_counter() - started)
                    cpu[name].append(time.process_time() - cpu_started)
    for loop in loops.values():
        if isinstance(loop, RunnerLoop):
            loop.end()
    if profiler is not None:
        profiler.dump_stats(config["out"] + ".prof")
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"wall": times, "cpu": cpu}, f)


def _configs(tmp: str) -> dict[str, list]:
    from callbacks import (
        DivergenceDetector,
        EarlyStopping,
        JsonlLogger,
        ProgressBar,
        RayMetrics,
        TensorBoardLogger,
    )
    from callbacks.builtin.tensorboard import find_backend

    def worker_side():
        return [StepTimer(os.path.join(tmp, "steps.json")), GradNormWatcher(), LossKeeper()]

    builtins = [
        ProgressBar(),
        JsonlLogger(),
        RayMetrics(),
        EarlyStopping("val_loss"),
        DivergenceDetector(),
    ]
    if find_backend() is not None:
        builtins.append(TensorBoardLogger())
    return {
        "runner": [],
        "runner_cb": worker_side(),
        "runner_cb_slow": [*worker_side(), SlowActorCallback(0.5)],
        "runner_full": [*builtins, SlowActorCallback(0.5)],
    }


def trimmed_mean(values: list[float]) -> float:
    kept = sorted(values)[: max(1, int(len(values) * (1 - TRIM)))]
    return sum(kept) / len(kept)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="independent runs (fresh workers)")
    parser.add_argument("--rounds", type=int, default=70, help="rounds per run")
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=14, help="measured steps to drop")
    parser.add_argument("--profile", default=None, choices=list(LABELS), help="cProfile one")
    parser.add_argument(
        "--workers", type=int, default=2, help="Ray Train workers (1: run_all.py --smoke)"
    )
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import ray

    init_ray(num_cpus=4)
    started = time.perf_counter()
    runs = []
    for run in range(opts.runs):
        wall, cpu = measure_run(run, opts)
        runs.append(summarize(wall, cpu))
        print(f"run {run}: " + ", ".join(f"{v:.3f}" for v in runs[-1]["comparisons"].values()))
    ray.shutdown()
    report = combine(runs)
    report.update(
        machine=machine(),
        runs=opts.runs,
        rounds=opts.rounds,
        block=opts.block,
        warmup=opts.warmup,
        wall_s=time.perf_counter() - started,
    )
    return emit(report, opts.json)


def measure_run(run: int, opts) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """One Ray Train run stepping every configuration; rank 0's step times (wall, CPU)."""
    from ray.train import RunConfig, ScalingConfig

    from ray_trainer import TrainingArgs
    from ray_trainer._driver.checks.inputs import check_storage, collect_callbacks
    from ray_trainer._driver.launch import finish_actor, prepare_launch
    from ray_trainer._driver.trainer import torch_trainer_class

    with tempfile.TemporaryDirectory() as tmp:
        launches = {}
        configs = list(_configs(tmp).items())
        random.Random(run).shuffle(configs)  # another build order, another memory layout
        for name, callbacks in configs:
            args = TrainingArgs(
                max_steps=10**9,  # never reached: the benchmark decides how many steps
                batch_size=64,
                learning_rate=2e-3,
                lr_schedule="constant",
                num_workers=opts.workers,
                log_every_steps=50,
                save_at_end=False,
                storage_path=os.path.join(tmp, "runs"),
                run_name=f"bench-loop-{run}-{name}",
                callback_timeout_s=1.0,  # do not wait for the slow callback's backlog at the end
                callbacks=callbacks,
            )
            launches[name] = (
                args,
                prepare_launch(args, collect_callbacks(args), check_storage(args)),
            )
        out = os.path.join(tmp, "times.json")
        # run_training's own trainer class: no Ray Data `DatasetManager` actor (a process that
        # imports Ray Data, ~3 CPU-seconds) for a run without a Ray Dataset; the same steps
        torch_trainer_class()(
            interleaved,
            train_loop_config={
                "specs": {name: launch.spec for name, (_, launch) in launches.items()},
                "rounds": opts.rounds,
                "block": opts.block,
                "profile": opts.profile,
                "batch_size": 64,
                "out": out,
            },
            scaling_config=ScalingConfig(num_workers=opts.workers),
            run_config=RunConfig(storage_path=os.path.join(tmp, "ray"), name=f"interleaved-{run}"),
        ).fit()
        for args, launch in launches.values():
            finish_actor(launch, args, None)
        with open(out) as f:
            measured = json.load(f)
        if opts.profile:
            stats = pstats.Stats(out + ".prof").sort_stats("tottime")
            stats.print_stats(45)
    return (
        {k: v[opts.warmup :] for k, v in measured["wall"].items()},
        {k: v[opts.warmup :] for k, v in measured["cpu"].items()},
    )


def combine(runs: list[dict]) -> dict:
    """Medians over the runs, with each run's figure: a run's own noise (a model's memory
    layout, say) moves all its steps together, so only fresh runs average it out."""

    def spread(values: list[float]) -> str:
        return f"{min(values):.3f}-{max(values):.3f}"

    rows = []
    ratios = {}
    for label in LABELS.values():
        per_run = [r["ratios"][label] for r in runs]
        ratios[label] = statistics.median(per_run)
        rows.append(
            {
                "configuration": label,
                "step (ms)": f"{statistics.median(r['step_ms'][label] for r in runs):.1f}",
                "ratio (median of runs)": f"{ratios[label]:.3f}",
                "each run": ", ".join(f"{v:.3f}" for v in per_run),
            }
        )
    compared = []
    comparisons = {}
    for name in runs[0]["comparisons"]:
        per_run = [r["comparisons"][name] for r in runs]
        comparisons[name] = statistics.median(per_run)
        compared.append(
            {
                "comparison": name,
                "ratio (median of runs)": f"{comparisons[name]:.3f}",
                "each run": ", ".join(f"{v:.3f}" for v in per_run),
                "range": spread(per_run),
            }
        )
    return {
        "per_run": runs,
        "baseline": LABELS["bare"],
        "ratios": ratios,
        "comparisons": comparisons,
        "table": table(rows) + "\n\nThe comparisons the issues name:\n\n" + table(compared),
    }


def summarize(times: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict:
    n = len(times["bare"])
    quarters = [slice(i * n // 4, (i + 1) * n // 4) for i in range(4)]

    def vs(key: str, base_key: str) -> tuple[float, float, float]:
        """Ratio of `key` to `base_key` over the run, and its lowest and highest by quarter."""
        parts = [trimmed_mean(times[key][q]) / trimmed_mean(times[base_key][q]) for q in quarters]
        return trimmed_mean(times[key]) / trimmed_mean(times[base_key]), min(parts), max(parts)

    rows, ratios, spreads, step_ms = [], {}, {}, {}
    for key, label in LABELS.items():
        ratio, lo, hi = vs(key, "bare")
        ratios[label], spreads[label] = ratio, (lo, hi)
        step_ms[label] = trimmed_mean(times[key]) * 1e3
        rows.append(
            {
                "configuration": label,
                "step (ms)": f"{step_ms[label]:.1f}",
                "median (ms)": f"{statistics.median(times[key]) * 1e3:.1f}",
                "ratio": f"{ratio:.3f}",
                "spread over quarters": f"{lo:.3f}-{hi:.3f}",
                "rank-0 CPU (ms)": f"{statistics.mean(cpu[key]) * 1e3:.1f}",
            }
        )
    comparisons = {
        "runner + 3 worker-side callbacks vs the bare accelerate loop (issue 3)": vs(
            "runner_cb", "bare"
        ),
        "slow actor-side callback vs none, same worker-side callbacks (issue 4)": vs(
            "runner_cb_slow", "runner_cb"
        ),
        "all built-ins + slow actor callback vs the runner with no callbacks (issue 6)": vs(
            "runner_full", "runner"
        ),
        "all built-ins + slow actor callback vs the bare accelerate loop": vs(
            "runner_full", "bare"
        ),
        "noise floor: the bare loop against itself": vs("bare_again", "bare"),
    }
    compared = [
        {"comparison": k, "ratio": f"{r:.3f}", "spread over quarters": f"{lo:.3f}-{hi:.3f}"}
        for k, (r, lo, hi) in comparisons.items()
    ]
    return {
        "steps_per_configuration": n,
        "samples_s": times,
        "cpu_s": cpu,
        "baseline": LABELS["bare"],
        "ratios": ratios,
        "spreads": spreads,
        "step_ms": step_ms,
        "comparisons": {k: v[0] for k, v in comparisons.items()},
        "table": table(rows) + "\n\nThe comparisons the issues name:\n\n" + table(compared),
    }


if __name__ == "__main__":
    main()
