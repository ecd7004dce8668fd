"""Two-process (or N-process) gloo groups for multi-rank numerics, without Ray.

`run_ranks(fn, world, *args)` spawns `world` processes, each joining one gloo process group on
127.0.0.1, runs ``fn(rank, world, *args)`` in each and returns their return values in rank
order; a rank's exception fails the caller with its traceback. `fn` must be a module-level
function (the spawned processes import it).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out: str, fn: Any, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share this machine's cores
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Any, world: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on `world` gloo ranks; their results, by rank."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as out:
        mp.spawn(_entry, args=(world, _free_port(), out, fn, args), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
