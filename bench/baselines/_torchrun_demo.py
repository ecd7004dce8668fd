"""The torchrun side of bench_first_step.py: the demo's first step, one process per rank.

Launched as ``python -m torch.distributed.run --nproc_per_node 2 bench/baselines/_torchrun_demo.py --out F``.
What a user writing it by hand would do for `make demo`'s first step: build the demo (model and
data), wrap the model in DDP over gloo, AdamW with the demo's settings, a distributed sampler,
then one step (forward, backward, clip, optimizer). Rank 0 writes the first step's begin time
(``time.perf_counter``, CLOCK_MONOTONIC: comparable with the launcher's) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ray_trainer._demo import DEMO_DEFAULTS, build_demo


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=1)
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(42)
    demo = build_demo()
    model = DistributedDataParallel(demo.model_factory())
    optimizer = torch.optim.AdamW(model.parameters(), lr=DEMO_DEFAULTS["learning_rate"])
    sampler = DistributedSampler(demo.train_dataset, seed=42, drop_last=True)
    loader = DataLoader(demo.train_dataset, batch_size=DEMO_DEFAULTS["batch_size"], sampler=sampler)
    times = []
    for step, batch in enumerate(loader):
        if step >= opts.steps:
            break
        times.append(time.perf_counter())
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if dist.get_rank() == 0:
        with open(opts.out, "w") as f:
            json.dump({"times": times}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
