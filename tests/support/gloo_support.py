"""Two-process (or N-process) gloo groups for multi-rank numerics, without Ray.

`run_ranks(fn, world, *args)` spawns `world` processes, each joining one gloo process group on
127.0.0.1, runs ``fn(rank, world, *args)`` in each and returns their return values in rank
order; a rank's exception fails the caller with its traceback. `fn` must be a module-level
function (the rank processes import it).

The ranks are forked by multiprocessing's forkserver, which imports `PRELOAD` once per test
process: a rank starts with torch, transformers, peft and accelerate already imported (~7.5
CPU-seconds a process as spawned interpreters, each importing them again; about a tenth of the
unit tier's CPU). Each rank gets the caller's environment at the call, as a spawned one did.
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


#: What the forkserver imports before it forks a rank (a module not installed is skipped). No
#: module here starts a thread or touches a device at import: a fork of it is safe.
PRELOAD = ["torch", "torch.distributed", "transformers", "peft", "accelerate"]


def _entry(
    rank: int, world: int, port: int, out: str, fn: Any, args: tuple, env: dict[str, str]
) -> None:
    import faulthandler

    import torch
    import torch.distributed as dist

    # A rank that dies of a signal (a native crash: SIGSEGV, glibc's SIGABRT on a corrupted heap)
    # prints every thread's Python stack to stderr, which pytest captures: where it died.
    faulthandler.enable(all_threads=True)
    os.environ.clear()  # the caller's, not the forkserver's of its start
    os.environ.update(env)
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
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="gloo_ranks_") as out:
        mp.start_processes(
            _entry, args=(world, _free_port(), out, fn, args, dict(os.environ)), nprocs=world,
            join=True, start_method="forkserver",
        )  # fmt: skip
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
