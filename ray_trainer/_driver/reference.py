"""Driver: DPO's reference log-probs, reused from storage or computed by Ray tasks before training.

Runs in the driver, after the token caches are complete and before any training worker starts
(``launch.prepare_launch``), for a run with ``objective="dpo"`` and ``precompute_reference``
(the default). For each cache of pairs (``data``, ``val_data``) it finds the reference folder of
its key (``ray_trainer._reference``): complete, it is reused as it is (a second run on the same
data and model, a resumed run); otherwise the sequences are cut into slices of whole pairs and
each slice is one Ray task running ``_reference.reference_piece`` on any node: one GPU each when
the run trains on GPUs (every GPU of the cluster is free before training), else one CPU each.
The tasks read the cache and write their piece to storage; the driver writes the folder's meta
last. A sharded model (``strategy="fsdp"``) does not fit one task: its folder is named to the
workers, which fill it forward-only, sharded, before their first step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._driver.data import DataPlan
from ray_trainer._model.spec import ModelSpec
from ray_trainer._objectives import objective_of
from ray_trainer._reference import (
    read_meta,
    reference_key,
    reference_location,
    reference_piece,
    slices,
    write_meta,
)

logger = logging.getLogger("ray_trainer")
#: At most this many reference tasks per cache ...
MAX_TASKS = 16
#: ... and at least this many sequences each: a task takes about 3.5 s on a CPU to start,
#: import and load the model (bench_dpo), about as long as scoring 256 short sequences.
MIN_SEQUENCES_PER_TASK = 256


def reference_dtype(args: TrainingArgs) -> str:
    """The dtype the reference pass computes in: the run's bf16 on GPUs, else fp32."""
    return "bf16" if args.use_gpu and args.mixed_precision in ("auto", "bf16") else "float32"


def reference_quantize(args: TrainingArgs) -> tuple[str, list[str] | None] | None:
    """QLoRA's base quantization, which the reference shares (it is the policy with its
    adapters off): ``(kind, fsdp_shard_modules)``, or None."""
    kind = (args.lora or {}).get("quantize_base")
    return None if kind is None else (kind, args.fsdp_shard_modules)


def prepare_references(plans: dict[str, DataPlan], args: TrainingArgs) -> dict[str, str]:
    """``field -> reference folder`` of every cache of pairs, complete unless the workers
    fill it (FSDP). Empty unless the objective needs a reference pass (DPO with
    ``precompute_reference``, the default)."""
    if not objective_of(args.objective).needs_reference(args):
        return {}
    spec = ModelSpec.of(args)
    dtype = reference_dtype(args)
    out: dict[str, str] = {}
    for field, plan in plans.items():
        key = reference_key(plan.fingerprint, spec, dtype, args.seed, reference_quantize(args))
        location = reference_location(plan.cache, key)
        out[field] = location.name
        meta = read_meta(location)
        if meta is not None:
            print(
                f"{field}: reference log-probs of {meta['sequences']} sequences reused from "
                f"{location.name} (computed in {meta['wall_s']:.1f} s)",
                flush=True,
            )
            continue
        if args.strategy == "fsdp":
            print(
                f"{field}: reference log-probs computed by the training workers (sharded, "
                "forward only) before the first step",
                flush=True,
            )
            continue
        _compute(field, plan, args, spec, location, dtype)
    return out


def _compute(
    field: str, plan: DataPlan, args: TrainingArgs, spec: ModelSpec, location: Any, dtype: str
) -> None:
    import ray

    started = time.perf_counter()
    sequences = int(plan.meta["samples"]) if plan.meta else 0
    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0)) if args.use_gpu else 0
    devices = gpus or int(resources.get("CPU", 1))
    parts = slices(sequences, tasks_for(sequences, devices))
    options = {"num_gpus": 1, "num_cpus": 0} if gpus else {"num_cpus": 1}
    task = ray.remote(reference_piece).options(**options, max_retries=1)
    pad_id = _pad_id(spec)
    fs, bf16 = args.storage_filesystem, dtype == "bf16"
    where = (spec, plan.cache.name, location.name, fs)
    refs = [
        task.remote(*where, i, start, end, pad_id, args.seed, bf16, reference_quantize(args))
        for i, (start, end) in enumerate(parts)
    ]
    results = ray.get(refs)
    wall = time.perf_counter() - started
    write_meta(
        location,
        parts,
        wall_s=round(wall, 3),
        task_s=round(sum(r["wall_s"] for r in results), 3),
        tasks=len(parts),
        device=results[0]["device"] if results else "cpu",
        dtype=dtype,
        model=str(args.model),
        quantize_base=(args.lora or {}).get("quantize_base"),  # QLoRA: the 4-bit base's
    )
    print(
        f"{field}: reference log-probs of {sequences} sequences computed by {len(parts)} Ray "
        f"task(s) on {'GPUs' if gpus else 'CPUs'} in {wall:.1f} s",
        flush=True,
    )


def tasks_for(sequences: int, devices: int) -> int:
    """How many reference tasks score `sequences` sequences on a cluster of `devices` GPUs
    (or CPUs): one per device, each with at least `MIN_SEQUENCES_PER_TASK`, at most
    `MAX_TASKS`."""
    return max(1, min(MAX_TASKS, devices, sequences // MIN_SEQUENCES_PER_TASK))


def _pad_id(spec: ModelSpec) -> int:
    from ray_trainer._data.encode import Encoder

    return Encoder(spec.data_tokenizer()).pad_id or 0
