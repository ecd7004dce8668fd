"""What FSDP2 costs the host each step, against one-rank DDP: table 2's FSDP row on the CPU.

Table 2 (docs/gpu.md) found FSDP2's compiled step 2.79x DDP's on one H100 (99.8 against 35.8
ms, GPT-2 124M shape, activation checkpointing). A GPU step that short leaves the host tens of
milliseconds: whatever FSDP2 does on the host per block and per parameter (its pre- and
post-forward and backward hooks, each parameter's all-gather input and DTensor view, the
reduce-scatter) can make the step host-bound. This script measures that host work on the CPU,
where it is the whole step: a tiny GPT-2 (``--layers`` blocks of width ``--width``, rows of 24
tokens, batch 4) so small that its kernels take a fraction of the step, trained by the loop's
own ``train_step`` on what the worker's assembly builds (``build_workload``, ``prepare``, the
step loader: the model, AdamW, DDP or ``fully_shard`` per block and root), in one process, a
1-rank gloo group, one thread, no Ray.

Configurations, each ``--rounds`` times in turn (a new model each): DDP (one rank: the model
unwrapped, as a one-GPU run's step; the baseline of the rows without activation checkpointing),
FSDP2, FSDP2 without resharding after the forward, and DDP (the baseline of the next row) and FSDP2
with activation checkpointing. A configuration's figure is the median step over its rounds' steps
after the first third; the time it takes over its DDP row is FSDP2's host work, given per block
too. ``--compile aot_eager`` compiles as ``compile=True`` does (the model under DDP, each block
under FSDP) with dynamo and AOTAutograd's graphs but eager kernels: the host's work of a compiled
step without inductor's code generation. ``--optimizer fused`` gives AdamW ``fused=True`` on the
CPU too, as the runner does on CUDA (the runner's CPU default is torch's, which for FSDP's DTensor
parameters is the per-parameter loop, each op through DTensor's dispatch). ``--profile NAME``
prints cProfile's top entries for one configuration's second half.

Usage: python bench/gpu/fsdp_host.py [--layers 12] [--width 32] [--steps 40] [--rounds 2]
    [--compile none|aot_eager] [--optimizer default|fused] [--profile NAME] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402

ROOT = os.path.dirname(_bench_path.BENCH)
sys.path.insert(0, ROOT)  # the checkout: ray_trainer uninstalled
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))  # step_state: the worker's assembly

import numpy as np  # noqa: E402
from _support import emit, free_port, machine, table  # noqa: E402

ROW = 24  # tokens a row (every row the same length: one shape, no recompile)
CONFIGS = {
    "ddp": ({}, "DDP, one rank (baseline)"),
    "fsdp": ({"strategy": "fsdp"}, "FSDP2, each block and the root"),
    "fsdp_keep": (
        {"strategy": "fsdp", "fsdp_reshard_after_forward": False},
        "FSDP2, no reshard after forward",
    ),
    "ddp_ac": ({"activation_checkpointing": True}, "DDP + activation checkpointing"),
    "fsdp_ac": (
        {"strategy": "fsdp", "activation_checkpointing": True},
        "FSDP2 + activation checkpointing",
    ),
}


def write_inputs(root: str, layers: int, width: int) -> tuple[str, str]:
    """A tiny GPT-2 of `layers` blocks and a tokenized cache of 256 rows: (model, cache name)."""
    from step_state import write_token_cache

    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    model = make_tiny_causal_lm(
        os.path.join(root, "model"), n_layer=layers, n_embd=width, n_positions=64
    )
    rng = np.random.default_rng(0)
    samples = []
    for _ in range(256):
        ids = rng.integers(3, 16, ROW).tolist()
        samples.append((ids, [-100] * 4 + ids[4:]))
    return str(model), write_token_cache(root, "fsdp_host", samples)


def steps_of(
    fields: dict[str, Any], model: str, cache: str, steps: int, opts: argparse.Namespace,
    profile: bool,
) -> tuple[list[float], str]:  # fmt: skip
    """One configuration: the seconds of each of `steps` steps, and its profile (or "")."""
    import torch
    import torch._dynamo
    from step_state import step_state

    import ray_trainer._worker.assemble as assemble
    from ray_trainer import TrainingArgs
    from ray_trainer._worker.step.loop import train_step

    torch._dynamo.reset()
    args = TrainingArgs(
        model=model, data="unused.jsonl", compile=opts.compile != "none", num_workers=1,
        batch_size=4, max_length=ROW + 4, max_grad_norm=1.0, warmup_steps=0,
        chunked_loss=False, **fields,
    )  # fmt: skip
    options = assemble.optimizer_options
    if opts.optimizer == "fused":  # the runner's groups and learning rate, AdamW fused
        assemble.optimizer_options = lambda device: {"fused": True}
    compile_module = torch.nn.Module.compile
    if opts.compile != "none":
        torch.nn.Module.compile = lambda m, *a, **k: compile_module(
            m, *a, **{**k, "backend": opts.compile}
        )
    try:
        state = step_state(args, cache, 0, 1, steps)
        batches = state.loader.steps(0)
        times, profiler = [], None
        for i in range(steps):
            micro = next(batches)
            if profile and i == steps // 2:
                profiler = cProfile.Profile()
                profiler.enable()
            began = time.perf_counter()
            train_step(state, micro).result()
            times.append(time.perf_counter() - began)
    finally:
        torch.nn.Module.compile = compile_module
        assemble.optimizer_options = options
    text = ""
    if profiler is not None:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(opts.top)
        text = out.getvalue()
    return times, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument(
        "--steps", type=int, default=40, help="steps a round (first third left out)"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", choices=["none", "aot_eager"], default="none")
    parser.add_argument("--optimizer", choices=["default", "fused"], default="default")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--profile", default="", help="a configuration to cProfile")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    names = opts.configs.split(",")
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    root = tempfile.mkdtemp(prefix="fsdp_host_")
    model, cache = write_inputs(root, opts.layers, opts.width)
    samples: dict[str, list[float]] = {n: [] for n in names}
    profiles = {}
    try:
        for r in range(opts.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # the order rotated
                profile = name == opts.profile and r == 0
                times, text = steps_of(CONFIGS[name][0], model, cache, opts.steps, opts, profile)
                samples[name] += times[opts.steps // 3 :]
                if text:
                    profiles[name] = text
    finally:
        dist.destroy_process_group()
        shutil.rmtree(root, ignore_errors=True)
    medians = {n: statistics.median(samples[n]) for n in names}
    rows = []
    for name in names:
        twin = "ddp_ac" if CONFIGS[name][0].get("activation_checkpointing") else "ddp"
        step, base = medians[name], medians.get(twin)
        rows.append({
            "configuration": CONFIGS[name][1],
            "step (ms)": f"{1e3 * step:.2f}",
            "vs DDP (the same checkpointing)": "-" if base is None else f"{step / base:.3f}",
            "host time over DDP (ms)": "-" if base is None else f"{1e3 * (step - base):+.2f}",
            "per block (ms)": "-" if base is None else f"{1e3 * (step - base) / opts.layers:+.3f}",
        })  # fmt: skip
    report = {
        "benchmark": "fsdp_host",
        "machine": machine(),
        "settings": {k: v for k, v in vars(opts).items() if k != "json"},
        "step_ms": {n: 1e3 * m for n, m in medians.items()},
        "table": table(rows),
        "profiles": profiles,
    }
    print(
        f"{opts.layers} blocks of width {opts.width}, rows of {ROW} tokens, batch 4; compile "
        f"{opts.compile}, AdamW {opts.optimizer}; {opts.rounds} round(s) of {opts.steps} steps, "
        "medians over each round's last two thirds; one gloo rank, one thread"
    )
    for name, text in profiles.items():
        print(f"\n{name}, cProfile of one round's second half:\n{text}")
    emit(report, opts.json)


if __name__ == "__main__":
    main()
