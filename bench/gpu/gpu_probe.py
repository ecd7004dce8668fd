"""On a GPU, one process, no Ray: what the runner's chunked loss costs against the model's own.

GPT-2 124M shape (bench_gpu's FULL), bf16 autocast, fused AdamW, clip 1.0. Variants: the
model's own loss; the chunked loss at its default chunk (sized for the device) and at 256 and
2,048 positions; eager, then (`--compiled`) the whole model compiled, and the chunked loss
with only the body compiled (as `run_training(compile=True)` does). Then the CPU-GPU syncs of
one eager chunked step and its profile (the top kernels by GPU time). With `--runner`, what
`run_training` itself does (one worker, in the Ray worker, eager or with `--compiled` compiled),
taken by a rank-0 callback at `on_step_begin`: the stack of each call that makes the host wait
for the device in one step, then the profile of three steps sorted by GPU time and by CPU time:
what the runner's step does beyond the loop above. Without a GPU it runs bench_gpu's TINY
shape on the CPU, to check the script (those figures mean nothing).

`--compiled-only` times only the three compiled variants (about a minute on an H100).

Usage: python bench/gpu/gpu_probe.py [--compiled | --compiled-only]
                                     [--runner [--compiled] [--fsdp] [--checkpointing]]
(`--runner --compiled --fsdp --checkpointing`: table 2's FSDP row, profiled.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402

sys.path.insert(0, os.path.dirname(_bench_path.BENCH))  # the checkout: ray_trainer uninstalled

import torch  # noqa: E402
from _gpu_shapes import FULL, TINY, TokenDataset, make_model, runner_fields  # noqa: E402

from ray_trainer._worker.model.chunked_loss import chunked_body, use_chunked_loss  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
SHAPE = FULL if GPU else TINY


def sync():
    if GPU:
        torch.cuda.synchronize()


class SyncStacks:
    """The stack of each call that makes the host wait for the device, between `start` and
    `stop` (`torch.cuda.set_sync_debug_mode("warn")`'s warnings, caught); none on the CPU.
    Not a `with` block: the runner's profile starts it in one callback and stops it in the
    next."""

    def __init__(self) -> None:
        self.stacks: list[str] = []
        self.saved = None

    def start(self) -> SyncStacks:
        if GPU:
            self.saved = (warnings.showwarning, warnings.filters[:])
            warnings.simplefilter("always")
            warnings.showwarning = self._show
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _show(self, message, category, *args, **kwargs) -> None:
        self.stacks.append(f"{message}\n" + "".join(traceback.format_stack(limit=9)[:-2]))

    def stop(self) -> list[str]:
        if self.saved is not None:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning, warnings.filters[:] = self.saved
            self.saved = None
        return self.stacks


def run(
    chunk: int | None, compiled: bool | str, steps: int = 40, skip: int = 15, prof: bool = False
):
    """ms a step; `compiled` True compiles the whole model, "body" only its transformer body
    (what ``compile=True`` does with the chunked loss: the chunk loop stays eager)."""
    model = make_model(SHAPE).to(DEV)
    if chunk is not None:
        assert use_chunked_loss(model, chunk if chunk > 0 else None) is None
    if compiled == "body":
        chunked_body(model).compile()
    elif compiled:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=GPU)
    data = TokenDataset(SHAPE, (steps + 1) * SHAPE["batch"])
    n = SHAPE["batch"] * SHAPE["seq"]

    def step(i):
        rows = data.ids[i * SHAPE["batch"] : (i + 1) * SHAPE["batch"]].to(DEV, non_blocking=True)
        with torch.autocast(DEV, dtype=torch.bfloat16):
            extra = {} if chunk is None else {"num_items_in_batch": n}
            out = model(input_ids=rows, labels=rows, **extra)
        loss = out["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(skip):
        step(i)
    sync()
    t0 = time.perf_counter()
    for i in range(skip, steps):
        step(i)
    sync()
    ms = (time.perf_counter() - t0) / (steps - skip) * 1e3
    if prof:
        syncs = SyncStacks().start()
        step(0)
        stacks = syncs.stop()
        print(f"  syncs in one step: {len(stacks)}", *stacks[:4], sep="\n    ")
        from torch.profiler import ProfilerActivity, profile

        with profile(
            activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
        ) as p:
            for i in range(3):
                step(i)
            sync()
        print(
            p.key_averages().table(
                sort_by="cuda_time_total" if GPU else "cpu_time_total",
                row_limit=18,
                max_name_column_width=50,
            )
        )
    if GPU:
        torch.cuda.empty_cache()
    return ms


def profile_runner(
    compiled: bool, extra: dict | None = None, steps: int = 40, first: int = 30, count: int = 3
) -> None:
    """Prints where the host waits for the device in one step of `run_training` (step
    `first` - 1: each synchronizing CUDA call's stack, from `torch.cuda.set_sync_debug_mode`),
    then the profile of `count` steps from step `first` (eager, or with `compiled` the model
    compiled as ``compile=True`` does); `extra`: more `run_training` fields (table 2's
    ``strategy="fsdp"``, ``activation_checkpointing=True``)."""
    import tempfile

    from _support import init_ray

    from callbacks import TrainerCallback
    from ray_trainer import run_training

    out = tempfile.mkdtemp(prefix="gpu_probe_runner_")

    class StepProfile(TrainerCallback):  # rank 0, in the worker; only on_step_begin (no sync)
        runs_on = "rank0"

        def __init__(self):
            self.prof = None
            self.syncs = SyncStacks()

        def on_step_begin(self, context, **kwargs):
            from torch.profiler import ProfilerActivity, profile

            step = context.global_step
            if step == first - 1:  # one step of sync stacks
                self.syncs.start()
            elif step == first:
                stacks = self.syncs.stop()
                with open(os.path.join(out, "syncs.txt"), "w") as f:
                    f.write(f"{len(stacks)} synchronizing calls in step {first - 1}:\n")
                    f.write("\n".join(stacks))
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if GPU else [])
                self.prof = profile(activities=acts)
                self.prof.__enter__()
            elif step == first + count and self.prof is not None:
                sync()
                self.prof.__exit__(None, None, None)
                averages = self.prof.key_averages()
                with open(os.path.join(out, "profile.txt"), "w") as f:
                    for key in ("cuda_time_total", "self_cpu_time_total") if GPU else ("self_cpu_time_total",):  # fmt: skip
                        f.write(averages.table(sort_by=key, row_limit=25, max_name_column_width=60))
                self.prof = None

    init_ray(num_cpus=os.cpu_count() or 2)
    with tempfile.TemporaryDirectory(prefix="gpu_probe_runs_") as storage:
        fields = runner_fields(SHAPE, steps, not GPU, storage)
        run_training(**{**fields, **(extra or {})}, compile=compiled, log_every_steps=10,
                     callbacks=[StepProfile()])  # fmt: skip
    label = ("compiled" if compiled else "eager") + "".join(
        f", {k}={v}" for k, v in (extra or {}).items()
    )
    for name in ("syncs.txt", "profile.txt"):
        if os.path.exists(os.path.join(out, name)):
            with open(os.path.join(out, name)) as f:
                print(f"run_training ({label}), {name}:", f.read(), sep="\n", flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--compiled-only", action="store_true", help="only the compiled variants")
    parser.add_argument("--runner", action="store_true", help="only profile run_training's step")
    parser.add_argument("--fsdp", action="store_true", help="--runner: strategy='fsdp' (table 2)")
    parser.add_argument(
        "--checkpointing", action="store_true", help="--runner: activation_checkpointing=True"
    )
    opts = parser.parse_args()
    print(torch.cuda.get_device_name(0) if GPU else "CPU", torch.__version__, flush=True)
    if opts.runner:
        extra = {"strategy": "fsdp"} if opts.fsdp else {}
        if opts.checkpointing:
            extra["activation_checkpointing"] = True
        return profile_runner(opts.compiled, extra)
    if not opts.compiled_only:
        for label, chunk in [("model's own loss", None), ("chunked, default", 0),
                             ("chunked 256", 256), ("chunked 2048", 2048)]:  # fmt: skip
            print(f"eager, {label}: {run(chunk, False):.1f} ms/step", flush=True)
        run(0, False, steps=16, skip=3, prof=True)
    if opts.compiled or opts.compiled_only:
        for label, chunk, how in [("model's own loss", None, True), ("chunked, default", 0, True),
                                  ("chunked, body only (as run_training)", 0, "body")]:  # fmt: skip
            ms = run(chunk, how, steps=45, skip=25)
            print(f"compiled, {label}: {ms:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main()
