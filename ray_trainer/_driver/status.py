"""User's terminal (a driver of its own): ``ray-trainer status``, asked of the run's actor.

Runs in the user's terminal, in a process of its own, never inside a run. It joins the cluster as
a short-lived Ray driver (``ray.init(address)``), finds the run's callback actor by name
(``actor_name(run_name)`` in ``NAMESPACE``, see ``_contract.py``) and asks it for its
``status()`` snapshot, with a timeout. It never touches the training workers: the actor answers
between two event batches.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from typing import Any

from ray_trainer._contract import NAMESPACE, actor_name, run_name_of_actor

#: Exit codes: 0 ok / job SUCCEEDED, 1 no such live run / job did not succeed,
#: 2 bad input or no cluster reachable.
EXIT_OK, EXIT_NOT_FOUND, EXIT_ERROR = 0, 1, 2
STATUS_TIMEOUT_S = 10.0


class ClusterUnreachable(RuntimeError):
    """No Ray cluster answers at the given address."""


class NoLiveRun(LookupError):
    """No callback actor of that run is alive on the cluster (or it did not answer)."""


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
    names = (run_name_of_actor(a.get("name", "")) for a in named_actors)
    return sorted(
        name
        for a, name in zip(named_actors, names, strict=True)
        if a.get("namespace") == NAMESPACE and name is not None
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


def add_parser(sub: Any) -> None:
    """The ``status`` subcommand's options (``sub`` is argparse's subparsers object)."""
    status = sub.add_parser("status", help="progress of a live run on a Ray cluster")
    status.add_argument("run_name", help="the run's run_name")
    status.add_argument(
        "--address",
        default=None,
        help="cluster address HOST:PORT (default: RAY_ADDRESS, else auto)",
    )
    status.add_argument("--json", action="store_true", help="print the status dict as JSON")
    status.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the run")
    status.set_defaults(main=status_main)


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
