"""Start-up cost of `run_training` against a bare `TorchTrainer.fit`, in one run.

Each configuration trains one step of a tiny model on 2 workers, with Ray already initialised,
and is timed end to end (the call's wall time). Rounds alternate the configurations; medians are
reported with the difference to the bare fit.

* bare: `TorchTrainer(fn).fit()` where fn builds the model, takes one accelerate step;
* run_training: the same step through the runner (validation, callbacks ObjectRef, summary);
* run_training + actor: the same with one actor-side callback (the callback actor is started).

Usage: python bench/bench_startup.py [--rounds 3] [--json OUT]
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


def time_bare() -> float:
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    start = time.perf_counter()
    TorchTrainer(
        bare_fn,
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="bare"),
    ).fit()
    return time.perf_counter() - start


def time_runner(with_actor: bool) -> float:
    from ray_trainer import run_training

    start = time.perf_counter()
    run_training(
        model=_Model,
        data=_TinyData,
        max_steps=1,
        batch_size=8,
        num_workers=2,
        save_at_end=False,
        storage_path=tempfile.mkdtemp(),
        callbacks=[ActorSide()] if with_actor else [],
    )
    return time.perf_counter() - start


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    import ray

    init_ray(num_cpus=4)
    samples: dict[str, list[float]] = {"bare": [], "runner": [], "runner_actor": []}
    for r in range(opts.rounds):
        samples["bare"].append(time_bare())
        samples["runner"].append(time_runner(False))
        samples["runner_actor"].append(time_runner(True))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items()))
    ray.shutdown()
    base = statistics.median(samples["bare"])
    labels = {
        "bare": "bare TorchTrainer.fit (baseline)",
        "runner": "run_training",
        "runner_actor": "run_training + callback actor",
    }
    rows = []
    for key, values in samples.items():
        med = statistics.median(values)
        rows.append(
            {
                "configuration": labels[key],
                "wall (s)": f"{med:.2f}",
                "vs bare (s)": f"{med - base:+.2f}",
                "ratio": f"{med / base:.3f}",
            }
        )
    report = {
        "machine": machine(),
        "samples_s": samples,
        "table": table(rows, ["configuration", "wall (s)", "vs bare (s)", "ratio"]),
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
