"""The agreement values ride in DDP's gradient all-reduce: two real gloo processes, no Ray."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ray_trainer._loop import _GradRider


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same weights on both ranks
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _grads(model: torch.nn.Module, rank: int) -> list[torch.Tensor]:
    torch.manual_seed(100 + rank)  # different data on each rank
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    ((model(x) - y) ** 2).mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def _worker(rank: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        plain = torch.nn.parallel.DistributedDataParallel(_model())
        expected = _grads(plain, rank)
        ridden = torch.nn.parallel.DistributedDataParallel(_model())
        rider = _GradRider.attach(ridden, world=2)
        results = []
        for step in range(3):  # the first backward rebuilds DDP's buckets: ride through it
            ridden.zero_grad()
            rider.pending = torch.tensor([1.5 + rank, 10.0 * (rank + 1), float(rank == 1), step])
            got = _grads(ridden, rank)
            results.append(rider.result.tolist())
        mixed = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1).double())
        out[rank] = {
            "same_grads": all(
                torch.allclose(a, b, atol=1e-6) for a, b in zip(got, expected, strict=True)
            ),
            "results": results,
            "pending_left": rider.pending,
            "mixed_dtypes_attached": _GradRider.attach(
                torch.nn.parallel.DistributedDataParallel(mixed), world=2
            )
            is not None,
        }
    finally:
        dist.destroy_process_group()


def test_values_are_summed_and_gradients_averaged_as_plain_ddp():
    with mp.Manager() as manager:
        out = manager.dict()
        procs = mp.spawn(_worker, args=(_free_port(), out), nprocs=2, join=False)
        deadline = time.monotonic() + 120
        while not procs.join(timeout=1):
            if time.monotonic() > deadline:
                for p in procs.processes:
                    p.kill()
                pytest.fail("the two gloo processes did not finish within 120 s")
        out = dict(out)
    for rank in (0, 1):
        assert out[rank]["same_grads"]
        # [1.5 + 2.5, 10 + 20, one rank asked, step * 2]: sums over the two ranks, every step.
        assert out[rank]["results"] == [[4.0, 30.0, 1.0, 2.0 * s] for s in range(3)]
        assert out[rank]["pending_left"] is None
        assert not out[rank]["mixed_dtypes_attached"]  # falls back to a separate all-reduce


def test_not_attached_without_ddp():
    assert _GradRider.attach(_model(), world=2) is None
