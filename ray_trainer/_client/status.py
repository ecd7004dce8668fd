"""User's terminal: ``ray-trainer status``, asked of the run's callback actor.

Runs in the user's terminal, never inside a run. The question itself (``--reply-line``) is
asked by a one-shot process beside the cluster, which prints one reply line:

* with a dashboard URL (``http(s)://``, the address ``submit`` uses), that process is a tiny
  Ray job, ``ray-trainer status RUN --reply-line``: it runs on the head, next to the actor, and
  this process reads its reply from the job's logs through the job API. Nothing joins the
  cluster from the laptop (no ``ray.init``, no same-Python rule, no open GCS port).
* with a cluster (GCS) address ``HOST:PORT`` (or ``auto`` on a cluster node), it is a child
  process that joins the cluster as a short-lived driver (``ray.init``); it is killed when
  ``--timeout`` runs out, so a GCS that never answers cannot hang ``status``.

Either way the query finds the run's callback actor by name (``actor_name(run_name)`` in
``NAMESPACE``, see ``_contract.py``) and asks it for its ``status()`` snapshot. It never
touches the training workers: the actor answers between two event batches.

Exit codes: 0 the status, 1 no such live run (the live runs are listed), 2 bad input or no
cluster answering within ``--timeout``, 3 the cluster refused the credentials.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import secrets
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ray_trainer._client.job_api import (
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    DashboardError,
    add_connection_options,
    connect,
    is_dashboard_url,
    job_api,
    parse_headers,
    parse_verify,
)
from ray_trainer._contract import NAMESPACE, actor_name, run_name_of_actor

#: How long the actor may take to answer (capped by what is left of ``--timeout``).
ACTOR_ANSWER_S = 10.0
REPLY_MARKER = "ray-trainer-status-reply: "
_TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class ClusterUnreachable(RuntimeError):
    """No Ray cluster answers at the given address."""


class NoLiveRun(LookupError):
    """No callback actor of that run is alive on the cluster (or it did not answer)."""


def resolve_address(address: str | None) -> str:
    """The cluster to query: ``--address``, else ``RAY_ADDRESS``, else the dashboard URL in
    ``RAY_API_SERVER_ADDRESS``, else ``"auto"``."""
    return (
        address
        or os.environ.get("RAY_ADDRESS")
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or "auto"
    )


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast, before ``ray.init`` waits for a GCS that is not there. ``"auto"`` and
    ``ray://`` addresses are left to ``ray.init``."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnreachable(
            f"{address!r} is neither a dashboard URL http://HOST:8265 nor a cluster address "
            "HOST:6379"
        )
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


def fetch_status(
    run_name: str, address: str, timeout_s: float = ACTOR_ANSWER_S, question: str = "status"
) -> dict:
    """Ask the run's callback actor: its status, or (``question`` ``"save"``/``"stop"``) to
    take a request from outside. Runs in the one-shot query process, which joins the cluster as
    a driver for the duration of the call.

    Raises ``ClusterUnreachable`` or ``NoLiveRun`` (its message lists the live runs).
    """
    if is_dashboard_url(address):
        raise ClusterUnreachable(f"{address}: the query process needs the cluster address")
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
            if question == "status":
                return ray.get(actor.status.remote(), timeout=timeout_s)
            source = f"ray-trainer {question}"
            return ray.get(actor.request.remote(question, source), timeout=timeout_s)
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


# ---- the reply: one line from the query process ---------------------------------------------


def query_reply(
    run_name: str, address: str, timeout_s: float, question: str = "status"
) -> dict[str, Any]:
    """Run the query here (the one-shot process) and put its outcome in a reply dict:
    ``{"exit": 0, "status": {...}}`` or ``{"exit": 1|2, "error": "..."}``."""
    try:
        if question == "status":
            return {"exit": EXIT_OK, "status": fetch_status(run_name, address, timeout_s)}
        answer = fetch_status(run_name, address, timeout_s, question=question)
        return {"exit": EXIT_OK, "status": answer}
    except NoLiveRun as e:
        return {"exit": EXIT_NOT_FOUND, "error": str(e)}
    except ClusterUnreachable as e:
        return {"exit": EXIT_ERROR, "error": str(e)}


def parse_reply(text: str, where: str) -> dict[str, Any]:
    """The reply line in a query process's output; ``DashboardError`` with the output's end
    when there is none (e.g. ``ray-trainer`` is not installed where the query ran)."""
    for line in reversed(text.splitlines()):
        if line.startswith(REPLY_MARKER):
            try:
                return json.loads(line[len(REPLY_MARKER) :])
            except json.JSONDecodeError as e:
                raise DashboardError(f"{where} gave a garbled status reply ({e})") from None
    tail = "\n".join(text.strip().splitlines()[-15:]) or "(no output)"
    raise DashboardError(f"{where} gave no status reply; its output ends with:\n{tail}")


def ask_in_subprocess(
    run_name: str, address: str, timeout_s: float, question: str = "status"
) -> dict[str, Any]:
    """The query in a child process that joins the cluster at the GCS ``address``; killed
    when ``timeout_s`` runs out (``ray.init`` has no bound of its own)."""
    check_reachable(address)
    answer_s = min(ACTOR_ANSWER_S, max(1.0, timeout_s - 2.0))
    cmd = [sys.executable, "-m", "ray_trainer.cli", question, run_name, "--address", address]
    cmd += ["--timeout", f"{answer_s:g}", "--reply-line"]
    # Started where this ray_trainer was imported from: `-m` puts the working dir first on
    # sys.path, and a user's own `callbacks.py` there must not shadow the package.
    home = Path(__file__).resolve().parents[2]
    child = subprocess.Popen(
        cmd, cwd=home, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise ClusterUnreachable(
            f"no answer from the Ray cluster at {address} within {timeout_s:g} s (--timeout): "
            "joining it (ray.init) and asking the run's actor did not finish. Check that it is "
            "the head's GCS address (ray start --port, 6379 by default), or use the dashboard "
            "URL http://HOST:8265"
        ) from None
    return parse_reply(out, f"the status query for {address}")


def ask_through_job(
    run_name: str, address: str, opts: argparse.Namespace, question: str = "status"
) -> dict[str, Any]:
    """The query as a tiny Ray job on the head, through the dashboard's job API; the whole
    exchange is bounded by ``--timeout`` (the job is stopped when it runs out)."""
    deadline = time.monotonic() + opts.timeout
    headers, verify = parse_headers(opts.headers), parse_verify(opts.verify)
    client = connect(address, headers, verify, opts.timeout)
    answer_s = min(ACTOR_ANSWER_S, max(1.0, deadline - time.monotonic() - 2.0))
    words = ["ray-trainer", question, run_name, "--timeout", f"{answer_s:g}", "--reply-line"]
    job_id = f"ray-trainer-{question}-{run_name}-{secrets.token_hex(3)}"
    with job_api(address, "asking the run's status"):
        client.submit_job(
            entrypoint=shlex.join(words),
            submission_id=job_id,
            metadata={"ray_trainer_status": run_name},
        )
        while str(client.get_job_status(job_id).value) not in _TERMINAL:
            if time.monotonic() > deadline:
                client.stop_job(job_id)
                raise DashboardError(
                    f"the status job {job_id} on {address} did not finish within "
                    f"{opts.timeout:g} s (--timeout); the head may be busy: try a larger "
                    f"--timeout, or see `ray job logs --address {address} {job_id}`"
                )
            time.sleep(0.25)
        logs = client.get_job_logs(job_id)
    with contextlib.suppress(Exception):  # a leftover status job is harmless
        client.delete_job(job_id)  # keep the dashboard's job list for runs
    return parse_reply(logs, f"the status job {job_id} on {address}")


def ask(run_name: str, opts: argparse.Namespace, question: str = "status") -> dict[str, Any]:
    """Ask the run's actor through whichever address ``opts`` gives (or, with
    ``--reply-line``, here); the reply dict. Raises ``DashboardError``/``ClusterUnreachable``."""
    if opts.reply_line:
        address = opts.address or os.environ.get("RAY_ADDRESS") or "auto"
        return query_reply(run_name, address, opts.timeout, question)
    address = resolve_address(opts.address)
    extra = () if question == "status" else (question,)
    if is_dashboard_url(address):
        return ask_through_job(run_name, address.rstrip("/"), opts, *extra)
    return ask_in_subprocess(run_name, address, opts.timeout, *extra)


def answer(opts: argparse.Namespace, question: str) -> tuple[int, dict[str, Any] | None]:
    """The exit code and the actor's answer for a command; errors printed here. With
    ``--reply-line`` (the one-shot process) the reply line is printed instead."""
    try:
        reply = ask(opts.run_name, opts, question)
    except DashboardError as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return e.exit_code, None
    except ClusterUnreachable as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_ERROR, None
    if opts.reply_line:
        print(REPLY_MARKER + json.dumps(reply, default=str), flush=True)
        return EXIT_OK, None
    if reply["exit"] != EXIT_OK:
        prefix = "ray-trainer: " if reply["exit"] == EXIT_NOT_FOUND else "ray-trainer: error: "
        print(prefix + str(reply.get("error")), file=sys.stderr)
        return int(reply["exit"]), None
    return EXIT_OK, reply["status"]


def format_workers(status: dict[str, Any]) -> list[str]:
    """The worker count, and its changes when an elastic run lost or regained workers."""
    sizes = status.get("worker_sizes") or []
    if not sizes:
        return []
    line = f"  workers     {sizes[-1]['world_size']} (attempt {sizes[-1]['attempt']})"
    counts = [s["world_size"] for s in sizes]
    changes = [c for i, c in enumerate(counts) if i == 0 or counts[i - 1] != c]
    if len(changes) > 1:
        line += "; sizes " + " -> ".join(str(c) for c in changes)
    return [line]


def format_objective_metrics(own: dict[str, Any], per_line: int = 4) -> list[str]:
    """The lines under the loss of the objective's metrics of the last log (DPO's and GRPO's
    are TRL's): GRPO's reward first, on a line of its own with its std, each reward
    function's mean and the rollout engines serving; then the others, sorted, `per_line` a
    line."""
    rest = {k: v for k, v in own.items() if isinstance(v, (int, float))}
    lines = []
    if "reward" in rest:  # GRPO: the reward of the last log, then each function's mean
        parts = [f"reward      {rest.pop('reward'):.4f}"]
        if "reward_std" in rest:
            parts.append(f"std {rest.pop('reward_std'):.4f}")
        for name in sorted(rest):
            fn = re.fullmatch(r"rewards/(.+)/mean", name)
            if fn:
                parts.append(f"{fn.group(1)} {rest.pop(name):.4f}")
        if "rollout/engines" in rest:  # the rollout engines serving at the last log
            parts.append(f"engines {rest.pop('rollout/engines'):g}")
        lines.append("  " + "   ".join(parts))
    names = sorted(rest)
    for at in range(0, len(names), per_line):
        chunk = names[at : at + per_line]
        lines.append("  " + "   ".join(f"{k} {rest[k]:.4f}" for k in chunk))
    return lines


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
    lines += format_objective_metrics(status.get("objective_metrics") or {})
    lines += format_workers(status)
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
            after = last.get("seconds_after_save")
            late = "" if after is None else f" ({after:.1f} s after its save)"
            line += f"; last at step {last.get('step')}{late}: {metrics or '(no metrics)'}"
    lines.append(line)
    lines += format_checkpoints(status)
    request = status.get("last_request")
    if request:
        lines.append("  last request " + format_request(request))
    errors = status.get("callback_errors") or []
    lines.append(f"  callback errors {status.get('num_callback_errors', len(errors))}")
    for err in errors:
        lines.append(
            f"    - {err.get('callback')} in {err.get('event')} at step {err.get('step')}: "
            f"{err.get('error')}"
        )
    return "\n".join(lines)


def format_request(request: dict[str, Any]) -> str:
    """One line: what was asked from outside, when, and when it took effect."""
    asked = _clock(request.get("requested_at"))
    text = f"{request.get('kind')} ({request.get('source')}) at {asked}"
    if request.get("took_effect_at"):
        took = _clock(request["took_effect_at"])
        text += f", took effect at step {request.get('took_effect_at_step')} ({took})"
    elif request.get("delivered_at"):
        text += ", agreed by the workers, acting at the next boundaries"
    else:
        text += ", on its way to the workers"
    return text


def _clock(stamp: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(stamp)) if stamp else "-"


def add_parser(sub: Any) -> None:
    """The ``status`` subcommand's options (``sub`` is argparse's subparsers object)."""
    status = sub.add_parser("status", help="progress of a live run on a Ray cluster")
    status.add_argument("run_name", help="the run's run_name")
    add_connection_options(
        status,
        address_help="dashboard URL http://HOST:8265 (as for submit), or the cluster address "
        "HOST:6379 (default: RAY_ADDRESS, then RAY_API_SERVER_ADDRESS, then auto)",
        timeout_help="seconds for the whole query (default %(default)g)",
    )
    status.add_argument("--json", action="store_true", help="print the status dict as JSON")
    # The one-shot query process: ask here (ray.init) and print one reply line.
    status.add_argument("--reply-line", action="store_true", help=argparse.SUPPRESS)
    status.set_defaults(main=status_main)


def status_main(opts: argparse.Namespace) -> int:
    """``ray-trainer status RUN_NAME [--address URL|HOST:PORT] [--json]``."""
    code, status = answer(opts, "status")
    if status is None:
        return code
    if opts.json:
        print(json.dumps(status, default=str, indent=2, sort_keys=True), flush=True)
    else:
        print(format_status(status), flush=True)
    return EXIT_OK


def format_checkpoints(status: dict[str, Any]) -> list[str]:
    """The best checkpoint and each checkpoint's evaluations (best first when ranked)."""
    rows, ranked_by = status.get("checkpoints") or [], status.get("ranked_by")
    lines = []
    if ranked_by:
        best = status.get("best_checkpoint")
        value = (status.get("best_metrics") or {}).get(ranked_by)
        shown = f"{best} ({ranked_by} {_metric(value)})" if best else "none scored yet"
        lines.append(f"  best        {shown}")
    if rows:
        order = f", best first by {ranked_by} ({status.get('order')})" if ranked_by else ""
        lines.append(f"  checkpoints {status.get('num_checkpoints', len(rows))}{order}")
    for row in rows:
        name = str(row.get("name") or row.get("checkpoint_path", "")).rsplit("/", 1)[-1]
        metrics = ", ".join(f"{k} {_metric(v)}" for k, v in sorted(row["metrics"].items()))
        state = " (evaluating)" if row.get("evaluating") else ""
        state += f" ({row['failures']} failed)" if row.get("failures") else ""
        lines.append(f"    {name}  step {row.get('step')}{state}: {metrics or '-'}")
    return lines


def _metric(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
