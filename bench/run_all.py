"""Run every benchmark in one command and write `bench/results.{md,json,png}` (`make bench`).

Each benchmark runs as its own subprocess with ``--json`` (so each gets a clean Ray), one after
the other (``--smoke``: two at a time). Their reports are put together with the machine, the
versions and the date: `results.json` (every report, raw samples included), `results.md` (one
section per benchmark: what the baseline is, then its table) and `results.png` (one panel of
ratios per benchmark, see `plot.py`). Every figure is a ratio to a baseline measured side by
side in the same run.

Usage: python bench/run_all.py [--quick | --smoke [--jobs N]] [--only NAME[,NAME]] [--out DIR]

``--quick`` runs fewer steps and rounds; ``--smoke`` (`make bench-smoke`, in CI) runs every
registered benchmark at its smallest settings into a temporary folder (never the committed
results), through the same normalising and writing, and fails unless every one produced a report
that normalised and `results.md` was written. It runs `--jobs` benchmarks at once (default 2:
its figures are not read; a full or quick run times one at a time), the longest first, those
that use Ray on one shared Ray started while the others run (`SharedRay`). ``--only`` runs the
named benchmarks and replaces only their sections of the existing results (`make bench-quick`:
loop, hf_trainer, packing). The full run took 73 minutes on the 2-core development machine
(4,394 s, 2026-11-27; 52 minutes in an earlier run the same day). Under `.ci/cpu_seconds` (a
cgroup of its own) it prints the CPU-seconds of the whole run and of each benchmark (exact with
``--jobs 1``; with two at once each figure holds the other's too).

Nothing a run measured is lost: `results.json` and `results.md` are rewritten as each benchmark
finishes; a report that cannot be normalised is kept as it is, its error noted beside it; the
exit status is non-zero only where a benchmark itself failed, and the summary names it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results.json")
RESULTS_MD = os.path.join(HERE, "results.md")
RESULTS_PNG = os.path.join(HERE, "results.png")
TIMEOUT_S = 3600  # per benchmark: a hung run fails instead of blocking forever
SMOKE_JOBS = 2  # --smoke: benchmarks at once (their figures are not read)
RAY_START_TIMEOUT_S = 300.0  # --smoke: a shared Ray's start (over 90 s seen on a loaded machine)


@dataclass(frozen=True)
class Bench:
    script: str  # relative to bench/, e.g. "runner/bench_loop.py"
    title: str
    baseline: str  # one line: what the ratios are measured against
    full: list[str] = field(default_factory=list)  # extra arguments for the full run
    quick: list[str] = field(default_factory=list)  # extra arguments for --quick
    smoke: list[str] | None = None  # extra arguments for --smoke (None: the --quick ones)
    target: float | None = None
    target_note: str = ""
    # The figures held against their targets: report -> [(what, figure, target, met)]; printed
    # in the run's summary and in results.md, where a miss shows as "MISSED".
    goals: Callable[[dict[str, Any]], list[tuple[str, str, str, bool]]] | None = None
    # --smoke: joins the one Ray the smoke run starts for all (RAY_ADDRESS) instead of starting
    # its own; False for a benchmark without Ray, or with clusters of its own (elastic).
    shares_ray: bool = False
    # --smoke: about how long its smoke run takes alone on the idle 2-core machine (s); a smoke
    # run on several benchmarks at once (`--jobs`) starts the longest first.
    smoke_s: float = 0.0
    # --smoke: starts a Ray cluster of its own (elastic): not while the smoke run's shared Rays
    # start (three head starts at once ran past elastic's 90 s on a loaded machine)
    own_cluster: bool = False
    # --smoke: another benchmark whose smoke run is this one's too (the same script, the same
    # smallest settings: hf_trainer_1rank's is hf_trainer's at one rank). Where both run, the
    # command runs once and its report goes through each one's normalising and section.
    smoke_as: str | None = None


def hf_trainer_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """run_training's tokens/s (the defaults: the embedded Ray with its dashboard) at least
    HF Trainer's, median of the rounds of one run."""
    ratio = next(v for k, v in report["ratios"].items() if k.startswith("run_training (this"))
    return [("run_training tokens/s / HF Trainer's", f"{ratio:.3f}x", ">= 1.000x", ratio >= 1.0)]


def startup_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's own start-up over a bare TorchTrainer.fit of the same one step."""
    samples = report["samples_s"]
    extra = statistics.median(samples["runner"]) - statistics.median(samples["bare"])
    return [("run_training start-up over a bare TorchTrainer.fit", f"{extra:+.2f} s", "<= +1.50 s",
             extra <= 1.5)]  # fmt: skip


