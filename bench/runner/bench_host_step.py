"""Host time per step: the runner's steady-state step against a bare loop, on a host-bound model.

A fast GPU step leaves the host about a millisecond per step; whatever the runner does on the
host each step (firing events, building dicts, the step's agreement, counting tokens) shows up
there as a slower step. This benchmark makes the step that small on the CPU: the demo
transformer at 2 layers, width 32, sequence 31 (``digits=9``), batch 4, two micro-batches per
step (``grad_accum_steps=2``), about a millisecond of compute, on ONE thread
(``torch.set_num_threads(1)``) in one Ray Train worker (world size 1).

Configurations, in the same worker process, stepped in blocks in a new random order every round
(so the machine's load lands on each alike):

* bare: a plain PyTorch loop doing the same work: the same model and samples (the runner's
  epoch order, through a ``DataLoader``), forward, backward of each micro-batch's mean loss over
  the accumulation steps, ``clip_grad_norm_`` at the run's ``max_grad_norm``, AdamW with the
  runner's parameter groups (weight decay on matrices only), a constant ``LambdaLR``, the
  loss read every ``log_every_steps``. The baseline.
* bare, again: an identical second bare loop; its ratio is the noise floor of the method.
* runner: the runner's own step (``train_step`` + ``after_boundary`` of
  ``ray_trainer/_worker/step/loop.py``), built by the worker's own ``setup`` from a ``RunSpec``
  that ``prepare_launch`` made, as in ``run_training``: its callback actor and rank 0's event
  forwarder included, no user callbacks (``RunnerLoop`` of ``bench_loop.py``).

Timing: ``perf_counter`` around each step (the batch's fetch included). The first step of each
block is not counted (it absorbs the previous block's leftovers), nor the first ``--warmup``
counted steps of each configuration. A configuration's figure is the mean of its steps without
the slowest 10%; the ratio is the runner's over bare's. The spread is the lowest and highest
ratio over the rounds taken four at a time (each quarter of the run: its own ratio).

Whole runs (``--whole-rounds``, after the in-worker rounds): what a user's run sees, start to
end. A tiny MLP (``HostMLP``: 3 layers of width 128, batch 16, about a millisecond a step on one
thread) trained by a complete ``run_training`` (its own embedded Ray, one worker, default
logging) in a fresh process, against a bare PyTorch loop of the same model, samples, AdamW,
clipping and logging in a fresh process on one thread; the two alternate, each round in a new
random order. Figures: the wall time between rank 0's step begins and the loop thread's CPU time
per step (``StepTimer``), mean without the slowest 10% of the steps after the first
``--whole-skip``, the median over the rounds, ratio runner / bare. With ``--hogs N`` the rounds
run again beside N busy processes (one spinning Python loop each): a loaded machine, where the
runner's Ray processes compete with the hogs too.

``--profile`` runs cProfile over the runner's steps (other configurations unprofiled) and
prints its top entries by own time, as the report's ``profile``.

Usage: python bench/runner/bench_host_step.py [--rounds 40] [--block 25] [--warmup 50]
    [--profile] [--whole-rounds 3] [--whole-steps 3000] [--whole-skip 200] [--hogs 2]
    [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402
from _support import StepTimer, emit, init_ray, machine, table  # noqa: E402
from bench_loop import RunnerLoop, trimmed_mean  # noqa: E402

LABELS = {
    "bare": "bare PyTorch loop, same work, one thread (baseline)",
    "bare_again": "bare PyTorch loop again (noise floor)",
    "runner": "runner step, no user callbacks, one thread",
}
#: The model and step: host-bound on one core (about 1 ms of compute).
DEMO = {"digits": 9, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_train": 20_000, "n_val": 200}
BATCH_SIZE = 4
GRAD_ACCUM = 2
SEED = 42


#: The whole runs' model (`HostMLP`, `HostData`): about a millisecond a step on one thread.
WHOLE = {"width": 128, "layers": 3, "batch_size": 16, "samples": 8192, "lr": 1e-3}
WHOLE_LABELS = {
    "bare": "whole run: bare PyTorch loop, fresh process, one thread",
    "runner": "whole run: run_training, its embedded Ray, one worker",
    "runner_no_dashboard": "whole run: run_training, dashboard=False",
}


def _host_model():
    """`HostMLP` and `HostData`, built where torch is imported (the whole runs' processes)."""
    import torch
    from torch import nn

    class HostMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            width, layers = WHOLE["width"], WHOLE["layers"]
            self.net = nn.Sequential(
                *[m for _ in range(layers - 1) for m in (nn.Linear(width, width), nn.GELU())],
                nn.Linear(width, 1),
            )

        def forward(self, input_ids, labels):
            pred = self.net(input_ids).squeeze(-1)
            return {"loss": ((pred - labels) ** 2).mean()}

    class HostData(torch.utils.data.Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(SEED)
            self.x = torch.randn(WHOLE["samples"], WHOLE["width"], generator=g)
            self.y = self.x[:, :8].sum(-1)

        def __len__(self) -> int:
            return len(self.x)

        def __getitem__(self, i: int):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    return HostMLP, HostData


def runner_side(steps: int, out: str, dashboard: bool = True) -> None:
    """In its own process: one complete `run_training` of `HostMLP`, one worker, its own Ray
    (with its dashboard, the default, or without)."""
    from ray_trainer import run_training

    model, data = _host_model()
    with tempfile.TemporaryDirectory(prefix="bench_host_run_") as storage:
        run_training(
            model=model,
            data=data,
            batch_size=WHOLE["batch_size"],
            learning_rate=WHOLE["lr"],
            lr_schedule="constant",
            max_steps=steps,
            num_workers=1,
            seed=SEED,
            save_at_end=False,
            storage_path=storage,
            run_name="host-step-run",
            dashboard=dashboard,
            callbacks=[StepTimer(out)],
        )


def bare_side(steps: int, out: str) -> None:
    """In its own process: the same steps as a plain PyTorch loop on one thread (the runner's
    defaults: AdamW with weight decay 0.01 on matrices, clipping at 1.0, the loss read every 10
    steps, as the runner's log)."""
    import torch
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)  # as a Ray worker of one CPU
    torch.manual_seed(SEED)
    model_class, data_class = _host_model()
    model = model_class()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.01},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=WHOLE["lr"],
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    g = torch.Generator().manual_seed(SEED)
    loader = DataLoader(
        data_class(), WHOLE["batch_size"], shuffle=True, drop_last=True, generator=g
    )
    batches = _forever(loader)
    times, cpu = [], []
    for step in range(steps):
        times.append(time.perf_counter())
        cpu.append(time.thread_time())
        loss = model(**next(batches))["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 10 == 0:
            loss.item()
    with open(out, "w") as f:
        json.dump({"times": times, "cpu": cpu, "torch_threads": torch.get_num_threads()}, f)


def whole_runs(opts) -> dict[str, dict[str, list[dict]]]:
    """Each load's (idle; beside `--hogs` busy processes) rounds of both whole runs, in a new
    random order each round: per side, each run's step wall and CPU times after the skip."""
    loads = ["idle"] + (["hogs"] if opts.hogs else [])
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own embedded Ray
    env["PYTHONPATH"] = os.pathsep.join([*_bench_path.FOLDERS, env.get("PYTHONPATH", "")])
    order = random.Random(11)
    runs: dict[str, dict[str, list[dict]]] = {load: {s: [] for s in WHOLE_LABELS} for load in loads}
    with tempfile.TemporaryDirectory(prefix="bench_host_whole_") as tmp:
        for load in loads:
            hogs = [
                subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(opts.hogs if load == "hogs" else 0)
            ]
            try:
                for r in range(opts.whole_rounds):
                    for side in order.sample(list(WHOLE_LABELS), len(WHOLE_LABELS)):
                        out = os.path.join(tmp, f"{load}-{side}-{r}.json")
                        cmd = [sys.executable, os.path.abspath(__file__), "--side", side,
                               "--whole-steps", str(opts.whole_steps), "--out", out]  # fmt: skip
                        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                        if done.returncode != 0:
                            raise RuntimeError(f"whole run {side} failed:\n{done.stdout[-3000:]}"
                                               f"{done.stderr[-3000:]}")  # fmt: skip
                        with open(out) as f:
                            data = json.load(f)
                        wall, cpu = (data[k][opts.whole_skip :] for k in ("times", "cpu"))
                        runs[load][side].append({
                            "wall": [b - a for a, b in itertools.pairwise(wall)],
                            "cpu": [b - a for a, b in itertools.pairwise(cpu)],
                            "torch_threads": data["torch_threads"],
                        })  # fmt: skip
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
    return runs


def summarize_whole(runs: dict[str, dict[str, list[dict]]]) -> tuple[list[dict], dict]:
    """The whole runs' table rows and figures: each side's step (median over the rounds of the
    trimmed mean), its ratio to the bare loop, and the lowest and highest round's ratio."""
    rows, figures = [], {}
    for load, sides in runs.items():
        base = {k: statistics.median(trimmed_mean(run[k]) for run in sides["bare"])
                for k in ("wall", "cpu")}  # fmt: skip
        for side in [s for s in WHOLE_LABELS if sides.get(s)]:
            step = {k: statistics.median(trimmed_mean(run[k]) for run in sides[side])
                    for k in ("wall", "cpu")}  # fmt: skip
            ratio = {k: step[k] / base[k] for k in step}
            spread = {
                kind: "-" if side == "bare" else "{:.3f}-{:.3f} (rounds)".format(*minmax(
                    [trimmed_mean(r[kind]) / trimmed_mean(b[kind])
                     for r, b in zip(sides[side], sides["bare"], strict=True)]))
                for kind in ("wall", "cpu")
            }  # fmt: skip
            label = f"{WHOLE_LABELS[side]}, {load}"
            figures[label] = {"wall": ratio["wall"], "cpu": ratio["cpu"],
                              "core_share": step["cpu"] / step["wall"],
                              "threads": [r["torch_threads"] for r in sides[side]]}  # fmt: skip
            rows.append({
                "configuration": label,
                "step, CPU (ms)": f"{step['cpu'] * 1e3:.3f}",
                "ratio, CPU": f"{ratio['cpu']:.3f}",
                "spread over quarters, CPU": spread["cpu"],
                "step, wall (ms)": f"{step['wall'] * 1e3:.3f}",
                "ratio, wall": f"{ratio['wall']:.3f}",
                "spread over quarters, wall": spread["wall"],
            })  # fmt: skip
    return rows, figures


def minmax(values: list[float]) -> tuple[float, float]:
    return min(values), max(values)


class BareLoop:
    """A plain PyTorch loop over the runner's model and samples, one optimizer step per call."""

    def __init__(self, args) -> None:
        import torch
        from torch.utils.data import DataLoader

        from ray_trainer._data.packing import epoch_order
        from ray_trainer._demo import build_demo

        torch.manual_seed(args.seed)
        demo = build_demo(**args.demo)
        self.model = demo.model_factory()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay},
                {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
            ],
            lr=args.learning_rate,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)
        dataset = demo.train_dataset
        self.loader = DataLoader(
            dataset,
            batch_size=args.batch_size,
            sampler=epoch_order(len(dataset), args.seed, 0).tolist(),
            drop_last=True,
        )
        self.batches = _forever(self.loader)
        self.grad_accum = args.grad_accum_steps
        self.max_grad_norm = args.max_grad_norm
        self.log_every = args.log_every_steps
        self.steps = 0

    def step(self) -> None:
        import torch

        for _ in range(self.grad_accum):
            batch = next(self.batches)
            loss = self.model(**batch).loss / self.grad_accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if self.steps % self.log_every == 0:
            loss.item()  # log the loss: the one sync, as the runner's log boundary


