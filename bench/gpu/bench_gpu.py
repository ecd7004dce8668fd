"""On a GPU: the runner against a bare accelerate loop and HF Trainer, eager and compiled.

One GPU, one worker, a GPT-2-shaped model of 124M parameters built from a `transformers`
config (random init, nothing downloaded), bf16 mixed precision, sequence 512, batch 16, random
token ids generated on the spot (no padding). Configurations, each timed over steps `--skip` to
`--steps` (the CUDA queue is drained at both ends of the window: the figure is the GPU's time):

* bare accelerate loop, eager (AdamW unfused) and compiled + fused AdamW (the baseline);
* HF Trainer, eager and `torch_compile=True` (both with the fused AdamW, `adamw_torch_fused`);
* `run_training`, eager and `compile=True`, each with no callbacks and with every built-in
  callback plus a slow (0.5 s/event) actor-side callback; its figure is from the tokens/s its
  own logs report for the windows after step `--skip` (it logs every gcd(steps, skip) steps);
* `run_training` with `compile=True` on a Llama of the same sizes (liger-kernel patches Llama,
  not GPT-2), with the chunked loss and with `liger_kernel=True` (liger's RMSNorm, RoPE, SwiGLU
  and fused linear cross-entropy); their ratio is liger's against the chunked loss, and their
  ratio to the GPT-2 baseline is not given (another model). Without a GPU, triton or
  liger-kernel the liger row says why and is skipped.

For each: step ms, tokens/s, MFU (6N + attention FLOPs per token over the GPU's bf16 peak, from
the runner's table) and the ratio of step time to the compiled bare loop. The targets the issue
names are printed against the figures. Without a GPU it prints that it skipped and writes a
report saying so; `--smoke-cpu` runs every configuration on the CPU with a tiny model instead,
to check the script itself (its figures mean nothing).

Tables 2 to 8 (`--table 2,3,5`; `_gpu_tables.py`): FSDP against DDP, packed against padded,
LoRA against a full fine-tune, saves and loads, long sequences, DPO, evaluations. `--table all`
runs every one; a table whose feature has not landed says so and is skipped. With `--json`, the
report is rewritten after each table, so a run cut short keeps what it finished.

`--configs bare_compiled,runner_compiled,...` runs only those configurations of table 1, in
that order (the baseline always, first if it is not named), when a lease is too short for all.

Usage: python bench/gpu/bench_gpu.py [--table 1] [--steps 300] [--skip 50] [--configs K,...]
                                 [--json OUT] [--smoke-cpu]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _gpu_shapes import (  # noqa: E402
    FULL,
    LLAMA,
    TINY,
    TINY_LLAMA,
    TokenDataset,
    make_model,
    runner_fields,
)
from _support import SlowActorCallback, emit, init_ray, machine, table  # noqa: E402


def _synced(device) -> float:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def bare_loop(shape: dict, steps: int, skip: int, compiled: bool, cpu: bool) -> float:
    """Seconds per step of a plain accelerate loop (forward, backward, clip, AdamW, zero)."""
    import torch
    from accelerate import Accelerator

    acc = Accelerator(cpu=cpu, mixed_precision="no" if cpu else "bf16")
    model = make_model(shape)
    if compiled:
        model.compile()
    fused = {"fused": True} if compiled and not cpu else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, **fused)
    model, optimizer = acc.prepare(model, optimizer)
    data = TokenDataset(shape, (steps + 1) * shape["batch"])
    started = 0.0
    for step in range(steps):
        if step == skip:
            started = _synced(acc.device)
        rows = data.ids[step * shape["batch"] : (step + 1) * shape["batch"]].to(acc.device)
        with acc.autocast():
            loss = model(input_ids=rows, labels=rows).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return (_synced(acc.device) - started) / (steps - skip)


def hf_trainer(shape: dict, steps: int, skip: int, compiled: bool, cpu: bool) -> float:
    """Seconds per step of transformers.Trainer over the same window."""
    import transformers

    marks: dict[int, float] = {}

    class Window(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step in (skip, steps - 1):
                import torch

                marks[state.global_step] = _synced(torch.device("cpu" if cpu else "cuda"))

    with tempfile.TemporaryDirectory(prefix="bench_gpu_hf_") as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=shape["batch"],
            max_steps=steps,
            learning_rate=3e-4,
            bf16=not cpu,
            use_cpu=cpu,
            torch_compile=compiled,
            optim="adamw_torch_fused" if not cpu else "adamw_torch",
            logging_steps=50,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            disable_tqdm=True,
        )
        data = TokenDataset(shape, steps * shape["batch"])
        trainer = transformers.Trainer(
            model=make_model(shape), args=args, train_dataset=data, callbacks=[Window()]
        )
        trainer.train()
    return (marks[steps - 1] - marks[skip]) / (steps - 1 - skip)


class Skipped(Exception):
    """A configuration that cannot run on this machine; the message says why."""


def runner(shape: dict, steps: int, skip: int, compiled: bool, callbacks: bool, cpu: bool,
           liger: bool = False) -> float:  # fmt: skip
    """Seconds per step of `run_training`, from its own logs' window throughput."""
    from callbacks import (
        DivergenceDetector,
        EarlyStopping,
        JsonlLogger,
        ProgressBar,
        RayMetrics,
        TrainerCallback,
    )
    from ray_trainer import run_training

    folder = tempfile.mkdtemp(prefix="bench_gpu_logs_")
    # Windows that start at `skip` and end at `steps`: a window over the whole run would count
    # the first steps (and, compiled, the compilation); 120 steps with a 50-step skip did so.
    every = math.gcd(steps, skip)

    class Logs(TrainerCallback):  # in rank 0, at each log: never queued behind the slow callback
        runs_on = "rank0"

        def on_log(self, context, **kwargs):
            with open(os.path.join(folder, f"{context.global_step}.json"), "w") as f:
                json.dump(dict(context.batch_metrics), f)

    if liger:
        from ray_trainer._model.liger_probe import missing_liger_kernel

        problem = missing_liger_kernel(use_gpu=not cpu)
        if problem:
            raise Skipped(problem)
    extra = []
    if callbacks:
        extra = [ProgressBar(), JsonlLogger(), RayMetrics(), EarlyStopping("val_loss")]
        extra += [DivergenceDetector(), SlowActorCallback(0.5)]
    with tempfile.TemporaryDirectory(prefix="bench_gpu_runs_") as storage:
        run_training(
            **runner_fields(shape, steps, cpu, storage),
            compile=compiled,
            liger_kernel=liger,
            log_every_steps=every,
            callback_timeout_s=5,
            callbacks=[Logs(), *extra],
        )
    seconds = []  # of each logged window after step `skip`: the timed steps only
    for end in range(skip + every, steps + 1, every):
        with open(os.path.join(folder, f"{end}.json")) as f:
            seconds.append(shape["batch"] * shape["seq"] / json.load(f)["tokens_per_s"])
    return sum(seconds) / len(seconds)


