"""``ray-trainer status`` and ``ray-trainer submit``: work with a run on a Ray cluster.

Both run in the user's terminal, in a process of their own, never inside a run:

- ``status`` joins the cluster as a short-lived Ray driver (``ray.init(address)``), finds the
  run's callback actor by name (``ray-trainer:<run_name>`` in namespace ``ray_trainer``) and asks
  it for its ``status()`` snapshot, with a timeout. It never touches the training workers: the
  actor answers between two event batches.
- ``submit`` never joins the cluster: it validates the config here, then talks to the dashboard's
  job API over HTTP (``JobSubmissionClient``). The run's driver is the job's entrypoint,
  ``ray-trainer run CONFIG``, started by Ray's job supervisor on the head node.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import os
import secrets
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from ray_trainer._config import TrainingArgs, TrainingArgsError

#: Exit codes: 0 ok / job SUCCEEDED, 1 no such live run / job did not succeed,
#: 2 bad input or no cluster reachable.
EXIT_OK, EXIT_NOT_FOUND, EXIT_ERROR = 0, 1, 2
STATUS_TIMEOUT_S = 10.0
_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ClusterUnreachable(RuntimeError):
    """No Ray cluster answers at the given address."""


class NoLiveRun(LookupError):
    """No callback actor of that run is alive on the cluster (or it did not answer)."""


class SubmitError(ValueError):
    """The submission cannot be built (config outside the working dir, no address...)."""


# ---- status --------------------------------------------------------------------------------


def resolve_address(address: str | None) -> str:
    """The cluster to query: ``--address``, else ``RAY_ADDRESS``, else ``"auto"``."""
    return address or os.environ.get("RAY_ADDRESS") or "auto"


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before ``ray.init`` waits for a GCS that is not there.

    ``status`` needs the cluster (GCS) address ``HOST:PORT``; a dashboard URL is refused with
    the fix. ``"auto"`` and ``ray://`` addresses are left to ``ray.init``.
    """
    if address.startswith(("http://", "https://")):
        raise ClusterUnreachable(
            f"{address} is a dashboard URL; `ray-trainer status` joins the cluster and needs its "
            "address HOST:PORT (the head's --port, 6379 by default). On a remote cluster run it "
            "on the head: ray exec cluster.yaml 'ray-trainer status RUN_NAME'"
        )
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnreachable(f"{address!r} is not a cluster address like HOST:6379")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ClusterUnreachable(
            f"no Ray cluster reachable at {address} ({e.strerror or e})"
        ) from None


def live_run_names(named_actors: list[dict[str, str]]) -> list[str]:
    """Run names of the live callback actors, from ``ray.util.list_named_actors(True)``."""
    from ray_trainer._actor import NAMESPACE, actor_name

    prefix = actor_name("")
    return sorted(
        a["name"][len(prefix) :]
        for a in named_actors
        if a.get("namespace") == NAMESPACE and a.get("name", "").startswith(prefix)
    )


def no_live_run_message(run_name: str, address: str, live: list[str]) -> str:
    return (
        f"no live run named {run_name} on {address}; "
        f"live runs: {', '.join(live) if live else 'none'}"
    )


def fetch_status(run_name: str, address: str, timeout_s: float = STATUS_TIMEOUT_S) -> dict:
    """Ask the run's callback actor for its status. Runs in the ``ray-trainer status`` process,
    which joins the cluster as a driver for the duration of the call.

    Raises ``ClusterUnreachable`` or ``NoLiveRun`` (its message lists the live runs).
    """
    check_reachable(address)
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    from ray_trainer._actor import NAMESPACE, actor_name

    try:
        ray.init(
            address=address,
            namespace=NAMESPACE,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise ClusterUnreachable(f"cannot connect to a Ray cluster at {address}: {e}") from None
    try:
        shown = ray.get_runtime_context().gcs_address or address
        try:
            actor = ray.get_actor(actor_name(run_name), namespace=NAMESPACE)
        except ValueError:
            live = live_run_names(ray.util.list_named_actors(all_namespaces=True))
            raise NoLiveRun(no_live_run_message(run_name, shown, live)) from None
        try:
            return ray.get(actor.status.remote(), timeout=timeout_s)
        except GetTimeoutError:
            raise NoLiveRun(
                f"run {run_name} on {shown}: its callback actor did not answer within "
                f"{timeout_s:g} s (busy or restarting); try again"
            ) from None
        except RayActorError:
            live = live_run_names(ray.util.list_named_actors(all_namespaces=True))
            raise NoLiveRun(no_live_run_message(run_name, shown, live)) from None
    finally:
        ray.shutdown()


def format_status(status: dict[str, Any]) -> str:
    """A readable summary of a ``CallbackActor.status()`` dict."""

    def num(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    step = status.get("global_step")
    max_steps = status.get("max_steps")
    state = "ended" if status.get("ended") else "training"
    if status.get("restarted"):
        state += ", callback actor restarted"
    lines = [
        f"run {status.get('run_name')} ({state})",
        f"  step        {num(step, 'd')}{f'/{max_steps}' if max_steps else ''}"
        f"   epoch {num(status.get('epoch'), 'd')}"
        f"   samples {num(status.get('samples_seen'), 'd')}",
        f"  loss        {num(status.get('loss'), '.4f')}"
        f"   lr {num(status.get('learning_rate'), '.2e')}"
        f"   {num(status.get('throughput'), '.0f')} tokens/s",
    ]
    evals = status.get("evaluations") or []
    in_flight = status.get("evaluations_in_flight") or 0
    line = f"  evaluations {status.get('num_evaluations', len(evals))}"
    if in_flight:
        line += f" ({in_flight} in flight)"
    if evals:
        last = evals[-1]
        if last.get("error"):
            line += f"; last at step {last.get('step')} failed: {last['error']}"
        else:
            metrics = " ".join(
                f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                for k, v in sorted((last.get("metrics") or {}).items())
            )
            line += f"; last at step {last.get('step')}: {metrics or '(no metrics)'}"
    lines.append(line)
    errors = status.get("callback_errors") or []
    lines.append(f"  callback errors {status.get('num_callback_errors', len(errors))}")
    for err in errors:
        lines.append(
            f"    - {err.get('callback')} in {err.get('event')} at step {err.get('step')}: "
            f"{err.get('error')}"
        )
    return "\n".join(lines)


def status_main(opts: argparse.Namespace) -> int:
    """``ray-trainer status RUN_NAME [--address ADDR] [--json]``."""
    address = resolve_address(opts.address)
    try:
        status = fetch_status(opts.run_name, address, timeout_s=opts.timeout)
    except ClusterUnreachable as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except NoLiveRun as e:
        print(f"ray-trainer: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if opts.json:
        print(json.dumps(status, default=str, indent=2, sort_keys=True), flush=True)
    else:
        print(format_status(status), flush=True)
    return EXIT_OK


# ---- submit --------------------------------------------------------------------------------


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
