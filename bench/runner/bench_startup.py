"""Start-up cost of `run_training` against a bare `TorchTrainer.fit`, and of the embedded Ray's
dashboard against an embedded Ray without one, in one run.

Each training configuration trains one step of a tiny model on 2 workers, with Ray already
initialised, and is timed end to end (the call's wall time). Medians are reported with the
difference to their baseline.

* bare: `TorchTrainer(fn).fit()` where fn builds the model, takes one accelerate step;
* the same fit with run_training's trainer class: Ray Train's `TorchTrainer` without its Ray
  Data callback (no `DatasetManager` actor per worker-group start, `_driver/trainer.py`);
* run_training: the same step through the runner (validation, callbacks ObjectRef, the callback
  actor, summary);
* run_training + actor-side callback: the same with one callback on the actor (events forwarded).

The embedded Ray is timed in a fresh process per sample (what `run_training` does on one
machine without a cluster: `start_embedded_ray`, then `ray.shutdown`), alternating:

* embedded Ray, no dashboard (``TrainingArgs.dashboard=False``): the baseline of this pair;
* embedded Ray with its dashboard on 127.0.0.1 (the default).

Usage: python bench/runner/bench_startup.py [--rounds 3] [--smoke] [--workers 2] [--json OUT]

``--smoke`` (`run_all.py --smoke`, in CI): one round of the bare fit and `run_training` only, no
embedded-Ray pair (two fits instead of four, and two fresh Ray starts fewer): the same report,
fewer rows.

The training configurations take turns in an order that rotates by one each round (Ray's
worker start moves by seconds from one fit to the next; a fixed order would favour one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback  # noqa: E402


class ActorSide(TrainerCallback):
    """Actor-side: makes run_training start the callback actor."""

    def on_log(self, context, **kwargs):
        pass


def _tiny_model():
    import torch

    return torch.nn.Linear(8, 8)


def _tiny_loss(outputs, batch):
    return ((outputs - batch["labels"]) ** 2).mean()


class _TinyData:
    def __len__(self):
        return 64

    def __getitem__(self, i):
        import torch

        g = torch.Generator().manual_seed(i)
        return {"input": torch.randn(8, generator=g), "labels": torch.randn(8, generator=g)}


class _Model(__import__("torch").nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _tiny_model()

    def forward(self, input, labels):
        return {"loss": ((self.lin(input) - labels) ** 2).mean()}


def bare_fn(config):
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters())
    model, opt = acc.prepare(model, opt)
    batch = {k: torch.stack([_TinyData()[i][k] for i in range(8)]) for k in ("input", "labels")}
    acc.backward(model(**batch)["loss"])
    opt.step()


def time_bare(workers: int, lean: bool = False) -> float:
    """A bare fit; `lean`: through run_training's trainer class (Ray Train's `TorchTrainer`
    without its Ray Data callback, so no `DatasetManager` actor at the worker group's start)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_trainer._driver.trainer import torch_trainer_class

    start = time.perf_counter()
    (torch_trainer_class() if lean else TorchTrainer)(
        bare_fn,
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="bare"),
    ).fit()
    return time.perf_counter() - start


def time_runner(with_actor: bool, workers: int) -> float:
    from ray_trainer import run_training

    start = time.perf_counter()
    run_training(
        model=_Model,
        data=_TinyData,
        max_steps=1,
        batch_size=8,
        num_workers=workers,
        save_at_end=False,
        storage_path=tempfile.mkdtemp(),
        callbacks=[ActorSide()] if with_actor else [],
    )
    return time.perf_counter() - start


EMBEDDED = """
import sys, time
from ray_trainer._driver.console import start_embedded_ray
import ray
start = time.perf_counter()
start_embedded_ray(num_cpus=2, dashboard=sys.argv[1] == "1")
started = time.perf_counter() - start
ray.shutdown()
print("STARTED", started)
"""


def time_embedded(dashboard: bool) -> float:
    """Seconds to start the embedded local Ray in a fresh process (ray.init as the runner
    calls it, with or without the dashboard)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED, "1" if dashboard else "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("STARTED ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"embedded Ray start failed:\n{done.stderr[-3000:]}")
    return float(line.split()[1])


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="1 round: bare and run_training only")
    parser.add_argument("--workers", type=int, default=2, help="workers of every fit")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    import ray

    if opts.smoke:
        opts.rounds = 1
    samples: dict[str, list[float]] = {"ray": [], "ray_dashboard": []}
    # First, before this process starts its own Ray.
    for r in range(0 if opts.smoke else opts.rounds):
        order = ("ray", "ray_dashboard") if r % 2 == 0 else ("ray_dashboard", "ray")
        for key in order:
            samples[key].append(time_embedded(dashboard=key == "ray_dashboard"))
        print(f"round {r}: embedded Ray {samples['ray'][-1]:.2f} s, with dashboard "
              f"{samples['ray_dashboard'][-1]:.2f} s")  # fmt: skip
    init_ray(num_cpus=4)
    timed = {
        "bare": lambda: time_bare(opts.workers),
        "bare_lean": lambda: time_bare(opts.workers, lean=True),
        "runner": lambda: time_runner(False, opts.workers),
        "runner_actor": lambda: time_runner(True, opts.workers),
    }
    if opts.smoke:
        timed = {key: timed[key] for key in ("bare", "runner")}
    samples.update({key: [] for key in timed})
    for r in range(opts.rounds):  # the order rotates: no configuration always runs first
        keys = list(timed)
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            samples[key].append(timed[key]())
        print(f"round {r}: " + ", ".join(f"{k} {samples[k][-1]:.2f} s" for k in timed))
    ray.shutdown()
    groups = {
        "bare": ("bare", "bare TorchTrainer.fit (baseline)"),
        "bare_lean": ("bare", "the same fit without Ray Train's Ray Data callback"),
        "runner": ("bare", "run_training"),
        "runner_actor": ("bare", "run_training + actor-side callback"),
        "ray": ("ray", "embedded Ray, no dashboard (baseline)"),
        "ray_dashboard": ("ray", "embedded Ray + dashboard on 127.0.0.1"),
    }
    rows = []
    for key, (baseline, label) in groups.items():
        if not samples.get(key):  # --smoke: not timed
            continue
        med, base = statistics.median(samples[key]), statistics.median(samples[baseline])
        rows.append(
            {
                "configuration": label,
                "wall (s)": f"{med:.2f}",
                "vs baseline (s)": f"{med - base:+.2f}",
                "ratio": f"{med / base:.3f}",
            }
        )
    report = {
        "machine": machine(),
        "samples_s": samples,
        "table": table(rows, ["configuration", "wall (s)", "vs baseline (s)", "ratio"]),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
