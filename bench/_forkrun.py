"""--smoke: each benchmark's driver forked from one process that has already imported what every
driver imports (torch, Ray, Ray Train, transformers, the runner), instead of a fresh Python each.

A driver's imports cost 3-4 CPU-seconds on the 2-core machine (`python -c "import torch, ray,
ray.train.torch, ray_trainer, transformers, accelerate"`), paid here once for the smoke run's
15 drivers. Only the smoke run forks: a full or quick run times its benchmarks, some of them
from a fresh process (start-up), and keeps a fresh interpreter per benchmark.

The fork server (`multiprocessing`'s "forkserver" context) is started before any benchmark, in
the smoke run's Ray environment (`SMOKE_RAY_ENV`: what Ray and Ray Train may read at import).
It never starts Ray, a torch operation or a thread of its own, so what it forks is safe to
fork. Each child takes the benchmark's own environment, working folder, arguments and log
(its stdout and stderr, which the processes it starts inherit), runs the script as
``__main__``, then its ``atexit`` functions (Ray's shutdown among them), as a fresh
interpreter would at its end.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import sys
import traceback
from collections.abc import Iterator

#: Imported once in the fork server: what the benchmark drivers import (an import that fails
#: there is skipped, and done by the driver that needs it).
PRELOAD = ["torch", "ray", "ray.train.torch", "transformers", "accelerate", "ray_trainer"]


@contextlib.contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Forker:
    """Runs benchmark scripts as children of one fork server with `PRELOAD` imported."""

    def __init__(self, env: dict[str, str], preload: list[str] = PRELOAD) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(preload)
        from multiprocessing import forkserver

        with _environ(env):  # the server's environment, read at its start
            forkserver.ensure_running()

    def close(self) -> None:
        """Stop the fork server and `multiprocessing`'s resource tracker it started, and wait
        for both (each would otherwise end on its own a moment after this process: still
        running when `.ci/cpu_seconds` looks for what is left of the run)."""
        from multiprocessing import forkserver, resource_tracker

        for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
            with contextlib.suppress(Exception):  # internal to multiprocessing: best effort
                helper._stop()

    def run(self, cmd: list[str], cwd: str, env: dict[str, str], log: str,
            timeout_s: float) -> int | str:  # fmt: skip
        """Runs ``python SCRIPT ARGS...`` (`cmd`) forked; its exit code, or "timeout"."""
        child = self.ctx.Process(
            target=_main, args=(cmd[1], cmd[2:], cwd, env, log), name=os.path.basename(cmd[1])
        )
        child.start()
        child.join(timeout_s)
        if child.exitcode is None:
            child.kill()
            child.join()
            return "timeout"
        return child.exitcode


def _main(script: str, argv: list[str], cwd: str, env: dict[str, str], log: str) -> None:
    """The child: becomes ``python script argv...`` with `env` in `cwd`, writing to `log`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    # a fresh interpreter's path: the script's folder first, then PYTHONPATH's
    extra = [os.path.dirname(script), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    sys.path[:0] = [p for p in extra if p not in sys.path]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    os._exit(code)
