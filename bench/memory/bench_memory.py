"""Per-rank memory of the training state, and checkpoint cost: FSDP against DDP, in one run.

No Ray Train here: the figures are the tensors each rank holds, so each configuration is N real
processes (torch.multiprocessing spawn) in a gloo process group. Configurations run one after
the other (2 workers then 4; DDP, FSDP, then FSDP, DDP again: `--rounds` process groups per
configuration, so that the machine's drift hits both alike). Every rank does what a runner
worker does at setup and at its first step: seeds, builds a GPT-2-shaped model from a
`transformers.GPT2Config` made here (nothing downloaded; ~96M parameters with the defaults: 8
layers, width 768, 12 heads, vocabulary 50257, 1024 positions; 12 layers would be GPT-2 small's
124M), spreads it with the runner's own `ray_trainer._worker.model.parallel.prepare` (DDP:
accelerate's DDP, as the runner; FSDP: torch's FSDP2 `fully_shard` on each GPT2Block, then the
root, on a 1-D mesh), builds the runner's AdamW on it and takes one real step (forward,
backward, clip, AdamW step). Then:

* **state per rank**: the bytes of parameters, gradients and optimizer state this rank holds
  after the step: for FSDP each DTensor's local shard (`to_local()`), for DDP whole tensors.
  The largest rank counts (FSDP's last shard of an uneven dimension is the smaller). Target:
  FSDP / DDP <= 1/N * 1.1. Not counted: DDP's gradient buckets (a second copy of the gradients,
  so DDP's real need is larger) and FSDP's per-block all-gather buffers (freed after each block);
* **checkpoint**: saved as the runner saves (DDP: rank 0 `torch.save`s the model's and the
  optimizer's state dicts; FSDP: every rank writes its shards of both with
  torch.distributed.checkpoint into its own folder, rank 0 also the `.metadata`). Time: the
  wall time of the save on every rank, the max over ranks; the median (and range) of the
  `--saves` saves of every process group; the upload Ray Train does afterwards is not included.
  Size: the bytes of all files of all ranks;
* **peak RSS** of each process, its high-water mark after each phase (the model built whole, as
  every runner worker builds it before sharding; prepared; stepped; saved), and on GPUs peak
  `torch.cuda.max_memory_allocated` per rank (skipped without a GPU for every rank: said so).

* **the load phase** (``--phases load``; `_memory_load.py`): each worker's peak anonymous
  memory while it loads a pretrained 254M-parameter Llama saved with ``save_pretrained``, on
  the meta device (the runner) against ``from_pretrained`` whole in every worker, FSDP on each
  worker count and DDP on 2; and the time to the first step.

* **LoRA** (``--phases lora``; `_memory_lora.py`): LoRA r=16 on every linear layer against a
  full fine-tune of the same model, DDP and FSDP on 2 workers: per-rank state, checkpoint size
  and save time, step time.

* **QLoRA** (``--phases qlora``; `_memory_load.py`, issue 52): the same Llama loaded as a
  QLoRA worker loads it (meta device, each weight quantized to NF4 as it is read), on 1 worker
  and under FSDP on each worker count: peak added memory against the bf16 model's share, and
  the resident bytes of the frozen base. Run it alone (``--phases qlora``).

* **the chunked loss** (``--phases loss``; `_memory_loss.py`): one long sequence's peak
  memory with the chunked loss against the model's own full-logits loss, a Llama-shaped model
  with a 128k vocabulary, 1k to 8k tokens; and the share of chat positions that need logits.

Usage: python bench/memory/bench_memory.py [--quick] [--workers 2,4] [--n-layer 8] [--saves 3]
       [--rounds 2] [--phases state,load,lora,loss] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _memory_counting import state_bytes  # noqa: E402
from _support import emit, machine, table  # noqa: E402

MiB = 2**20
SLACK = 0.10  # FSDP's state per rank may exceed 1/N of DDP's by this fraction
PHASES = ("built", "prepared", "stepped", "saved")  # when each rank reads its peak RSS
QUICK_MODEL = {
    "n_layer": 2, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256,
    "bos_token_id": 0, "eos_token_id": 0,
}  # fmt: skip
FULL_MODEL = {"n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024}


# ---- the figures (pure: unit-tested in tests/unit/test_bench_memory.py) -----------------------
# A rank's bytes are counted by _memory_counting.py, which the LoRA phase shares.


def target_ratio(world: int, slack: float = SLACK) -> float:
    """The largest FSDP / DDP ratio of per-rank state that meets the target: 1/N + 10%."""
    return (1.0 + slack) / world


def summarise(runs: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One configuration's figures from its runs (each a list of its ranks' reports): the
    largest rank's state (the same in every run), the save time (per save the slowest rank,
    then the median and the range over the saves of all runs), the bytes of all files, and the
    largest peak RSS and CUDA peak."""
    ranks = runs[0]
    largest = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    per_save = [
        max(times) for run in runs for times in zip(*(r["save_s"] for r in run), strict=True)
    ]
    every = [r for run in runs for r in run]
    cuda = [r["cuda_peak"] for r in every if r["cuda_peak"] is not None]
    return {
        "params": largest["params"],
        "grads": largest["grads"],
        "optimizer": largest["optimizer"],
        "state": largest["params"] + largest["grads"] + largest["optimizer"],
        "numel": largest["numel"],
        "save_s": statistics.median(per_save),
        "save_range": (min(per_save), max(per_save)),
        "disk_bytes": sum(r["disk_bytes"] for r in ranks),
        "files": sum(r["files"] for r in ranks),
        "peak_rss": {phase: max(r["peak_rss"][phase] for r in every) for phase in PHASES},
        "cuda_peak": max(cuda) if cuda else None,
    }