def mfu_of(shape: dict, seconds: float, cpu: bool) -> float | None:
    import torch

    from ray_trainer._worker.step.throughput import ModelShape, flops_per_token, mfu, peak_flops

    params = sum(p.numel() for p in make_model(shape).parameters())
    per_token = flops_per_token(ModelShape(params, shape["n_layer"], shape["n_embd"]), shape["seq"])
    device = torch.device("cpu" if cpu else "cuda")
    return mfu(shape["batch"] * shape["seq"] / seconds, per_token, peak_flops(device), 1)


CONFIGS = {
    "bare_eager": ("bare accelerate loop, eager", lambda o, c: bare_loop(*o, False, c)),
    "bare_compiled": (
        "bare loop, compile + fused AdamW (baseline)",
        lambda o, c: bare_loop(*o, True, c),
    ),
    "hf_eager": ("HF Trainer, eager", lambda o, c: hf_trainer(*o, False, c)),
    "hf_compiled": ("HF Trainer, torch_compile=True", lambda o, c: hf_trainer(*o, True, c)),
    "runner_eager": ("run_training, eager", lambda o, c: runner(*o, False, False, c)),
    "runner_eager_cb": (
        "run_training, eager, built-ins + slow actor callback",
        lambda o, c: runner(*o, False, True, c),
    ),
    "runner_compiled": ("run_training, compile=True", lambda o, c: runner(*o, True, False, c)),
    "runner_compiled_cb": (
        "run_training, compile=True, built-ins + slow actor callback",
        lambda o, c: runner(*o, True, True, c),
    ),
    "runner_compiled_llama": (
        "run_training, compile=True, Llama shape, chunked loss",
        lambda o, c: runner(_llama(o), *o[1:], True, False, c),
    ),
    "runner_compiled_liger": (
        "run_training, compile=True, Llama shape, liger_kernel=True",
        lambda o, c: runner(_llama(o), *o[1:], True, False, c, liger=True),
    ),
}
#: Configurations on the Llama shape: no ratio to the (GPT-2) baseline.
LLAMA_CONFIGS = frozenset({"runner_compiled_llama", "runner_compiled_liger"})


def _llama(opts: tuple) -> dict:
    """The Llama of the same sizes as the run's GPT-2 shape (full or tiny)."""
    return TINY_LLAMA if opts[0] is TINY else LLAMA


def targets(s: dict[str, float]) -> list[tuple[str, float, float]]:
    """(what, ratio, target) for each target the issue names whose two configurations ran."""
    # (what, numerator, denominator, limit): a tokens/s ratio is a step-time ratio upside down
    named = [
        ("run_training(compile=True) step / compiled bare loop", "runner_compiled", "bare_compiled", 1.03),
        ("run_training(compile=True) tokens/s / HF Trainer torch_compile=True (at least)", "hf_compiled", "runner_compiled", 1.05),
        ("with built-ins + slow actor callback / without (compiled)", "runner_compiled_cb", "runner_compiled", 1.02),
        ("eager run_training / eager bare loop", "runner_eager", "bare_eager", 1.02),
        # liger-kernel is kept (made the default) only where it wins: below 1.
        ("liger_kernel=True / chunked loss (compiled run_training, Llama shape)", "runner_compiled_liger", "runner_compiled_llama", 1.0),
    ]  # fmt: skip
    return [(what, s[a] / s[b], limit) for what, a, b, limit in named if a in s and b in s]


