"""User's terminal: ``ray-trainer submit`` validates a run, then submits it as a Ray job.

Runs in the user's terminal, in a process of its own. It never joins the cluster: it validates
the config here, then talks to the dashboard's job API over HTTP (``JobSubmissionClient``). The
run's driver is the job's entrypoint, ``ray-trainer run CONFIG``, started by Ray's job
supervisor on the head node.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import secrets
import shlex
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ray_trainer._config import TrainingArgs, TrainingArgsError
from ray_trainer._driver.status import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_OK

_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(ValueError):
    """The submission cannot be built (config outside the working dir, no address...)."""


def submit_address(address: str | None) -> str:
    """The dashboard URL: ``--address``, else ``RAY_API_SERVER_ADDRESS``, else an ``http``
    ``RAY_ADDRESS`` (as ``ray job submit`` reads it)."""
    env = os.environ.get("RAY_ADDRESS", "")
    found = (
        address
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or (env if env.startswith(("http://", "https://")) else None)
    )
    if not found:
        raise SubmitError(
            "no dashboard address: pass --address http://HOST:8265 (after `ray dashboard "
            "cluster.yaml`, http://127.0.0.1:8265)"
        )
    return found


def config_in_working_dir(config: str | os.PathLike, working_dir: str | os.PathLike) -> str:
    """The config's path relative to the working dir (as the job sees it), POSIX style."""
    config_path, root = Path(config).resolve(), Path(working_dir).resolve()
    try:
        return config_path.relative_to(root).as_posix()
    except ValueError:
        raise SubmitError(
            f"the config {config} is not inside the working dir {root}: only the working dir is "
            "uploaded with the job; move the config into it, pass --working-dir DIR that "
            "contains it, or --no-working-dir if every node sees the same files"
        ) from None


def build_entrypoint(config: str, overrides: list[str]) -> str:
    """The job's shell command: ``ray-trainer run CONFIG --set k=v ...``, each word quoted."""
    words = ["ray-trainer", "run", config]
    for item in overrides:
        words += ["--set", item]
    return shlex.join(words)


def generated_run_name() -> str:
    """A run name like the one `run_training` would pick, chosen here so `status` can use it."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{secrets.token_hex(2)}"


def prepare_submission(opts: argparse.Namespace) -> tuple[str, str, dict[str, Any], str]:
    """Validate the config here and build the job: (address, entrypoint, runtime_env, run_name).

    Raises ``TrainingArgsError`` for a bad config, ``SubmitError`` for a bad submission; nothing
    has reached the cluster yet.
    """
    address = submit_address(opts.address)
    overrides = list(opts.overrides)
    args = TrainingArgs.from_yaml(opts.config, overrides)
    run_name = args.run_name
    if run_name is None:
        run_name = generated_run_name()
        overrides.append(f"run_name={run_name}")
    runtime_env: dict[str, Any] = {}
    if opts.no_working_dir:
        config = str(Path(opts.config).resolve())
    else:
        if not Path(opts.working_dir).is_dir():
            raise SubmitError(f"--working-dir {opts.working_dir}: not a directory")
        config = config_in_working_dir(opts.config, opts.working_dir)
        runtime_env["working_dir"] = str(Path(opts.working_dir).resolve())
        runtime_env["excludes"] = [".git"]  # .gitignore'd files are left out by Ray itself
    # Train's driver may see several Ray instances on a node; the dashboard URL settles which.
    runtime_env["env_vars"] = {"RAY_API_SERVER_ADDRESS": address}
    return address, build_entrypoint(config, overrides), runtime_env, run_name


def follow_hint(address: str, job_id: str, run_name: str) -> str:
    return (
        f"follow the logs:  ray job logs --follow --address {address} {job_id}\n"
        f"check progress:   ray-trainer status {run_name}   (on the cluster, or --address HOST:6379)\n"
        f"stop it:          ray job stop --address {address} {job_id}"
    )


def add_parser(sub: Any) -> None:
    """The ``submit`` subcommand's options (``sub`` is argparse's subparsers object)."""
    submit = sub.add_parser("submit", help="submit a run as a Ray job (validated here first)")
    submit.add_argument("config", help="YAML file of TrainingArgs fields, inside --working-dir")
    submit.add_argument(
        "--address",
        default=None,
        help="dashboard URL http://HOST:8265 (default: RAY_API_SERVER_ADDRESS)",
    )
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--wait", action="store_true", help="stream the job's logs until it ends")
    files = submit.add_mutually_exclusive_group()
    files.add_argument(
        "--working-dir", default=".", help="folder uploaded with the job (default .)"
    )
    files.add_argument(
        "--no-working-dir", action="store_true", help="upload nothing: every node sees the config"
    )
    submit.set_defaults(main=submit_main)


def submit_main(opts: argparse.Namespace) -> int:
    """``ray-trainer submit CONFIG --address URL [--set k=v ...] [--wait]``."""
    try:
        address, entrypoint, runtime_env, run_name = prepare_submission(opts)
    except (TrainingArgsError, SubmitError) as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    from ray.job_submission import JobSubmissionClient

    try:
        client = JobSubmissionClient(address)
    except (ConnectionError, ValueError, RuntimeError) as e:
        print(
            f"ray-trainer: error: cannot reach the Ray dashboard at {address}: {e}", file=sys.stderr
        )
        return EXIT_ERROR
    try:
        job_id = client.submit_job(
            entrypoint=entrypoint, runtime_env=runtime_env, metadata={"ray_trainer_run": run_name}
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        print(f"ray-trainer: error: the cluster refused the job: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"submitted job {job_id} (run {run_name}): {entrypoint}", flush=True)
    print(follow_hint(address, job_id, run_name), flush=True)
    if not opts.wait:
        return EXIT_OK
    try:
        final = wait_for_job(client, job_id, sys.stdout)
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} keeps running", file=sys.stderr)
        return 130
    info = client.get_job_info(job_id)
    print(f"job {job_id} {final}" + (f": {info.message}" if info.message else ""), flush=True)
    return EXIT_OK if final == "SUCCEEDED" else EXIT_NOT_FOUND


def wait_for_job(client: Any, job_id: str, out: TextIO, poll_s: float = 1.0) -> str:
    """Stream the job's logs to ``out`` until it ends; return its final status.

    Streams through the dashboard's websocket (``tail_job_logs``); where that fails (a proxy
    without websockets), polls ``get_job_logs`` and prints what is new.
    """
    printed = 0  # characters written so far: polling goes on from there

    async def tail() -> None:
        nonlocal printed
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()
            printed += len(chunk)

    try:
        asyncio.run(tail())
        streamed = True
    except Exception as e:  # websocket refused or dropped: fall back to polling
        print(f"(log streaming stopped: {e}; polling the logs instead)", file=sys.stderr)
        streamed = False
    while True:
        status = str(client.get_job_status(job_id).value)
        if not streamed:
            logs = client.get_job_logs(job_id)
            out.write(logs[printed:])
            out.flush()
            printed = max(printed, len(logs))
        if status in _TERMINAL:
            return status
        time.sleep(poll_s)