def host_step_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's host step at most 1.2x a bare loop's, in the loop thread's CPU time and in
    wall time: inside one worker (`summarize`'s runner row) and between the step begins of whole
    runs (`summarize_whole`'s rows: idle, and beside busy processes where the run had them)."""
    rows = []
    for label, cpu in report["ratios"].items():
        if label.startswith("runner step"):
            what = "host step in one worker"
        elif label.startswith("whole run: run_training, its embedded Ray"):  # the defaults
            what = f"host step of a whole run, {label.rsplit(', ', 1)[1]}"  # idle / hogs
        else:
            continue
        wall = report["wall_ratios"][label]
        rows += [(f"{what}: wall / bare", f"{wall:.3f}x", "<= 1.200x", wall <= 1.2),
                 (f"{what}: CPU / bare", f"{cpu:.3f}x", "<= 1.200x", cpu <= 1.2)]  # fmt: skip
    return rows


def dpo_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's DPO tokens/s against TRL's padded `DPOTrainer` (reference precomputed on
    both sides): padded at least 1.0x, packed at least 1.5x."""
    padded = next(v for k, v in report["ratios"].items() if k.startswith("ray-trainer, padded, r"))
    packed = next(v for k, v in report["ratios"].items() if "packing=True" in k)
    return [
        ("DPO padded tokens/s / TRL's padded", f"{padded:.3f}x", ">= 1.000x", padded >= 1.0),
        ("DPO packed tokens/s / TRL's padded", f"{packed:.3f}x", ">= 1.500x", packed >= 1.5),
    ]


def grpo_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's GRPO steps/s against TRL's `GRPOTrainer` (one process each, transformers
    generation on both sides): at least 0.9x."""
    ratio = next(v for k, v in report["ratios"].items() if k.startswith("ray-trainer"))
    return [("GRPO steps/s / TRL GRPOTrainer's", f"{ratio:.3f}x", ">= 0.900x", ratio >= 0.9)]


def async_rl_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """One engine at `max_staleness=1` against the synchronous one-engine steps/s: at least
    1.4x; its reward at the fixed step within the synchronous run's seed-to-seed spread."""
    ratio = next(v for k, v in report["ratios"].items() if k.startswith("1 engine") and "=1" in k)
    gap, spread = report["reward_gap"], report["seed_spread"]
    rows = [("GRPO steps/s, max_staleness=1 / synchronous", f"{ratio:.3f}x", ">= 1.400x",
             ratio >= 1.4)]  # fmt: skip
    if spread is None:  # one seed (the smoke run): no spread to hold it within
        return [*rows, ("reward gap at the fixed step", f"{gap:.4f}", "a seed spread", False)]
    return [*rows, ("reward gap at the fixed step / seed spread", f"{gap:.4f}",
                    f"<= {spread:.4f}", gap <= spread)]  # fmt: skip


def agents_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """Multi-turn episodes: 256 at once on this machine, and a tool that sleeps 1 s costs the
    step at most 1.5x the instant tool's (the waits overlap)."""
    ratio = next(iter(report["ratios"].values()))
    most = int(report["max_episodes"])
    return [
        ("concurrent episodes in one step", str(most), ">= 256", most >= 256),
        ("step with a tool that sleeps / with an instant tool", f"{ratio:.3f}x", "<= 1.500x",
         ratio <= 1.5),
    ]  # fmt: skip


def data_scale_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The driver's peak RSS, over every file size, under 500 MiB."""
    worst = float(report["worst_peak_mib"])
    return [("peak driver RSS, largest over the sizes", f"{worst:.0f} MiB", "< 500 MiB",
             worst < 500)]  # fmt: skip


BENCHES: dict[str, Bench] = {
    "dispatch": Bench(
        "runner/bench_dispatch.py",
        "Callback dispatch, cost per event",
        "direct method calls on the same 5 callbacks in a plain Python loop (no manager), "
        "same process; median ns per event",
        quick=["--repeat", "3", "--target-s", "0.005"],
        smoke_s=1,
    ),
    "forward": Bench(
        "runner/bench_event_forwarder.py",
        "Rank-0 cost of sending events to the callback actor",
        "one fire-and-forget Ray actor call per event to the same `CallbackActor`; CPU time of "
        "the sending process per event, steps paced as in training (8 events, then 50 ms)",
        quick=["--events", "800", "--rounds", "1"],
        smoke=["--events", "100", "--rounds", "1", "--step-ms", "5"],
        shares_ray=True,
        smoke_s=5,
    ),
    "startup": Bench(
        "runner/bench_startup.py",
        "Start-up: one-step run, and the embedded Ray's dashboard, wall time",
        "a bare `TorchTrainer(fn).fit()` taking the same one accelerate step on 2 workers, Ray "
        "already initialised; for the dashboard rows, the embedded Ray started without its "
        "dashboard in a fresh process, alternating",
        quick=["--rounds", "1"],
        smoke=["--smoke", "--workers", "1"],
        target_note="run_training at most 1.5 s over the bare TorchTrainer.fit",
        goals=startup_goals,
        shares_ray=True,
        smoke_s=45,
    ),
    "first_step": Bench(
        "baselines/bench_first_step.py",
        "Time to the first step: `make demo` against torchrun",
        "the demo's first step written by hand for `torchrun --nproc_per_node 2` (DDP over "
        "gloo, the same model, data and AdamW); each side a fresh process tree, from its launch "
        "to the first step's begin, alternating",
        quick=["--rounds", "1"],
        smoke=["--rounds", "1", "--workers", "1"],
        shares_ray=True,
        smoke_s=31,
    ),
    "loop": Bench(
        "runner/bench_loop.py",
        "Training step time (demo model, 2 workers)",
        "a bare accelerate loop (forward, backward, clip, optimizer and scheduler step), no "
        "callbacks, in the same 2 Ray "
        "Train workers, stepped in turn with every configuration (blocks of 8 steps, random "
        "order); mean step time from rank 0 without the slowest 10% of steps; median of 3 "
        "independent runs",
        quick=["--runs", "1", "--rounds", "8", "--warmup", "7"],
        # 5 counted steps a configuration (rounds x (block - 1) - warmup; the first step of a
        # block is not counted): bench_loop.py splits them in 4 quarters
        smoke=["--runs", "1", "--rounds", "3", "--block", "3", "--warmup", "1", "--workers", "1"],
        target=1.02,
        target_note="each comparison the issues name (worker-side callbacks against the bare "
        "loop; a slow actor-side callback against none; every built-in callback + the slow "
        "actor callback against no callbacks) at a step-time ratio of at most 1.02; the noise "
        "floor row shows how far two identical loops land apart",
        shares_ray=True,
        smoke_s=30,
    ),
    "host_step": Bench(
        "runner/bench_host_step.py",
        "Host time per step: the runner on a host-bound model, one thread",
        "a bare PyTorch loop doing the same work (the demo transformer at 2 layers, width 32, "
        "sequence 31, batch 4 x 2 micro-batches; AdamW, clipping at max_grad_norm, the same "
        "samples), in the same single Ray Train worker on one thread, stepped in turn (blocks "
        "of 20 steps, random order); the loop thread's CPU time per step without the slowest "
        "10% (wall time beside it); and whole runs: a complete run_training of a 1 ms MLP on one "
        "worker against a bare loop in a fresh process, idle and beside 2 busy processes",
        full=["--rounds", "30", "--block", "20"],
        quick=["--rounds", "10", "--block", "10", "--warmup", "1", "--whole-rounds", "1"],
        smoke=[
            *("--rounds", "5", "--block", "3", "--warmup", "1"),
            *("--whole-rounds", "1", "--whole-steps", "150", "--whole-skip", "50", "--hogs", "0"),
        ],
        target=1.2,
        target_note="the runner's step at most 1.2x the bare loop's, in CPU and in wall time, in "
        "one worker and in whole runs, idle and beside busy processes",
        goals=host_step_goals,
        shares_ray=True,
        smoke_s=18,
    ),
    "eval": Bench(
        "eval/bench_eval.py",
        "Evaluation on save: whole-run wall time",
        "the same evaluation function run synchronously in a rank-0 `on_save` callback (the "
        "loop waits, as with HF Trainer's in-loop evaluation)",
        quick=["--max-steps", "40", "--save-every", "10", "--eval-seconds", "1", "--rounds", "1"],
        # one save (the last step), so one evaluation each way; one worker
        smoke=[
            *("--max-steps", "2", "--save-every", "2", "--eval-seconds", "0.1"),
            *("--rounds", "1", "--workers", "1"),
        ],
        shares_ray=True,
        smoke_s=37,
    ),
    "hf_trainer": Bench(
        "baselines/bench_hf_trainer.py",
        "Against Hugging Face Trainer: tokens/s",
        "`transformers.Trainer` under `torchrun --nproc_per_node 2` (gloo, CPU) on the same "
        "model, data, batch size, steps, optimizer and schedule, with equivalent callbacks",
        quick=["--steps", "60", "--skip", "10", "--rounds", "1"],
        # one rank a side (a torchrun rank and a Ray Train worker fewer), so hf_trainer_1rank's
        # smoke run too
        smoke=["--num-workers", "1", "--smoke", "--steps", "8", "--skip", "2"],
        target=1.0,
        target_note="run_training's tokens/s (defaults: the embedded Ray with its dashboard) at "
        "least 1.0x HF Trainer's, median of the rounds",
        goals=hf_trainer_goals,
        shares_ray=True,
        smoke_s=34,
    ),
    "hf_trainer_1rank": Bench(
        "baselines/bench_hf_trainer.py",
        "Against Hugging Face Trainer, one rank each: tokens/s with a core left to Ray",
        "`transformers.Trainer` under `torchrun --nproc_per_node 1` (one compute thread, as a "
        "runner rank of 1 CPU) on the same model, data, batch size, steps, optimizer and "
        "schedule; here Ray's own processes have a core of their own, so the ratio is the "
        "runner's loop against HF Trainer's, without the competition for cores",
        full=["--num-workers", "1", "--rounds", "3"],
        quick=["--num-workers", "1", "--steps", "60", "--skip", "10", "--rounds", "1"],
        smoke_as="hf_trainer",  # at its smallest, hf_trainer is this: one rank a side
        target=1.0,
        target_note="run_training's tokens/s (defaults: the embedded Ray with its dashboard) at "
        "least 1.0x HF Trainer's, median of the rounds",
        goals=hf_trainer_goals,
        shares_ray=True,
        smoke_s=37,
    ),
    "packing": Bench(
        "data/bench_packing.py",
        "Chat data: packed against padded batches, tokens/s and data preparation",
        "the same 2-worker `run_training` of a tiny chat model on the same conversations "
        "(log-normal lengths, median ~200 tokens, longest 2,048) and samples per step, each "
        "micro-batch padded to its longest sample; non-padding tokens/s, median of rounds",
        quick=["--conversations", "300", "--steps", "10", "--rounds", "1"],
        # 10 steps: bench_packing.py reads the log windows after the first (5 steps each)
        smoke=["--smoke", "--conversations", "100", "--steps", "10", "--workers", "1"],
        target=1.5,
        target_note="packed at least 1.5x the padded run's non-padding tokens/s, with a padding "
        "share of at most 0.05",
        shares_ray=True,
        smoke_s=68,
    ),
    "data_scale": Bench(
        "data/bench_data_scale.py",
        "A big data file in the driver: peak memory and preparation time against its size",
        "the smallest file (0.1 GiB of JSONL, ~1 KiB records), through the same driver steps: "
        "`plan_data` (detection and the scan, before Ray), then `prepare_data` on an embedded "
        "Ray; a fresh driver process per size, RSS sampled every 10 ms",
        quick=["--sizes", "0.02", "0.1"],
        smoke=["--sizes", "0.002", "--dir", "{work}/data_scale"],
        target_note="peak driver RSS under 500 MiB at every size (0.1, 1 and 4 GiB), so the "
        "ratio to the smallest file stays near 1; preparation time is reported, without a "
        "target",
        goals=data_scale_goals,
        shares_ray=True,
        smoke_s=7,
    ),
    "ray_data": Bench(
        "data/bench_ray_data.py",
        "A Ray Dataset as the data: encoding time and driver memory against the same files",
        "the same records as a folder of Parquet files (`data=<folder>`, ~1 KiB text records), "
        "encoded into the token cache by a fresh driver on an embedded Ray: `plan_data` then "
        "`prepare_data`, Ray's start left out; the driver's RSS sampled every 10 ms",
        quick=["--sizes", "0.01", "0.05"],
        smoke=["--sizes", "0.002", "--dir", "{work}/ray_data"],
        target_note="none: the ratios say what reading through Ray Data costs over the files "
        "(time) and that the driver's memory does not grow with the data",
        shares_ray=True,
        smoke_s=30,
    ),
    "dpo": Bench(
        "baselines/bench_dpo.py",
        "DPO against TRL's DPOTrainer: tokens/s padded and packed, the reference pass, memory",
        "TRL 1.16's `DPOTrainer` in one process (padded, `precompute_ref_log_probs=True`) on the "
        "same tiny chat model, uneven preference pairs, pairs per step, AdamW and torch threads, "
        'against `run_training(objective="dpo", num_workers=1)`; non-padding tokens of chosen '
        "and rejected sequences per second of steps after the first ones",
        quick=["--quick"],
        smoke=["--smoke"],
        target=1.0,
        target_note="the runner's padded tokens/s at least 1.0x TRL's padded, packed at least "
        "1.5x; the reference pass against training and the peak RSS of a reference in each "
        "step are reported, without a target",
        goals=dpo_goals,
        shares_ray=True,
        smoke_s=58,
    ),
    "grpo": Bench(
        "baselines/bench_grpo.py",
        "GRPO against TRL's GRPOTrainer: steps/s, completion tokens/s, where a step goes",
        "TRL 1.16's `GRPOTrainer` in one process (transformers generation, no vLLM) on the same "
        "tiny chat model, prompts, prompts per step, `num_generations`, completion length, "
        "sampling seed, reward function and torch threads, against "
        '`run_training(objective="grpo", num_workers=1, rollout_backend="hf")`; steps per '
        "second of the steps after the first ones",
        quick=["--quick"],
        smoke=["--smoke"],
        target=0.9,
        target_note="the runner's steps/s at least 0.9x TRL's; completion tokens/s and the "
        "shares of a step in rollout, reward, sync and training are reported, without a target",
        goals=grpo_goals,
        shares_ray=True,
        smoke_s=60,
    ),
    "grpo_agents": Bench(
        "baselines/bench_grpo.py",
        "Multi-turn GRPO (tools) against TRL's GRPOTrainer with the same environment: steps/s",
        "TRL 1.16's `GRPOTrainer` in one process with `environment_factory` (transformers "
        "generation, its tool loop in process) on the same tiny chat model warmed up to call "
        "`multiply`, the same environment, prompts, sampling, turns and reward, against "
        '`run_training(objective="grpo", environment_factory=..., num_workers=1, '
        'rollout_backend="hf")` (its environment in an actor); steps per second of the steps '
        "after the first ones",
        full=["--agents"],
        quick=["--agents", "--quick"],
        smoke=["--agents", "--smoke"],
        target=0.9,
        target_note="the runner's synchronous steps/s at least 0.9x TRL's with the same "
        "environment; the shares of a step are reported, without a target",
        goals=grpo_goals,
        shares_ray=True,
        smoke_s=60,
    ),
    "async_rl": Bench(
        "runner/bench_async_rl.py",
        "Asynchronous GRPO rollouts (max_staleness) against synchronous ones: steps/s, reward",
        "the synchronous step (`max_staleness=0`) with the same number of `hf` rollout engines "
        "and training workers (one CPU each), on `bench_grpo.py`'s tiny chat model, prompts, "
        "reward, sampling and seed; steps per second of the steps after the first ones, and the "
        "mean reward of the last steps against the synchronous run's spread over two seeds",
        quick=["--quick"],
        smoke=["--smoke"],
        target=1.4,
        target_note="one engine at max_staleness=1 at least 1.4x the synchronous steps/s, with "
        "its reward at the fixed step within the synchronous run's seed-to-seed spread; "
        "staleness 2 and two engines are reported, without a target",
        goals=async_rl_goals,
        shares_ray=True,
        smoke_s=70,
    ),
    "agents": Bench(
        "runner/bench_agents.py",
        "Multi-turn GRPO episodes (tools): episodes/s against concurrency, a tool that waits",
        "the same step's episodes with an instant tool, in the same round: one `hf` engine "
        "actor (a tiny ChatML model warmed up to call `multiply`), one environment actor, the "
        "`AgentSampler` a training worker uses; no training",
        quick=["--episodes", "16,64", "--rounds", "1"],
        smoke=["--smoke"],
        target=1.5,
        target_note="256 concurrent episodes reached; at 64 episodes a tool that sleeps 1 s "
        "costs the step at most 1.5x the instant tool's; episodes/s at 16, 64 and 256 are "
        "reported, without a target",
        goals=agents_goals,
        shares_ray=True,
        smoke_s=45,
    ),
    "memory": Bench(
        "memory/bench_memory.py",
        "Models larger than one device: FSDP against DDP, state per rank and checkpoints",
        "DDP through the runner's own `prepare` (accelerate) on the same GPT-2-shaped model "
        "(~96M parameters), the same number of gloo workers, in the same run; state = bytes of "
        "parameters + gradients + AdamW state on the largest rank after one step; checkpoint = "
        "rank 0's `torch.save` of model and optimizer (FSDP: every rank's DCP shards), slowest "
        "rank's save time and bytes of all files",
        quick=["--quick", "--saves", "1", "--rounds", "1"],
        # the state phase on 1 worker: DDP and FSDP once each, one process each (load, LoRA,
        # loss: --quick); its ratios are 1.0 there, the chain is what a smoke run shows
        smoke=["--quick", "--workers", "1", "--phases", "state", "--saves", "1", "--rounds", "1"],
        target_note="FSDP's state per rank at most 1/N + 10% of DDP's (ratio <= 0.55 on 2 "
        "workers, <= 0.275 on 4); checkpoint time and size are reported, without a target; "
        "the load phase: the peak anonymous memory a pretrained 254M-parameter Llama adds to a "
        "worker at most (fp32 model / N) x 1.1 + its largest tensor under FSDP, against "
        "from_pretrained's whole load in every worker",
        smoke_s=19,
    ),
    "save": Bench(
        "runner/bench_save.py",
        "Checkpoints: the pause in training, synchronous against asynchronous",
        "synchronous saves (`ray.train.report` uploads, then training goes on), same strategy "
        "and storage; wall time against the same run without saves; 2 workers, a GPT-2-shaped "
        "HF model (72 MiB of weights), local disk and a filesystem that writes at 100 MiB/s",
        quick=["--steps", "8", "--save-every", "4", "--n-layer", "2", "--n-embd", "256"],
        # no run without saves: sync and async once each, one worker
        smoke=[
            "--smoke",
            "--workers",
            "1",
            "--strategies",
            "ddp",
            "--storages",
            "local",
            "--steps",
            "4",
            "--save-every",
            "2",
            "--n-layer",
            "1",
            "--n-embd",
            "64",
        ],
        target_note="on slow storage, the pause of an asynchronous save at most 0.2x the "
        "synchronous one",
        shares_ray=True,
        smoke_s=77,
    ),
    "elastic": Bench(
        "faults/bench_elastic.py",
        "Elastic training: a node lost and back, on a local cluster with a CPU-less head",
        "an uninterrupted run on both nodes, same seed and global batch (num_workers=[1, 2])",
        quick=["--quick"],
        # the cluster and the uninterrupted run only: a node lost and back takes minutes
        smoke=["--smoke"],
        own_cluster=True,
        target_note="the loss of every step after a change within 1e-4 relative of the "
        "uninterrupted run's; times and steps trained again are reported, without a target",
        smoke_s=55,
    ),
}


# ---- running ------------------------------------------------------------------------------


def cgroup_cpu_seconds() -> float | None:
    """The CPU-seconds so far of every process in this process's own cgroup (cgroup v1's
    cpuacct or v2's cpu.stat): under `.ci/cpu_seconds` (CI's `make bench-smoke`) that is the run's
    whole process tree, Ray's detached daemons and workers included. None where this process is
    in the root cgroup (the machine's total, not the run's) or none is readable."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    for _, controllers, path in lines:
        if "cpuacct" in controllers.split(",") and path != "/":
            try:
                with open(f"/sys/fs/cgroup/cpuacct{path}/cpuacct.usage") as f:
                    return int(f.read()) / 1e9
            except (OSError, ValueError):
                return None
    for hierarchy, _, path in lines:
        if hierarchy == "0" and path != "/":
            try:
                with open(f"/sys/fs/cgroup{path}/cpu.stat") as f:
                    usec = next(line.split()[1] for line in f if line.startswith("usage_usec"))
                return int(usec) / 1e6
            except (OSError, ValueError, StopIteration):
                return None
    return None


def bench_args(name: str, mode: str) -> list[str]:
    """The extra arguments of benchmark `name` for a "full", "quick" or "smoke" run."""
    bench = BENCHES[name]
    if mode == "smoke" and bench.smoke_as is not None:
        return bench_args(bench.smoke_as, mode)
    if mode == "smoke":
        return bench.quick if bench.smoke is None else bench.smoke
    return bench.quick if mode == "quick" else bench.full


def run_one(
    name: str, mode: str, workdir: str, env: dict[str, str] | None = None, forker: Any = None
) -> dict[str, Any]:
    """Run one benchmark script in a subprocess (in `env`, else this process's environment),
    forked by `forker` (a `_forkrun.Forker`: the smoke run) where given; returns its JSON
    report (or an error)."""
    bench = BENCHES[name]
    out = os.path.join(workdir, f"{name}.json")
    log = os.path.join(workdir, f"{name}.log")
    # "{work}" in an argument: this run's work folder (never a folder a full run writes)
    args = [a.replace("{work}", workdir) for a in bench_args(name, mode)]
    cmd = [sys.executable, os.path.join(HERE, bench.script), "--json", out, *args]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    started, cpu_before = time.perf_counter(), cgroup_cpu_seconds()
    if forker is not None:
        open(log, "w").close()
        code = forker.run(cmd, ROOT, dict(os.environ if env is None else env), log, TIMEOUT_S)
    else:
        with open(log, "w") as f:
            try:
                proc = subprocess.run(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=TIMEOUT_S,
                    check=False,
                )
                code = proc.returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
    seconds = time.perf_counter() - started
    cpu_after = cgroup_cpu_seconds()
    # the run's cgroup over this benchmark's wall time: its own CPU-seconds where it ran alone
    # (--jobs 1); with others at once, theirs too
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    if code != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-3000:]
        print(f"[{name}] FAILED ({code}) after {seconds:.0f} s; log {log}:\n{tail}", flush=True)
        return {"error": f"exit {code}; see {log}", "seconds": seconds, "cpu_seconds": cpu}
    try:
        with open(out) as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:  # unreadable: the benchmark's own failure
        print(f"[{name}] FAILED: its report {out} is unreadable: {exc}", flush=True)
        return {"error": f"unreadable report {out}: {exc}; see {log}", "seconds": seconds}
    if not isinstance(report, dict):
        return {"error": f"report {out} is not a JSON object; see {log}", "seconds": seconds}
    report["seconds"] = seconds
    if cpu is not None:
        report["cpu_seconds"] = cpu
    report["command"] = " ".join(["python3", f"bench/{bench.script}", *args])
    report["measured"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"[{name}] done in {seconds:.0f} s", flush=True)
    return report


#: The smoke run's Ray settings (its shared heads' processes and every benchmark of the smoke
#: run, also those with a cluster of their own; never a full run's): the fewest processes and waits per `TorchTrainer.fit`, whose figures
#: nobody reads. Ray Train's controller is started by each benchmark's driver and reads the
#: RAY_TRAIN_* ones from it and the head.
SMOKE_RAY_ENV = {
    # one local node is never drained: no preemption watcher actor per fit (one process fewer,
    # as `run_training`'s own embedded Ray does)
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    # the controller polls its workers every 0.25 s, not 2 s: a run's end, and a checkpoint
    # reported within 2 s of the one before, are not held up to 2 s each
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    # Ray's own metrics every 10 s (its default), not every 1 s as the tests' clusters export
    # them: every worker process sends them, the agent receives them
    "RAY_metrics_report_interval_ms": "10000",
    # no Ray Train metrics of the controller and the workers (the runner's own are unaffected)
    "RAY_TRAIN_METRICS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    # Ray's workers at the niceness of the other benchmarks' processes (Ray's default is 15):
    # beside a benchmark's torchrun or TRL side, a fit's workers would wait for the cores
    # until its worker start timed out
    "RAY_worker_niceness": "0",
    # each node's dashboard agent samples every Ray process (psutil) every 5 s by default, for
    # the dashboard's node view and Prometheus: once a minute here (nobody reads them)
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


#: --smoke: each driver forked from one process with its imports done (`_forkrun`);
#: RAY_TRAINER_SMOKE_FORK=0 starts a fresh Python per benchmark, as a full run does
FORK_SMOKE = os.environ.get("RAY_TRAINER_SMOKE_FORK", "1") == "1"

#: --smoke: the shared Rays with their dashboard (off: Ray's own default for `ray start` is on)
SMOKE_DASHBOARD = os.environ.get("RAY_TRAINER_SMOKE_DASHBOARD", "0") == "1"


class SharedRay:
    """`--smoke`: one Ray for the benchmarks that can share it (`Bench.shares_ray`), one after
    the other, started once instead of once per benchmark (one per benchmark that may run at
    once: `run_benchmarks`). It is the test suite's `LocalCluster` (a `ray start
    --head` on 127.0.0.2 with ports and a temp dir of its own, its dashboard set as the state
    API's address, stopped by process id: never another Ray on the machine). A benchmark joins
    it through ``RAY_ADDRESS`` (`_support.init_ray` and `run_training` both read it); the
    cluster's workers get every bench folder and tests/support on their ``PYTHONPATH``, and it
    and every benchmark that joins it run with `SMOKE_RAY_ENV`."""

    def __init__(self) -> None:
        sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
        import _bench_path
        from local_cluster import LocalCluster

        paths = [ROOT, *_bench_path.FOLDERS, os.path.join(ROOT, "tests", "support")]
        pythonpath = os.pathsep.join(filter(None, [*paths, os.environ.get("PYTHONPATH")]))

        class SmokeCluster(LocalCluster):
            def env(self) -> dict[str, str]:  # the head's, so every worker's, and a joiner's
                return {**super().env(), **SMOKE_RAY_ENV, "PYTHONPATH": pythonpath}

            def start_command(self) -> list[str]:
                # no log monitor: it tails every worker's log files to forward them to drivers
                # that ask for them (`_support.init_ray` does not; the logs stay in the temp dir)
                return [*super().start_command(), "--include-log-monitor=false"]

        # no dashboard: its head process and nine module processes per head, and its start,
        # which timed out under load (no benchmark of the smoke run reads it)
        self._new_cluster = lambda: SmokeCluster(num_cpus=4, dashboard=SMOKE_DASHBOARD)
        self.cluster = self._new_cluster()

    def start(self, timeout_s: float = RAY_START_TIMEOUT_S, attempts: int = 2) -> None:
        """Start the head (bounded: 10 s on an idle machine, over 90 s on one loaded by other
        Ray clusters); a start that fails or times out leaves none of its processes. A failed
        start is tried again once, on new ports and a new temp dir: under load (load average
        20-40 here) `ray start` fails where its raylet takes over 30 s to register, a limit
        of Ray's own."""
        for attempt in range(attempts):
            try:
                self.cluster.start(timeout_s=timeout_s)
                return
            except Exception as exc:  # `ray start` killed at its timeout leaves its daemons
                self.cluster.stop()
                if attempt + 1 == attempts:
                    raise
                print(f"a shared Ray's start failed, trying once more: {exc!s:.300}", flush=True)
                self.cluster = self._new_cluster()
            except BaseException:
                self.cluster.stop()
                raise

    def env(self) -> dict[str, str]:
        """A joining benchmark's environment."""
        return {**self.cluster.node_env(), "RAY_ADDRESS": self.cluster.gcs_address}

    def stop(self) -> None:
        self.cluster.stop()


_RAY_STARTED = object()  # run_benchmarks' event: a shared Ray's start ended


def run_benchmarks(
    names: list[str], mode: str, workdir: str, jobs: int = 1, rays: list[SharedRay] | None = None
) -> Iterator[tuple[str, dict[str, Any]]]:
    """Run the benchmarks `names`, at most `jobs` at once, and yield (name, report) as each one
    ends. With several at once the longest (`Bench.smoke_s`) start first.

    `rays` (the smoke run's `SharedRay`s, not started; one per benchmark that may run at once):
    each benchmark with `shares_ray` runs on one of them, alone: two runs on one Ray would take
    the same callback actor name (`run_training`'s default run name). They start here one after
    the other in the background, while the benchmarks that do not join one run (but not one
    with a cluster of its own, `Bench.own_cluster`); where none starts, each
    benchmark that joins one is reported failed with the error. Each is stopped as soon as no
    benchmark left joins one (its daemons would take CPU from the others), and at the end
    whatever happens."""
    rays = list(rays or [])
    pending = sorted(names, key=lambda n: -BENCHES[n].smoke_s) if jobs > 1 else list(names)
    events: queue.Queue = queue.Queue()
    running: dict[str, SharedRay | None] = {}
    free: list[SharedRay] = []  # started, no benchmark on it
    starting, live = len(rays), list(rays)  # live: started or starting, not stopped
    errors: list[str] = []

    def joins(name: str) -> bool:
        return bool(rays) and BENCHES[name].shares_ray

    def start_rays() -> None:  # one after the other: the first is joined sooner
        for ray in rays:
            began = time.perf_counter()
            try:
                ray.start()
            except BaseException as exc:  # reported as each joining benchmark's error
                events.put((_RAY_STARTED, (ray, f"{type(exc).__name__}: {exc}")))
                continue
            print(f"a Ray for the smoke run at {ray.cluster.gcs_address}, started in "
                  f"{time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
            events.put((_RAY_STARTED, (ray, None)))

    alone = {**os.environ, **SMOKE_RAY_ENV} if mode == "smoke" else None
    forker = None
    if mode == "smoke" and FORK_SMOKE:
        from _forkrun import Forker

        forker = Forker(SMOKE_RAY_ENV)

    def one(name: str, ray: SharedRay | None) -> None:
        try:
            report = run_one(name, mode, workdir, ray.env() if ray else alone, forker)
        except Exception as exc:  # run_one's own failure: this benchmark's
            report = {"error": f"{type(exc).__name__}: {exc}", "seconds": 0.0}
        events.put((name, report))

    def can_start(name: str) -> bool:
        if joins(name):
            return bool(free)
        return not (starting and BENCHES[name].own_cluster)

    def stop(ray: SharedRay) -> None:
        ray.stop()
        live.remove(ray)

    starts = [threading.Thread(target=start_rays, daemon=True)] if rays else []
    for thread in starts:
        thread.start()
    try:
        while pending or running:
            while len(running) < jobs:
                name = next((n for n in pending if can_start(n)), None)
                if name is None:
                    break
                pending.remove(name)
                running[name] = free.pop() if joins(name) else None
                threading.Thread(
                    target=one, args=(name, running[name]), name=name, daemon=True
                ).start()
            what, value = events.get()
            if what is _RAY_STARTED:
                ray, error = value
                starting -= 1
                if error is None:
                    free.append(ray)
                else:  # SharedRay.start stops what it started
                    live.remove(ray)
                    errors.append(error)
                    if not starting and not free and not any(running.values()):
                        for name in [n for n in pending if joins(n)]:  # no Ray will come
                            pending.remove(name)
                            error = f"the shared Ray did not start: {'; '.join(errors)}"
                            yield name, {"error": error, "seconds": 0.0}
            else:
                ray = running.pop(what)
                if ray is not None:
                    free.append(ray)
                yield what, value
            if not any(joins(n) for n in pending):
                for ray in list(free):  # no benchmark left to join it
                    free.remove(ray)
                    stop(ray)
    finally:
        for thread in starts:  # a start still under way would leave its daemons after a stop
            thread.join(timeout=len(rays) * (RAY_START_TIMEOUT_S + 30))
        for ray in list(live):
            stop(ray)
        if forker is not None:
            forker.close()


def smoke_sharing(names: list[str]) -> dict[str, str]:
    """{benchmark: the one whose smoke run it takes} among `names`: each whose `Bench.smoke_as`
    also runs (alone, `--only hf_trainer_1rank`, it runs its smoke settings itself)."""
    return {n: BENCHES[n].smoke_as for n in names if BENCHES[n].smoke_as in names}


def normalise_or_keep(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """`normalise`, or where it fails, the report as the benchmark wrote it with the error
    under ``normalise_error``: a run's figures are never lost to the normalising."""
    if "error" in report:
        return report
    try:
        return normalise(name, report)
    except Exception as exc:  # any bug of the normalising keeps the raw figures
        kept = dict(report)
        kept["normalise_error"] = "".join(traceback.format_exception_only(exc)).strip()
        kept.setdefault("title", BENCHES[name].title if name in BENCHES else name)
        print(f"[{name}] kept as written: normalise failed: {kept['normalise_error']}", flush=True)
        return kept


def normalise(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """Give every report `table`, `ratios`, `baseline` and the registry's title and target."""
    bench = BENCHES[name]
    report = dict(report)
    if "table" not in report and "rows" in report:  # bench_dispatch.py writes rows only
        report["table"] = _dispatch_table(report["rows"])
        report.setdefault(
            "ratios",
            {r["case"]: r["ratio"] for r in report["rows"] if "reference" not in r["case"]},
        )
    if "ratios" not in report and "table" in report:
        report["ratios"] = _ratios_from_table(report["table"])
    ratios = report.get("ratios") or {}
    if "baseline" not in report:
        report["baseline"] = next((k for k in ratios if "baseline" in k), None)
    report["title"] = bench.title
    report["baseline_note"] = bench.baseline
    report["target"] = bench.target
    return report


def _dispatch_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| case | ns/event | vs direct calls | CPU ns/event | CPU vs direct |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['ns_per_event']:,.0f} | {r['ratio']:.2f}x "
            f"| {r['cpu_ns_per_event']:,.0f} | {r['cpu_ratio']:.2f}x |"
        )
    return "\n".join(out)


_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def _ratios_from_table(table: str) -> dict[str, float]:
    """The first column against the column named `ratio...` of the first markdown table in
    `table`; empty where that table has no such column (bench_elastic.py's: times and steps,
    no ratio), or there is no table. A cell without a number (``-``) is left out."""
    lines: list[str] = []
    for line in table.splitlines():
        if line.strip().startswith("|"):
            lines.append(line.strip())
        elif lines:  # the first table ended
            break
    if len(lines) < 2:
        return {}
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    col = next((i for i, c in enumerate(header) if c.lower().startswith("ratio")), None)
    if col is None:
        return {}
    ratios = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) <= col:
            continue
        number = _NUMBER.search(cells[col].replace(",", ""))
        if number:
            ratios[cells[0]] = float(number.group())
    return ratios


# ---- the record -----------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """The machine, the versions, the commit and the date of this run."""
    versions = {"python": platform.python_version()}
    for dist in ("torch", "ray", "accelerate", "transformers", "matplotlib"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}",
        "versions": versions,
        "commit": commit,
    }


def goal_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(benchmark, what, figure, target, "met"/"MISSED") for every goal of the benchmarks in
    the results (a failed benchmark's goals are missed)."""
    rows = []
    for name, report in results["benchmarks"].items():
        goals = BENCHES[name].goals if name in BENCHES else None
        if goals is None:
            continue
        if "error" in report:
            rows.append((name, "(benchmark failed)", "-", "-", "MISSED"))
            continue
        try:
            figures = goals(report)
        except Exception as exc:  # a report kept as written may lack what the goal reads
            rows.append((name, f"(not computed: {type(exc).__name__}: {exc})", "-", "-", "MISSED"))
            continue
        for what, figure, target, met in figures:
            rows.append((name, what, figure, target, "met" if met else "MISSED"))
    return rows


def goals_table(rows: list[tuple[str, str, str, str, str]]) -> str:
    out = ["| benchmark | figure | measured | target | |", "|---|---|---:|---:|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def write_markdown(results: dict[str, Any], path: str) -> None:
    v = results["versions"]
    lines = [
        "# Benchmark results",
        "",
        f"{results['date']}, {_run_kind(results)} of `python3 bench/run_all.py`, commit "
        f"`{results['commit']}`.",
        "",
        f"- machine: {results['machine']}",
        "- versions: " + ", ".join(f"{k} {v[k]}" for k in v),
        f"- load average (1 min) at start / end: {results['load'][0]:.1f} / "
        f"{results['load'][1]:.1f} (other work on the machine inflates absolute times; "
        "compare ratios)",
        "",
        "Every figure is a ratio to a baseline measured side by side in the same run "
        "(configurations alternate, or rotate, in rounds; medians). Plot: [results.png](results.png).",
        "",
        "![ratios to baseline](results.png)",
    ]
    goals = goal_rows(results)
    if goals:
        lines += ["", "## Targets", "", goals_table(goals)]
    for name, b in results["benchmarks"].items():
        lines += ["", f"## {b.get('title', name)}", ""]
        lines += _section(name, b, results)
    tmp = f"{path}.tmp"  # whole or not at all: a crash mid-write leaves the previous file
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


def _run_kind(results: dict[str, Any]) -> str:
    mode = results.get("mode") or ("quick" if results.get("quick") else "full")
    kind = {"full": "full run", "quick": "quick run", "smoke": "smoke run"}.get(mode, mode)
    jobs = results.get("jobs", 1)
    return kind if jobs == 1 else f"{kind} ({jobs} benchmarks at a time)"


def _section(name: str, b: dict[str, Any], results: dict[str, Any]) -> list[str]:
    """The lines of one benchmark's section below its title: a failure, the report kept as
    written beside its normalising error, or the baseline, the command, the target and table."""
    if "error" in b:
        return [f"Failed: {b['error']}"]
    bench = BENCHES.get(name)
    when = "" if name in results["ran"] else f", from an earlier run ({b.get('measured')})"
    seconds = b.get("seconds")
    took = f", {seconds:.0f} s" if isinstance(seconds, (int, float)) else ""
    command = b.get("command", bench.script if bench else name)
    note = b.get("baseline_note") or (bench.baseline if bench else "")
    lines = [f"Baseline: {note}. `{command}`{took}{when}."]
    if "smoke_as" in b:  # --smoke: one command for both
        lines += ["", f"The smoke run of `{b['smoke_as']}`, the same command, its report "
                  "normalised here too."]  # fmt: skip
    if "normalise_error" in b:
        lines += ["", f"**Not normalised** ({b['normalise_error']}): the report as the "
                  "benchmark wrote it."]  # fmt: skip
        table = b.get("table")
        if isinstance(table, str) and table.strip():
            lines += ["", table]
        raw = {k: v for k, v in b.items() if k not in ("table", "normalise_error")}
        lines += ["", "```json", json.dumps(raw, indent=1, default=str), "```"]
        return lines
    if bench and bench.target_note:
        lines += ["", f"Target: {bench.target_note}."]
    return [*lines, "", b["table"]]


def write_results(results: dict[str, Any], out_dir: str) -> None:
    """`results.json` and `results.md` of what has run so far (after each benchmark)."""
    path = os.path.join(out_dir, "results.json")
    with open(f"{path}.tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
        f.write("\n")
    os.replace(f"{path}.tmp", path)
    write_markdown(results, os.path.join(out_dir, "results.md"))


def smoke_problems(results: dict[str, Any], names: list[str], out_dir: str) -> list[str]:
    """What a smoke run must have, missing: a normalised report of every benchmark it ran, a
    section for each in results.md."""
    problems = []
    md_path = os.path.join(out_dir, "results.md")
    md = None
    if os.path.exists(md_path):
        with open(md_path) as f:
            md = f.read()
    else:
        problems.append(f"{md_path} was not written")
    for name in names:
        report = results["benchmarks"].get(name)
        if report is None:
            problems.append(f"[{name}] no report")
        elif "error" in report:
            problems.append(f"[{name}] failed: {report['error']}")
        elif "normalise_error" in report:
            problems.append(f"[{name}] report not normalised: {report['normalise_error']}")
        elif md is not None and f"## {report.get('title', name)}" not in md:
            problems.append(f"[{name}] no section in {md_path}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    mode.add_argument(
        "--smoke",
        action="store_true",
        help="every benchmark at its smallest settings, into a temporary folder (CI); fails "
        "unless each produced a normalised report and results.md was written",
    )
    parser.add_argument(
        "--only", help=f"comma-separated benchmarks to run, of: {', '.join(BENCHES)}"
    )
    parser.add_argument(
        "--out",
        help="folder for results.{json,md,png} (default: bench/, or a new temporary folder "
        "with --smoke)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="--smoke: benchmarks run at once (default 2); a full or quick run times its "
        "benchmarks one at a time",
    )
    opts = parser.parse_args(argv)
    run_mode = "smoke" if opts.smoke else "quick" if opts.quick else "full"
    if opts.jobs is not None and opts.jobs < 1:
        parser.error("--jobs must be at least 1")
    if opts.jobs not in (None, 1) and not opts.smoke:
        parser.error("--jobs > 1 is for --smoke only: side by side, the figures would be wrong")
    jobs = opts.jobs or (SMOKE_JOBS if opts.smoke else 1)
    names = list(BENCHES)
    if opts.only:
        names = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHES]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")
    if opts.out:
        out_dir = os.path.abspath(opts.out)
        os.makedirs(out_dir, exist_ok=True)
    elif opts.smoke:
        out_dir = tempfile.mkdtemp(prefix="ray_trainer_bench_smoke_")
    else:
        out_dir = HERE
    results_json = os.path.join(out_dir, "results.json")

    previous: dict[str, Any] = {}
    if opts.only and os.path.exists(results_json):
        with open(results_json) as f:
            previous = json.load(f).get("benchmarks", {})

    load_start = os.getloadavg()[0]
    started, cpu_start = time.perf_counter(), cgroup_cpu_seconds()
    workdir = tempfile.mkdtemp(prefix="ray_trainer_bench_")
    print(f"logs and raw reports in {workdir}; results into {out_dir}", flush=True)
    machine_env = environment()
    fresh: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {}
    # --smoke: a benchmark whose smoke run is another's that runs too gets that one's report
    same = smoke_sharing(names) if opts.smoke else {}
    launched = [n for n in names if n not in same]
    joining = sum(BENCHES[n].shares_ray for n in launched) if opts.smoke else 0
    rays = [SharedRay() for _ in range(min(jobs, joining))]
    for ran, report in run_benchmarks(launched, run_mode, workdir, jobs, rays):
        for name in [ran, *(n for n, source in same.items() if source == ran)]:
            fresh[name] = normalise_or_keep(name, dict(report))
            if name != ran:  # its seconds and CPU-seconds are `ran`'s, counted once there
                fresh[name]["smoke_as"] = ran
                fresh[name].pop("cpu_seconds", None)
        benchmarks = {}
        for n in BENCHES:  # registry order, whatever ran this time
            if n in fresh:
                benchmarks[n] = fresh[n]
            elif n in previous:
                benchmarks[n] = previous[n]
        results = {
            **machine_env,
            "quick": run_mode != "full",
            "mode": run_mode,
            "jobs": jobs,
            "total_seconds": time.perf_counter() - started,
            "load": [load_start, os.getloadavg()[0]],
            "ran": names,
            "benchmarks": benchmarks,
        }
        write_results(results, out_dir)  # so far: a later crash or kill loses nothing
    total = time.perf_counter() - started
    results_md = os.path.join(out_dir, "results.md")
    results_png = os.path.join(out_dir, "results.png")
    plot_error = None
    try:
        sys.path.insert(0, HERE)
        from plot import draw

        draw(results, results_png)
    except Exception as exc:  # the figures are written already; the plot is a view of them
        plot_error = f"{type(exc).__name__}: {exc}"
        print(f"the plot was not drawn: {plot_error}", flush=True)
    print(f"\nwrote {results_md}, {results_json}, {results_png} in {total / 60:.1f} min\n")
    with open(results_md) as f:
        print(f.read())
    goals = goal_rows(results)
    if goals:  # last, where a reader of the console sees it
        print("Targets:")
        for name, what, figure, target, met in goals:
            print(
                f"  {'ok    ' if met == 'met' else 'MISSED'} [{name}] {what}: {figure} ({target})"
            )
    print("Seconds per benchmark: " + ", ".join(
        f"{n} ({fresh[n]['smoke_as']}'s run)" if "smoke_as" in fresh[n] else
        f"{n} {fresh[n].get('seconds', 0):.0f}" for n in names))  # fmt: skip
    cpu_end = cgroup_cpu_seconds()
    if cpu_start is not None and cpu_end is not None:  # the run's cgroup: every process of it
        print(f"CPU-seconds of the whole run: {cpu_end - cpu_start:.0f} in {total:.0f} s of wall")
        per = [(n, fresh[n].get("cpu_seconds")) for n in names]
        print(("CPU-seconds per benchmark (alone, --jobs 1): " if jobs == 1 else
               f"CPU-seconds of the run during each benchmark ({jobs} at a time, so overlapping): ")
              + ", ".join(f"{n} {c:.0f}" for n, c in per if c is not None))  # fmt: skip
    kept = [n for n in names if "normalise_error" in fresh[n]]
    if kept:
        print(f"Kept as written (not normalised; see results.md): {', '.join(kept)}")
    failed = [n for n in names if "error" in fresh[n]]
    if opts.smoke:
        problems = smoke_problems(results, names, out_dir)
        if plot_error:
            problems.append(f"the plot was not drawn: {plot_error}")
        if problems:
            print("SMOKE RUN FAILED:\n  " + "\n  ".join(problems))
            return 1
        print(f"smoke run ok: {len(names)} benchmarks, each normalised, in {total:.0f} s")
        return 0
    if failed:
        print(f"FAILED benchmarks: {', '.join(failed)} (their logs: {workdir})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