def _release_device_memory() -> None:
    """What this process cached on the GPU goes back, for the next configuration's process."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def table_1(opts: argparse.Namespace, cpu: bool) -> dict:
    """The speed table: every configuration of CONFIGS against the compiled bare loop."""
    shape = TINY if cpu else FULL
    steps, skip = (20, 10) if cpu else (opts.steps, opts.skip)
    wanted = list(CONFIGS) if opts.configs is None else opts.configs.split(",")
    unknown = sorted(set(wanted) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    if "bare_compiled" not in wanted and not opts.no_baseline:
        wanted.insert(0, "bare_compiled")  # the baseline every ratio is taken against
    seconds, skipped = {}, {}
    for key in wanted:
        label, run = CONFIGS[key]
        try:
            seconds[key] = run((shape, steps, skip), cpu)
        except Skipped as e:
            skipped[key] = str(e)
            print(f"{label}: skipped: {e}", flush=True)
            continue
        _release_device_memory()
        print(f"{label}: {seconds[key] * 1e3:.1f} ms/step", flush=True)
    base = seconds.get("bare_compiled")
    rows = []
    for key in wanted:
        label = CONFIGS[key][0]
        if key in skipped:
            rows.append({"configuration": label, "step (ms)": f"skipped: {skipped[key]}",
                         "tokens/s": "-", "MFU": "-", "vs compiled bare loop": "-"})  # fmt: skip
            continue
        row_shape = _llama((shape,)) if key in LLAMA_CONFIGS else shape
        tokens = shape["batch"] * shape["seq"] / seconds[key]
        value = mfu_of(row_shape, seconds[key], cpu)
        rows.append(
            {
                "configuration": label,
                "step (ms)": f"{seconds[key] * 1e3:.1f}",
                "tokens/s": f"{tokens:,.0f}",
                "MFU": "-" if value is None else f"{value:.1%}",
                "vs compiled bare loop": "-"
                if key in LLAMA_CONFIGS or base is None
                else f"{seconds[key] / base:.3f}",
            }
        )
    checks = [
        {"target": what, "ratio": f"{ratio:.3f}", "limit": f"{limit}"}
        for what, ratio, limit in targets(seconds)
    ]
    return {
        "seconds": seconds,
        "skipped_configs": skipped,
        "baseline": CONFIGS["bare_compiled"][0],
        "table": table(rows) + ("\n\nTargets:\n\n" + table(checks) if checks else ""),
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", default="1", help="which tables: 1,2,3 or all")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--skip", type=int, default=50)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--configs", default=None, help="table 1's configurations, in this order (default: all)"
    )
    parser.add_argument(
        "--no-baseline",
        action="store_true",
        help="table 1 without the compiled bare loop (for a pair of --configs compared "
        "with each other, e.g. runner_compiled,runner_compiled_cb)",
    )
    parser.add_argument(
        "--table2-model",
        choices=["gpt2", "llama1b"],
        default="gpt2",
        help="table 2's model: table 1's GPT-2 124M shape, or table 4's 1.1B Llama shape",
    )
    parser.add_argument("--smoke-cpu", action="store_true", help="tiny shapes on the CPU")
    opts = parser.parse_args()
    import torch
    from _gpu_tables import TABLES

    cpu = opts.smoke_cpu
    if not cpu and not torch.cuda.is_available():
        report = {"machine": machine(), "skipped": "no GPU", "table": "skipped: no GPU found"}
        return emit(report, opts.json)
    wanted = [1, *TABLES] if opts.table == "all" else [int(t) for t in opts.table.split(",")]
    device = "CPU (smoke run)" if cpu else torch.cuda.get_device_name(0)
    report = {"machine": f"{machine()}, {device}", "device": device, "date": time.strftime("%Y-%m-%d"),
              "tables": {}}  # fmt: skip
    init_ray(num_cpus=os.cpu_count() or 2)  # one Ray session for every run_training
    for number in wanted:
        started = time.perf_counter()
        try:
            if number == 1:
                result = table_1(opts, cpu)
            elif number == 2:
                result = TABLES[2](cpu, opts.table2_model)
            else:
                result = TABLES[number](cpu)
        except Exception as e:  # the other tables still run; the report says what failed
            import traceback

            traceback.print_exc()
            result = {"skipped": f"failed: {type(e).__name__}: {e}"}
        result["seconds_taken"] = time.perf_counter() - started
        report["tables"][number] = result
        print(f"\n## Table {number} ({result['seconds_taken']:.0f} s)\n", flush=True)
        print(result.get("table") or f"skipped: {result['skipped']}", flush=True)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(report, f, indent=1)
    report["table"] = "\n\n".join(
        f"## Table {n}\n\n" + (r.get("table") or f"skipped: {r['skipped']}")
        for n, r in report["tables"].items()
    )
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