def compare(ddp: dict[str, Any], fsdp: dict[str, Any], world: int) -> dict[str, Any]:
    """FSDP's figures as ratios to DDP's, measured in the same run, and the target."""
    ratio = fsdp["state"] / ddp["state"]
    return {
        "state": ratio,
        "save_s": fsdp["save_s"] / ddp["save_s"],
        "disk_bytes": fsdp["disk_bytes"] / ddp["disk_bytes"],
        "target": target_ratio(world),
        "met": ratio <= target_ratio(world),
    }


# ---- one rank (runs in a spawned process) -----------------------------------------------------


def rank_main(rank: int, world: int, strategy: str, opts: dict[str, Any], out: str) -> None:
    """One rank of one configuration; writes its figures to `<out>/rank<r>.json`. Runs in a
    spawned process, inside a gloo process group with the other ranks of its configuration."""
    import torch
    import torch.distributed as dist

    gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world
    if gpu:
        torch.cuda.set_device(rank)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
    try:
        if opts.get("lora_phase"):  # LoRA against full (_memory_lora.py)
            from _memory_lora import lora_rank

            report = lora_rank(rank, world, strategy, opts)
        elif "how" in opts:  # the load phase (_memory_load.py)
            from _memory_load import load_and_step

            report = load_and_step(rank, world, strategy, opts)
        else:
            report = _step_and_save(rank, world, strategy, opts, gpu)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def _step_and_save(
    rank: int, world: int, strategy: str, opts: dict[str, Any], gpu: bool
) -> dict[str, Any]:
    """Build, prepare and step the model as the runner does; count; save `opts["saves"]`
    times. A collective: every rank of the configuration calls it."""
    import torch
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.assemble import _optimizer
    from ray_trainer._worker.model.parallel import prepare

    args = TrainingArgs(strategy=strategy, num_workers=world, use_gpu=gpu, mixed_precision="no")
    accelerator = Accelerator(cpu=not gpu, mixed_precision="no")
    set_seed(args.seed)  # as the runner: the same initial weights on every rank
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**opts["model"]))
    peak_rss = {"built": _peak_rss()}  # every rank holds the whole model here, as in the runner
    parallel = prepare(
        model, args, accelerator, lambda m: _optimizer(m, args, accelerator.device), "no"
    )
    del model  # only the prepared model holds on to the weights now
    peak_rss["prepared"] = _peak_rss()
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(
        opts["model"]["vocab_size"], (opts["batch"], opts["seq"]), generator=generator
    )
    ids = ids.to(accelerator.device)
    loss = parallel.model(input_ids=ids, labels=ids).loss
    loss.backward()
    parallel.scale_and_clip(torch.tensor(1.0), args.max_grad_norm)  # a collective under FSDP
    parallel.optimizer.step()  # AdamW's state exists from here on
    counted = state_bytes(parallel.model, parallel.optimizer)
    peak_rss["stepped"] = _peak_rss()
    cuda_peak = torch.cuda.max_memory_allocated() if gpu else None
    save_s, disk_bytes, files = [], 0, 0
    for _ in range(opts["saves"]):
        seconds, disk_bytes, files = _timed_save(parallel, rank)
        save_s.append(seconds)
    peak_rss["saved"] = _peak_rss()
    return {
        "rank": rank,
        **counted,
        "numel": sum(p.numel() for p in parallel.model.parameters()),
        "save_s": save_s,
        "disk_bytes": disk_bytes,
        "files": files,
        "peak_rss": peak_rss,
        "cuda_peak": cuda_peak,
        "loss": float(loss.detach()),
    }


