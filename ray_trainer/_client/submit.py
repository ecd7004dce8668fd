"""User's terminal: ``ray-trainer submit`` validates a run, submits it as a Ray job, follows it.

Runs in the user's terminal, in a process of its own. It never joins the cluster: it validates
the config's fields here (its callback entries by their shape only: nothing the config names
is imported or called on this machine; the job builds them on the cluster), checks what it will
upload, then talks to the dashboard's job API over HTTP
(``JobSubmissionClient``, see ``job_api.py``). The run's driver is the job's entrypoint,
``ray-trainer run CONFIG``, started by Ray's job supervisor on the head node; the job's
submission id is the run name, so Ray refuses a second job of the same run.

Exit codes: 0 the job SUCCEEDED (or, with ``--no-wait``, was submitted), 1 it did not succeed,
2 bad input, a refused submission or no dashboard reachable within ``--timeout``, 3 the cluster
refused the credentials (``--headers`` / ``RAY_JOB_HEADERS``), 130 Ctrl-C while following.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import secrets
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from ray_trainer._client.job_api import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    DashboardError,
    add_connection_options,
    connect,
    dashboard_address,
    job_api,
    parse_headers,
    parse_verify,
)
from ray_trainer._client.runtime_env import (
    RuntimeEnvError,
    build_runtime_env,
    check_upload_size,
    load_runtime_env,
    parse_env,
)
from ray_trainer._config.args import TrainingArgs
from ray_trainer._errors import TrainingArgsError

_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class SubmitError(ValueError):
    """The submission cannot be built (config outside the working dir, no address...)."""


@dataclass
class Submission:
    """A validated job, ready for the job API; nothing has reached the cluster yet."""

    address: str
    entrypoint: str
    runtime_env: dict[str, Any]
    run_name: str
    headers: dict[str, Any] | None = None
    verify: bool | str = True


def config_in_working_dir(config: str | Path, working_dir: str | Path) -> str:
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


def prepare_submission(opts: argparse.Namespace) -> Submission:
    """Validate the address, the config and the upload here, and build the job.

    Raises ``DashboardError`` for a wrong address or options, ``TrainingArgsError`` for a bad
    config, ``SubmitError`` / ``RuntimeEnvError`` for a bad submission.
    """
    address = dashboard_address(opts.address)
    headers, verify = parse_headers(opts.headers), parse_verify(opts.verify)
    overrides = list(opts.overrides)
    # The fields only: callbacks are built by the job, on the cluster (nothing of the config's
    # code runs here).
    args = TrainingArgs.from_yaml(opts.config, overrides, build_callbacks=False)
    run_name = args.run_name
    if run_name is None:
        run_name = generated_run_name()
        overrides.append(f"run_name={run_name}")
    working_dir = None
    if opts.no_working_dir:
        config = str(Path(opts.config).resolve())
    else:
        if not Path(opts.working_dir).is_dir():
            raise SubmitError(f"--working-dir {opts.working_dir}: not a directory")
        config = config_in_working_dir(opts.config, opts.working_dir)
        working_dir = str(Path(opts.working_dir).resolve())
    runtime_env = build_runtime_env(
        load_runtime_env(opts.runtime_env), working_dir, opts.pip, parse_env(opts.env)
    )
    if working_dir is not None:
        check_upload_size(working_dir, runtime_env["excludes"])
    entrypoint = build_entrypoint(config, overrides)
    return Submission(address, entrypoint, runtime_env, run_name, headers, verify)


def submit_job(client: Any, job: Submission) -> str:
    """Submit ``job`` under its run name; a run name already used on the cluster is refused."""
    try:
        with job_api(job.address, "submitting the job"):
            return client.submit_job(
                entrypoint=job.entrypoint,
                runtime_env=job.runtime_env,
                metadata={"ray_trainer_run": job.run_name},
                submission_id=job.run_name,
            )
    except DashboardError as e:
        if "submission_id" not in str(e) or "already exists" not in str(e):
            raise
        raise DashboardError(
            f"the cluster at {job.address} already has a job {job.run_name}: a run's name is its "
            "job's submission id. Pick another run_name (--set run_name=NEW), or, to run this one "
            f"again, delete the old job first: ray job delete --address {job.address} "
            f"{job.run_name}"
        ) from None


def follow_hint(address: str, job_id: str, run_name: str) -> str:
    return (
        f"follow the logs:  ray job logs --follow --address {address} {job_id}\n"
        f"check progress:   ray-trainer status {run_name} --address {address}\n"
        f"stop it:          ray job stop --address {address} {job_id}"
    )


def add_parser(sub: Any) -> None:
    """The ``submit`` subcommand's options (``sub`` is argparse's subparsers object)."""
    submit = sub.add_parser("submit", help="submit a run as a Ray job (validated here first)")
    submit.add_argument("config", help="YAML file of TrainingArgs fields, inside --working-dir")
    add_connection_options(
        submit,
        address_help="dashboard URL http://HOST:8265 (default: RAY_API_SERVER_ADDRESS, "
        "else an http:// RAY_ADDRESS)",
        timeout_help="seconds to reach the dashboard (default %(default)g)",
    )
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument(
        "--runtime-env", default=None, metavar="FILE", help="YAML/JSON runtime_env merged in"
    )
    submit.add_argument(
        "--pip", action="append", default=[], metavar="PKG", help="pip package for the job"
    )
    submit.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="job environment variable"
    )
    wait = submit.add_mutually_exclusive_group()
    wait.add_argument("--wait", dest="wait", action="store_true", help="(the default)")
    wait.add_argument(
        "--no-wait", dest="wait", action="store_false", help="return once the job is submitted"
    )
    files = submit.add_mutually_exclusive_group()
    files.add_argument(
        "--working-dir", default=".", help="folder uploaded with the job (default .)"
    )
    files.add_argument(
        "--no-working-dir", action="store_true", help="upload nothing: every node sees the config"
    )
    submit.set_defaults(main=submit_main, wait=True)


def submit_main(opts: argparse.Namespace) -> int:
    """``ray-trainer submit CONFIG --address URL [--set k=v ...] [--no-wait]``."""
    try:
        job = prepare_submission(opts)
        client = connect(job.address, job.headers, job.verify, opts.timeout)
        job_id = submit_job(client, job)
    except DashboardError as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return e.exit_code
    except (TrainingArgsError, SubmitError, RuntimeEnvError) as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(f"submitted job {job_id} (run {job.run_name}): {job.entrypoint}", flush=True)
    print(follow_hint(job.address, job_id, job.run_name), flush=True)
    if not opts.wait:
        return EXIT_OK
    try:
        with job_api(job.address, f"following job {job_id}"):
            final = wait_for_job(client, job_id, sys.stdout)
            info = client.get_job_info(job_id)
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} keeps running", file=sys.stderr)
        return 130
    except DashboardError as e:
        print(f"ray-trainer: error: {e}; the job may still be running", file=sys.stderr)
        return e.exit_code
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
