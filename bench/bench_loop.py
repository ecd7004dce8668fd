"""Step time of the runner's loop against a bare accelerate loop, in one run.

Four configurations, each a real 2-worker Ray Train run (gloo DDP, accelerate) on the demo
model and data, timed from inside rank 0 over the steady-state steps:

* bare: a plain accelerate loop (prepare, forward, backward, clip, step), no callbacks;
* runner: `run_training` with three worker-side callbacks (a step timer, a grad-norm watcher on
  all ranks, a loss keeper on rank 0);
* runner + slow actor callback: the same plus an actor-side callback that sleeps 0.1 s on every
  step end (forwarded to the callback actor; the loop must not wait for it);
* runner + built-ins + slow actor callback: `run_training` with the step timer, the full set of
  built-in callbacks (ProgressBar, JsonlLogger, RayMetrics, EarlyStopping on val_loss,
  DivergenceDetector, all on the callback actor) and the slow actor-side callback. The issue's
  target: at most 1.02 x bare. No evaluation runs in the timed steps, so EarlyStopping is
  registered but receives no `on_evaluate`.

The configurations run in rounds, each round in a rotated order, and the median of each is
reported, with the ratio to bare.
Usage: python bench/bench_loop.py [--steps 150] [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _support import (  # noqa: E402
    GradNormWatcher,
    LossKeeper,
    SlowActorCallback,
    StepTimer,
    emit,
    init_ray,
    machine,
    steady_step_seconds,
    table,
)


def bare_loop(config: dict) -> None:
    """A plain accelerate loop in a Ray Train worker: what users write without this runner."""
    import ray.train
    import torch
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from torch.utils.data import DataLoader, DistributedSampler

    from ray_trainer._demo import build_demo

    ctx = ray.train.get_context()
    accelerator = Accelerator(cpu=True)
    set_seed(42)
    demo = build_demo()
    model = demo.model_factory()
    sampler = DistributedSampler(
        demo.train_dataset, num_replicas=ctx.get_world_size(), rank=ctx.get_world_rank(), seed=42
    )
    loader = DataLoader(demo.train_dataset, batch_size=config["batch_size"], sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    times = []
    batches = iter(loader)
    for step in range(config["steps"]):
        times.append(time.perf_counter())
        batch = next(batches)
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0:
            accelerator.reduce(loss.detach(), reduction="mean").item()  # log the mean loss
    if ctx.get_world_rank() == 0:
        with open(config["out"], "w") as f:
            json.dump(times, f)


def run_bare(steps: int, out: str) -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    TorchTrainer(
        bare_loop,
        train_loop_config={"steps": steps, "batch_size": 64, "out": out},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="bare"),
    ).fit()
    with open(out) as f:
        return steady_step_seconds(json.load(f), skip=10)


def run_runner(steps: int, out: str, slow_actor: bool) -> float:
    callbacks = [StepTimer(out), GradNormWatcher(), LossKeeper()]
    if slow_actor:
        callbacks.append(SlowActorCallback(0.1))
    return _run(steps, out, callbacks)


def run_full(steps: int, out: str) -> float:
    """The step timer, every built-in callback (all actor-side) and the slow actor callback."""
    from callbacks import DivergenceDetector, EarlyStopping, JsonlLogger, ProgressBar, RayMetrics

    callbacks = [
        StepTimer(out),
        ProgressBar(),
        JsonlLogger(),
        RayMetrics(),
        EarlyStopping("val_loss"),
        DivergenceDetector(),
        SlowActorCallback(0.1),
    ]
    return _run(steps, out, callbacks)


def _run(steps: int, out: str, callbacks: list) -> float:
    from ray_trainer import run_training

    run_training(
        max_steps=steps,
        batch_size=64,
        learning_rate=2e-3,
        lr_schedule="constant",
        num_workers=2,
        log_every_steps=50,
        save_at_end=False,
        storage_path=tempfile.mkdtemp(),
        callback_timeout_s=1.0,  # do not wait for the slow callback's backlog at the end
        callbacks=callbacks,
    )
    with open(out) as f:
        return steady_step_seconds(json.load(f), skip=10)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()

    import ray

    init_ray(num_cpus=4)
    samples: dict[str, list[float]] = {
        "bare": [],
        "runner": [],
        "runner_slow_actor": [],
        "runner_full": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "bare": lambda out: run_bare(opts.steps, out),
            "runner": lambda out: run_runner(opts.steps, out, slow_actor=False),
            "runner_slow_actor": lambda out: run_runner(opts.steps, out, slow_actor=True),
            "runner_full": lambda out: run_full(opts.steps, out),
        }
        keys = list(runs)
        for r in range(opts.rounds):
            out = os.path.join(tmp, f"times-{r}.json")
            # Each round starts with a different configuration: none always follows another
            # run's teardown, or always runs at the same point of the machine's load.
            for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
                samples[key].append(runs[key](out))
            print(
                f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms" for k, v in samples.items())
            )
    ray.shutdown()
    base = statistics.median(samples["bare"])
    rows = []
    labels = {
        "bare": "bare accelerate loop, no callbacks (baseline)",
        "runner": "run_training + 3 worker-side callbacks",
        "runner_slow_actor": "... + actor-side callback sleeping 0.1 s per step",
        "runner_full": "run_training + step timer + all built-in callbacks + the slow actor callback",
    }
    ratios = {}
    for key, values in samples.items():
        med = statistics.median(values)
        ratios[labels[key]] = med / base
        rows.append(
            {
                "configuration": labels[key],
                "step (ms)": f"{med * 1e3:.1f}",
                "ratio": f"{med / base:.3f}",
            }
        )
    report = {
        "machine": machine(),
        "steps": opts.steps,
        "rounds": opts.rounds,
        "samples_s": samples,
        "baseline": labels["bare"],
        "ratios": ratios,
        "table": table(rows, ["configuration", "step (ms)", "ratio"]),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