def _peak_rss() -> int:
    """This process's resident-memory high-water mark so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _timed_save(parallel: Any, rank: int) -> tuple[float, int, int]:
    """One checkpoint of model and optimizer, as the runner writes it, into this rank's own
    temporary folder: (seconds on this rank, bytes of its files, number of files)."""
    import torch.distributed as dist

    from ray_trainer._worker.checkpoints.saving import sharded_state, write_state
    from ray_trainer._worker.model.adaptation import WholeModel

    folder = tempfile.mkdtemp(prefix=f"bench_memory_rank{rank}_")
    try:
        dist.barrier()  # every rank starts the save together
        started = time.perf_counter()
        # As saving.save: every rank its shards (a collective), or rank 0 the whole model.
        state = None
        if parallel.sharded:
            state = sharded_state(parallel.model, parallel.optimizer, WholeModel())
        elif rank == 0:
            state = {
                "model": parallel.module().state_dict(),
                "optim": parallel.optimizer.state_dict(),
            }
        write_state(folder, state, rank, parallel.sharded)
        seconds = time.perf_counter() - started
        sizes = [
            os.path.getsize(os.path.join(root, name))
            for root, _, names in os.walk(folder)
            for name in names
        ]
        dist.barrier()  # no rank deletes before every rank has written
        return seconds, sum(sizes), len(sizes)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---- the driver -------------------------------------------------------------------------------


def run_configuration(strategy: str, world: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """Spawn `world` ranks of one configuration, wait for them, return their reports."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(max(1, (os.cpu_count() or 1) // world))  # the ranks share this machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=threads)
    out = tempfile.mkdtemp(prefix="bench_memory_")
    try:
        started = time.perf_counter()
        mp.spawn(rank_main, args=(world, strategy, opts, out), nprocs=world, join=True)
        print(f"{strategy} x{world}: {time.perf_counter() - started:.0f} s", flush=True)
        return [_read(os.path.join(out, f"rank{r}.json")) for r in range(world)]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _read(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f}"


