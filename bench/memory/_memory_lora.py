"""bench_memory's LoRA phase (``--phases lora``): LoRA against a full fine-tune, DDP and FSDP.

Runs in the benchmark's spawned rank processes (one gloo group per configuration), as the rest
of bench_memory. Every rank does what a runner worker does: seeds, builds the GPT-2-shaped model,
wraps it with the runner's own LoRA (``ray_trainer._lora.wrap``: r=16, every linear layer of
the blocks, the runner's default targets) or not, prepares it with the runner's ``prepare``
(DDP or FSDP2), builds the runner's AdamW (the trainable parameters only), then takes
``steps`` real steps and ``saves`` checkpoints written as the runner writes them (the adapters
alone for LoRA). Figures per configuration: the largest rank's bytes of parameters, gradients
and optimizer state; the step time (median of the steps after the first, slowest rank); the
checkpoint's bytes (all ranks' files) and save time (median, slowest rank). Ratios: LoRA /
full, same strategy, same run. Targets: optimizer state and checkpoint size < 5% of full.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

from _memory_counting import state_bytes
from _support import table

LORA = {"r": 16, "lora_alpha": 32}
TARGET = 0.05


def lora_rank(rank: int, world: int, strategy: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of one configuration (``opts["lora"]``: LoRA or full). A collective."""
    import torch
    import torch.distributed as dist
    import transformers
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.assemble import _optimizer
    from ray_trainer._worker.checkpoints.saving import sharded_state, write_state
    from ray_trainer._worker.model.adaptation import LoraAdapters, WholeModel
    from ray_trainer._worker.model.parallel import prepare

    lora = LORA if opts["lora"] else None
    args = TrainingArgs(strategy=strategy, num_workers=world, mixed_precision="no", lora=lora)
    accelerator = Accelerator(cpu=True, mixed_precision="no")
    set_seed(args.seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**opts["model"]))
    if lora is not None:
        from ray_trainer._lora import wrap

        model = wrap(model, lora)
    parallel = prepare(
        model, args, accelerator, lambda m: _optimizer(m, args, accelerator.device), "no"
    )
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(
        opts["model"]["vocab_size"], (opts["batch"], opts["seq"]), generator=generator
    )
    step_s = []
    for _ in range(opts["steps"]):
        dist.barrier()
        started = time.perf_counter()
        parallel.model(input_ids=ids, labels=ids).loss.backward()
        parallel.scale_and_clip(torch.tensor(1.0), args.max_grad_norm)
        parallel.optimizer.step()
        parallel.optimizer.zero_grad(set_to_none=False)  # keep the gradients to count them
        step_s.append(time.perf_counter() - started)
    counted = state_bytes(parallel.model, parallel.optimizer)
    # What a checkpoint holds: a LoRA run's adapters alone, else the whole model.
    adaptation = LoraAdapters({}, "adapter", None) if lora is not None else WholeModel()
    save_s, disk = [], 0
    for _ in range(opts["saves"]):
        folder = tempfile.mkdtemp(prefix=f"bench_lora_rank{rank}_")
        try:
            dist.barrier()
            started = time.perf_counter()
            state = None  # as saving.save: every rank its shards, or rank 0 the whole
            if parallel.sharded:
                state = sharded_state(parallel.model, parallel.optimizer, adaptation)
            elif rank == 0:
                module = parallel.module()
                weights = adaptation.trainable(module, module.state_dict())
                state = {"model": weights, "optim": parallel.optimizer.state_dict()}
            write_state(folder, state, rank, parallel.sharded)
            save_s.append(time.perf_counter() - started)
            disk = sum(
                os.path.getsize(os.path.join(root, n))
                for root, _, ns in os.walk(folder)
                for n in ns
            )
            dist.barrier()
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    trainable = sum(p.numel() for p in parallel.model.parameters() if p.requires_grad)
    return {
        "rank": rank, **counted, "step_s": step_s, "save_s": save_s, "disk_bytes": disk,
        "trainable": trainable, "numel": sum(p.numel() for p in parallel.model.parameters()),
    }  # fmt: skip


def _summary(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    largest = max(ranks, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
    steps = [max(t) for t in zip(*(r["step_s"] for r in ranks), strict=True)][1:]
    saves = [max(t) for t in zip(*(r["save_s"] for r in ranks), strict=True)]
    return {
        "params": largest["params"], "grads": largest["grads"], "optimizer": largest["optimizer"],
        "step_s": statistics.median(steps), "save_s": statistics.median(saves),
        "disk_bytes": sum(r["disk_bytes"] for r in ranks), "trainable": largest["trainable"],
        "numel": largest["numel"],
    }  # fmt: skip


def run_lora_phase(run_configuration: Any, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Full and LoRA, DDP and FSDP, on `world` ranks: the table, ratios and targets."""
    results = {}
    for strategy in ("ddp", "fsdp"):
        for lora in (False, True):
            ranks = run_configuration(strategy, world, {**opts, "lora": lora, "lora_phase": True})
            results[(strategy, lora)] = _summary(ranks)
    rows, ratios, met = [], {}, {}
    mib = 2**20
    for strategy in ("ddp", "fsdp"):
        full, lora = results[(strategy, False)], results[(strategy, True)]
        for name, s in (("full", full), ("LoRA r=16", lora)):
            rows.append({
                "configuration": f"{strategy.upper()} x{world}, {name}",
                "trainable": f"{s['trainable'] / 1e6:.2f}M",
                "params (MiB)": f"{s['params'] / mib:,.1f}",
                "grads (MiB)": f"{s['grads'] / mib:,.1f}",
                "AdamW (MiB)": f"{s['optimizer'] / mib:,.2f}",
                "checkpoint (MiB)": f"{s['disk_bytes'] / mib:,.2f}",
                "save (s)": f"{s['save_s']:.3f}",
                "step (s)": f"{s['step_s']:.2f}",
            })  # fmt: skip
        for key in ("optimizer", "disk_bytes", "save_s", "step_s", "grads"):
            ratios[f"LoRA/full {strategy.upper()} x{world}: {key}"] = lora[key] / full[key]
        met[strategy] = all(lora[k] / full[k] < TARGET for k in ("optimizer", "disk_bytes"))
    numel = results[("ddp", False)]["numel"]
    text = "\n\n".join([
        f"LoRA (r=16, alpha 32, every linear layer of the blocks) against a full fine-tune of the "
        f"same {numel / 1e6:.1f}M-parameter GPT-2-shaped model, fp32, {opts['steps']} AdamW steps "
        f"on {opts['batch']} x {opts['seq']} tokens per rank (step: median after the first), "
        f"{opts['saves']} saves (median), largest rank's state, checkpoint = all ranks' files:",
        table(rows),
        "targets (LoRA's AdamW state and checkpoint < 5% of full): "
        + ", ".join(f"{k.upper()} {'met' if v else 'NOT met'}" for k, v in met.items()),
    ])  # fmt: skip
    return {"table": text, "ratios": ratios, "targets_met": met, "results": {
        f"{k[0]}_{'lora' if k[1] else 'full'}": v for k, v in results.items()}}  # fmt: skip
