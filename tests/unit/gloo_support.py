"""Two-process tests without Ray: spawn N ranks in a real gloo process group and collect what
each returns (pickled through files). Used where the numerics of several ranks are the point
(the loss's split invariance, packing parity), so CI needs no Ray for them."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from typing import Any


def run_ranks(fn: Any, world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` in `world` spawned processes that share a gloo process
    group (``torch.distributed`` initialised, ``RANK``/``WORLD_SIZE`` set as launchers set
    them); return each rank's return value. `fn` must be importable (a module-level function)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="gloo_test_")
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.spawn(_rank_main, args=(world, fn, args, out), nprocs=world, join=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    results = []
    for rank in range(world):
        with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _rank_main(rank: int, world: int, fn: Any, args: tuple, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