def build_report(results: dict[tuple[str, int], dict[str, Any]], opts: dict[str, Any]) -> dict:
    """Tables, ratios and targets from every configuration's summary."""
    state_rows, save_rows, rss_rows, ratios, targets, verdicts = [], [], [], {}, {}, {}
    for world in sorted({w for _, w in results}):
        ddp, fsdp = results[("ddp", world)], results[("fsdp", world)]
        vs = compare(ddp, fsdp, world)
        for name, s in (("DDP", ddp), ("FSDP", fsdp)):
            label = f"{name}, {world} workers" + (" (baseline)" if name == "DDP" else "")
            is_fsdp = name == "FSDP"
            state_rows.append(
                {
                    "configuration": label,
                    "params (MiB)": _mib(s["params"]),
                    "grads (MiB)": _mib(s["grads"]),
                    "AdamW state (MiB)": _mib(s["optimizer"]),
                    "per rank (MiB)": _mib(s["state"]),
                    "ratio to DDP": f"{vs['state']:.3f}" if is_fsdp else "1.000",
                    "target": f"<= {vs['target']:.3f}" if is_fsdp else "",
                    "met": ("yes" if vs["met"] else "NO") if is_fsdp else "",
                }
            )
            save_rows.append(
                {
                    "configuration": label,
                    "save, slowest rank (s)": f"{s['save_s']:.2f}",
                    "range (s)": "{:.2f}-{:.2f}".format(*s["save_range"]),
                    "ratio to DDP": f"{vs['save_s']:.3f}" if is_fsdp else "1.000",
                    "on disk (MiB)": _mib(s["disk_bytes"]),
                    "size ratio": f"{vs['disk_bytes']:.3f}" if is_fsdp else "1.000",
                    "files": s["files"],
                }
            )
            rss_rows.append(
                {"configuration": label}
                | {f"{phase} (MiB)": _mib(s["peak_rss"][phase]) for phase in PHASES}
            )
        state_label = f"FSDP {world} workers: state per rank"
        ratios[state_label] = vs["state"]
        ratios[f"FSDP {world} workers: checkpoint save time"] = vs["save_s"]
        ratios[f"FSDP {world} workers: checkpoint size"] = vs["disk_bytes"]
        targets[state_label] = vs["target"]
        verdicts[world] = vs["met"]
    cuda = [s["cuda_peak"] for s in results.values()]
    cuda_line = (
        "peak torch.cuda.max_memory_allocated per rank (MiB): "
        + ", ".join(f"{k[0]} x{k[1]} {_mib(s['cuda_peak'])}" for k, s in results.items())
        if all(c is not None for c in cuda)
        else "peak torch.cuda.max_memory_allocated: skipped (no GPU for every rank here)"
    )
    numel, m = next(iter(results.values()))["numel"], opts["model"]
    model_line = (
        f"Model: GPT-2-shaped, {numel / 1e6:.1f}M parameters ({m['n_layer']} layers, width "
        f"{m['n_embd']}, {m['n_head']} heads, vocabulary {m['vocab_size']}), fp32, one AdamW "
        f"step on {opts['batch']} x {opts['seq']} tokens per rank; save time: median of "
        f"{opts['saves']} saves in each of {opts['rounds']} process groups per configuration."
    )
    targets_line = "target FSDP state per rank <= 1/N + 10% of DDP's: " + ", ".join(
        f"{w} workers {'met' if ok else 'NOT met'}" for w, ok in verdicts.items()
    )
    rss_line = (
        "Process peak RSS, largest rank: the high-water mark after building the model (whole, on "
        "every rank), after `prepare`, after the step, after the saves (libraries included):"
    )
    parts = [model_line, table(state_rows), targets_line, table(save_rows), rss_line]
    text = "\n\n".join([*parts, table(rss_rows), cuda_line])
    return {
        "table": text,
        "baseline": "DDP, same number of workers, same run",
        "ratios": ratios,
        "targets": targets,
        "targets_met": {str(w): ok for w, ok in verdicts.items()},
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 3.7M-parameter model (smoke run)")
    parser.add_argument("--workers", default="2,4", help="comma-separated worker counts")
    parser.add_argument("--n-layer", type=int, default=8, help="GPT-2 blocks of the full model")
    parser.add_argument("--saves", type=int, default=3, help="checkpoints per process group")
    parser.add_argument(
        "--rounds", type=int, default=2, help="process groups per configuration, in ABBA order"
    )
    parser.add_argument(
        "--phases",
        default="state,load,lora,loss",
        help="state (and checkpoints), load, lora, loss (the chunked loss), qlora (alone)",
    )
    parser.add_argument(
        "--qlora-shape", default="1.1b", choices=("1.1b", "254m"),
        help="the qlora phase's Llama: table 4's 1.1B shape, or the load phase's 254M",
    )  # fmt: skip
    parser.add_argument("--json", default=None)
    cli = parser.parse_args()
    phases = cli.phases.split(",")
    model = dict(QUICK_MODEL) if cli.quick else {**FULL_MODEL, "n_layer": cli.n_layer}
    opts = {"model": model, "batch": 2, "seq": 128, "saves": cli.saves, "rounds": cli.rounds}
    loading = None
    if "loss" in phases:  # the chunked loss against the full logits (_memory_loss.py)
        from _memory_loss import run_loss_phase

        loss = run_loss_phase(quick=cli.quick)
        if phases == ["loss"]:
            return emit({"machine": machine(), **loss, "opts": opts}, cli.json)
    if "load" in phases:  # the load phase: _memory_load.py
        from _memory_load import run_load_phase

        workers = [int(w) for w in cli.workers.split(",")]
        loading = run_load_phase(run_configuration, workers, cli.quick)
    if "qlora" in phases:  # QLoRA's 4-bit base loaded, 1 and N workers (_memory_load.py)
        from _memory_load import run_qlora_phase

        workers = [int(w) for w in cli.workers.split(",")]
        qlora = run_qlora_phase(run_configuration, workers, cli.quick, cli.qlora_shape)
        if phases == ["qlora"]:
            return emit({"machine": machine(), **qlora}, cli.json)
    if "lora" in phases:  # LoRA against full, 2 workers (_memory_lora.py)
        from _memory_lora import run_lora_phase

        lora = run_lora_phase(run_configuration, 2, {**opts, "steps": 4, "saves": 2})
        if "state" not in phases:
            return emit({"machine": machine(), **lora, "opts": opts}, cli.json)
    if "state" not in phases:
        return emit({"machine": machine(), **loading}, cli.json)
    runs: dict[tuple[str, int], list[list[dict[str, Any]]]] = {}
    for world in (int(w) for w in cli.workers.split(",")):
        for r in range(cli.rounds):  # DDP, FSDP, then FSDP, DDP: drift hits both alike
            for strategy in ("ddp", "fsdp") if r % 2 == 0 else ("fsdp", "ddp"):
                # One configuration at a time: 4 DDP ranks of the full model take ~12 GB.
                runs.setdefault((strategy, world), []).append(
                    run_configuration(strategy, world, opts)
                )
    results = {key: summarise(value) for key, value in runs.items()}
    raw = {f"{strategy}_x{world}": value for (strategy, world), value in runs.items()}
    report = {"machine": machine(), **build_report(results, opts), "ranks": raw, "opts": opts}
    if loading is not None:
        report["table"] += "\n\n" + loading["table"]
        report["ratios"].update(loading["ratios"])
        report["load"] = loading
    if "loss" in phases:
        report["table"] += "\n\n" + loss["table"]
        report["ratios"].update(loss["ratios"])
        report["loss"] = {k: v for k, v in loss.items() if k != "table"}
    if "lora" in phases:
        report["table"] += "\n\n" + lora["table"]
        report["ratios"].update(lora["ratios"])
        report["lora"] = lora
    return emit(report, cli.json)


if __name__ == "__main__":
    main()
