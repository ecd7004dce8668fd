"""On a GPU, one process, no Ray: what the runner's chunked loss costs against the model's own.

GPT-2 124M shape (bench_gpu's FULL), bf16 autocast, fused AdamW, clip 1.0. Variants: the
model's own loss; the chunked loss at its default chunk (sized for the device) and at 256 and
2,048 positions; eager, then (`--compiled`) the whole model compiled. Then the CPU-GPU syncs of
one eager chunked step and its profile (the top kernels by GPU time). With `--runner`, the
profile of three steps of `run_training` itself (eager, one worker, in the Ray worker), taken by
a rank-0 callback at `on_step_begin`, sorted by GPU time and by CPU time: what the runner's step
does beyond the loop above. Without a GPU it runs bench_gpu's TINY shape on the CPU, to check
the script (those figures mean nothing).

Usage: python bench/gpu_probe.py [--compiled] [--runner]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402
from _gpu_shapes import FULL, TINY, TokenDataset, make_model, runner_fields  # noqa: E402

from ray_trainer._worker.chunked_loss import use_chunked_loss  # noqa: E402

GPU = torch.cuda.is_available()
DEV = "cuda" if GPU else "cpu"
SHAPE = FULL if GPU else TINY


def sync():
    if GPU:
        torch.cuda.synchronize()


def run(chunk: int | None, compiled: bool, steps: int = 40, skip: int = 15, prof: bool = False):
    model = make_model(SHAPE).to(DEV)
    if chunk is not None:
        assert use_chunked_loss(model, chunk if chunk > 0 else None) is None
    if compiled:
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
        if GPU:
            torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(0)
        if GPU:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message)[:90] for w in caught if "synchroniz" in str(w.message)]
        print(f"  syncs in one step: {len(syncs)}", *syncs[:4], sep="\n    ")
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


def profile_runner(steps: int = 30, first: int = 20, count: int = 3) -> None:
    """Prints the profile of `count` steps of an eager `run_training` from step `first`."""
    import tempfile

    from _support import init_ray

    from callbacks import TrainerCallback
    from ray_trainer import run_training

    out = tempfile.mkdtemp(prefix="gpu_probe_runner_")

    class StepProfile(TrainerCallback):  # rank 0, in the worker; only on_step_begin (no sync)
        runs_on = "rank0"

        def __init__(self):
            self.prof = None

        def on_step_begin(self, context, **kwargs):
            from torch.profiler import ProfilerActivity, profile

            step = context.global_step
            if step == first:
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
        run_training(**fields, log_every_steps=10, callbacks=[StepProfile()])
    with open(os.path.join(out, "profile.txt")) as f:
        print(f"run_training, steps {first} to {first + count - 1}:", f.read(), sep="\n")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--runner", action="store_true", help="only profile run_training's step")
    opts = parser.parse_args()
    print(torch.cuda.get_device_name(0) if GPU else "CPU", torch.__version__, flush=True)
    if opts.runner:
        return profile_runner()
    for label, chunk in [("model's own loss", None), ("chunked, default", 0),
                         ("chunked 256", 256), ("chunked 2048", 2048)]:  # fmt: skip
        print(f"eager, {label}: {run(chunk, False):.1f} ms/step", flush=True)
    run(0, False, steps=16, skip=3, prof=True)
    if opts.compiled:
        for label, chunk in [("model's own loss", None), ("chunked, default", 0)]:
            print(
                f"compiled, {label}: {run(chunk, True, steps=45, skip=25):.1f} ms/step", flush=True
            )


if __name__ == "__main__":
    main()