def _forever(loader):
    """Batches without end: a new pass over the loader whenever one ends."""
    while True:
        yield from loader


def interleaved(config: dict) -> None:
    """Ray Train worker (world size 1): build each configuration, step them in rotating order."""
    import torch

    torch.set_num_threads(1)  # host-bound: one core, as a GPU step's host thread
    loops = {"runner": RunnerLoop(config["spec"])}
    loops.update({name: BareLoop(config["args"]) for name in ("bare", "bare_again")})
    names = sorted(loops)
    # Per configuration, per round: its steps' wall and CPU times.
    wall: dict[str, list[list[float]]] = {name: [] for name in names}
    cpu: dict[str, list[list[float]]] = {name: [] for name in names}
    order = random.Random(7)
    # CPU time of this thread: what a loaded machine's other processes take does not count.
    profiler = cProfile.Profile(time.thread_time) if config["profile"] else None
    for _ in range(config["rounds"]):
        for name in order.sample(names, len(names)):
            step, block, block_cpu = loops[name].step, [], []
            profiling = profiler is not None and name == "runner"
            for i in range(config["block"]):
                started, cpu_started = time.perf_counter(), time.thread_time()
                if profiling:
                    profiler.runcall(step)
                else:
                    step()
                if i > 0:  # the first step of a block absorbs the previous block's leftovers
                    block.append(time.perf_counter() - started)
                    block_cpu.append(time.thread_time() - cpu_started)
            wall[name].append(block)
            cpu[name].append(block_cpu)
    loops["runner"].end()
    profile = None
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(config["top"])
        profile = out.getvalue()
    with open(config["out"], "w") as f:
        json.dump({"wall": wall, "cpu": cpu, "profile": profile}, f)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--block", type=int, default=25, help="steps per block (first not counted)")
    parser.add_argument("--warmup", type=int, default=2, help="first rounds of each left out")
    parser.add_argument("--profile", action="store_true", help="cProfile the runner's steps")
    parser.add_argument("--top", type=int, default=30, help="profile entries printed")
    parser.add_argument("--whole-rounds", type=int, default=3, help="whole runs a side (0: none)")
    parser.add_argument("--whole-steps", type=int, default=3000, help="steps of a whole run")
    parser.add_argument("--whole-skip", type=int, default=200, help="first steps not counted")
    parser.add_argument("--hogs", type=int, default=2, help="busy processes of the loaded rounds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--side", choices=list(WHOLE_LABELS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.side:  # one whole run, in the process `whole_runs` started
        if opts.side == "bare":
            bare_side(opts.whole_steps, opts.out)
        else:
            runner_side(opts.whole_steps, opts.out, dashboard=opts.side == "runner")
        return {}
    if opts.rounds - opts.warmup < 4 or opts.block < 2:
        parser.error("need at least 4 counted rounds and blocks of 2 steps or more")
    if opts.whole_rounds and opts.whole_steps - opts.whole_skip < 20:
        parser.error("a whole run needs at least 20 steps after --whole-skip")

    import ray

    init_ray(num_cpus=2)
    started = time.perf_counter()
    measured = measure(opts)
    ray.shutdown()
    report = summarize(
        {k: v[opts.warmup :] for k, v in measured["wall"].items()},
        {k: v[opts.warmup :] for k, v in measured["cpu"].items()},
        whole_runs(opts) if opts.whole_rounds else None,
    )
    if measured["profile"]:
        report["profile"] = measured["profile"]
        print(measured["profile"])
    report.update(
        machine=machine(),
        model=dict(DEMO, batch_size=BATCH_SIZE, grad_accum_steps=GRAD_ACCUM, threads=1),
        whole_model=WHOLE,
        whole_rounds=opts.whole_rounds,
        whole_steps=opts.whole_steps,
        whole_skip=opts.whole_skip,
        hogs=opts.hogs,
        rounds=opts.rounds,
        block=opts.block,
        warmup_rounds=opts.warmup,
        profiled=opts.profile,
        wall_s=time.perf_counter() - started,
    )
    return emit(report, opts.json)


def measure(opts) -> dict:
    """One Ray Train run of one worker stepping every configuration."""
    from ray.train import RunConfig, ScalingConfig

    from ray_trainer import TrainingArgs
    from ray_trainer._driver.checks.inputs import check_storage, collect_callbacks
    from ray_trainer._driver.launch import finish_actor, prepare_launch
    from ray_trainer._driver.trainer import torch_trainer_class

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArgs(
            demo=DEMO,
            max_steps=10**9,  # never reached: the benchmark decides how many steps
            batch_size=BATCH_SIZE,
            grad_accum_steps=GRAD_ACCUM,
            learning_rate=2e-3,
            lr_schedule="constant",
            num_workers=1,
            seed=SEED,
            save_at_end=False,
            storage_path=os.path.join(tmp, "runs"),
            run_name="bench-host-step",
        )
        launch = prepare_launch(args, collect_callbacks(args), check_storage(args))
        out = os.path.join(tmp, "times.json")
        # run_training's own trainer class: no Ray Data `DatasetManager` actor (a process that
        # imports Ray Data, ~3 CPU-seconds) for a run without a Ray Dataset; the same steps
        torch_trainer_class()(
            interleaved,
            train_loop_config={
                "spec": launch.spec,
                "args": args,
                "rounds": opts.rounds,
                "block": opts.block,
                "profile": opts.profile,
                "top": opts.top,
                "out": out,
            },
            scaling_config=ScalingConfig(num_workers=1),
            run_config=RunConfig(storage_path=os.path.join(tmp, "ray"), name="host-step"),
        ).fit()
        finish_actor(launch, args, None)
        with open(out) as f:
            return json.load(f)


def summarize(
    wall: dict[str, list[list[float]]],
    cpu: dict[str, list[list[float]]],
    whole: dict[str, dict[str, list[dict]]] | None = None,
) -> dict:
    """Each configuration's step (ms) and ratio to bare, in wall time and in the loop thread's
    CPU time, with the lowest and highest ratio over the quarters of the rounds; then the whole
    runs' (`whole_runs`), each load's runner against its bare loop."""
    n = len(wall["bare"])
    quarters = [slice(i * n // 4, (i + 1) * n // 4) for i in range(4)]

    def steps(times: dict, key: str, part: slice = slice(None)) -> list[float]:
        return [t for block in times[key][part] for t in block]

    def ratio(times: dict, key: str, part: slice = slice(None)) -> float:
        return trimmed_mean(steps(times, key, part)) / trimmed_mean(steps(times, "bare", part))

    rows, ratios, cpu_ratios, spreads, step_ms = [], {}, {}, {}, {}
    for key, label in LABELS.items():
        ratios[label], cpu_ratios[label] = ratio(wall, key), ratio(cpu, key)
        parts = [ratio(cpu, key, q) for q in quarters]
        wall_parts = [ratio(wall, key, q) for q in quarters]
        spreads[label] = (min(parts), max(parts))
        step_ms[label] = trimmed_mean(steps(wall, key)) * 1e3
        rows.append(
            {
                "configuration": label,
                "step, CPU (ms)": f"{trimmed_mean(steps(cpu, key)) * 1e3:.3f}",
                "ratio, CPU": f"{cpu_ratios[label]:.3f}",
                "spread over quarters, CPU": f"{min(parts):.3f}-{max(parts):.3f}",
                "step, wall (ms)": f"{step_ms[label]:.3f}",
                "ratio, wall": f"{ratios[label]:.3f}",
                "spread over quarters, wall": f"{min(wall_parts):.3f}-{max(wall_parts):.3f}",
            }
        )
    figures: dict[str, dict] = {}
    if whole is not None:
        whole_rows, figures = summarize_whole(whole)
        rows += whole_rows
        ratios.update({k: v["wall"] for k, v in figures.items()})
        cpu_ratios.update({k: v["cpu"] for k, v in figures.items()})
    return {
        "steps_per_configuration": len(steps(wall, "bare")),
        "whole": figures,
        "samples_s": {k: steps(wall, k) for k in wall},
        "cpu_s": {k: steps(cpu, k) for k in cpu},
        "baseline": LABELS["bare"],
        "ratios": cpu_ratios,  # the figure: the loop thread's CPU time, which load moves least
        "wall_ratios": ratios,
        "spreads": spreads,
        "step_ms": step_ms,
        "table": table(rows),
    }


if __name__ == "__main__":
    main()
