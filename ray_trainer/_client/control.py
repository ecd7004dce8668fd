"""User's terminal, or any Python process: ask a live run to save now, or to stop cleanly.

``ray-trainer save RUN_NAME`` / ``ray-trainer stop RUN_NAME`` (and ``ray_trainer.save(...)`` /
``ray_trainer.stop(...)``) reach the run's callback actor the way ``status`` does (a dashboard
URL, a cluster address, or this process's own Ray session) and hand it the request; the actor
gives it to rank 0 in its next reply (rank 0 sends one at least every ``HEARTBEAT_S``) and every
rank acts on it at one agreed step boundary, as on a callback's request: ``save`` writes a
checkpoint and training goes on; ``stop`` saves, fires ``on_train_end`` and the run returns
with ``stopped_early`` and a ``stop_reason`` saying it came from outside. Only those who can
reach the Ray cluster can ask (the actor is the run's named actor, nothing listens elsewhere).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ray_trainer._client import status as asking
from ray_trainer._client.job_api import EXIT_NOT_FOUND, EXIT_OK, add_connection_options
from ray_trainer._contract import HEARTBEAT_S, NAMESPACE, actor_name

DEFAULT_TIMEOUT_S = 30.0


class RunEnded(LookupError):
    """The run asked for has ended: no request can act on it any more."""


def save(run_name: str, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Ask the live run ``run_name`` to write a checkpoint at its next step boundary (training
    goes on). ``address``: a dashboard URL or a cluster address (default: this process's Ray
    session when it has one, else ``RAY_ADDRESS``). Returns the request as the actor recorded
    it; raises ``LookupError`` (``NoLiveRun``, ``RunEnded``) when no live run has that name.

    Example:
        >>> ray_trainer.save("my-run", address="http://127.0.0.1:8265")
    """
    return _request("save", run_name, address, timeout)


def stop(run_name: str, address: str | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """Ask the live run ``run_name`` to stop cleanly: it saves a checkpoint at its next step
    boundary, fires ``on_train_end`` and returns (``stopped_early``; the ``stop_reason`` says it
    came from outside). Same arguments and errors as ``save``."""
    return _request("stop", run_name, address, timeout)


def _request(kind: str, run_name: str, address: str | None, timeout: float) -> dict:
    import ray

    if address is None and ray.is_initialized():  # already a driver of the run's cluster
        try:
            actor = ray.get_actor(actor_name(run_name), namespace=NAMESPACE)
        except ValueError:
            live = asking.live_run_names(ray.util.list_named_actors(all_namespaces=True))
            message = asking.no_live_run_message(run_name, "this cluster", live)
            raise asking.NoLiveRun(message) from None
        answer = ray.get(actor.request.remote(kind, f"ray_trainer.{kind}()"), timeout=timeout)
    else:
        opts = argparse.Namespace(
            run_name=run_name, address=address, timeout=timeout, headers=None, verify=None,
            reply_line=False,
        )  # fmt: skip
        reply = asking.ask(run_name, opts, kind)
        if reply["exit"] != EXIT_OK:
            raise asking.NoLiveRun(str(reply.get("error")))
        answer = reply["status"]
    if not answer["accepted"]:
        raise RunEnded(answer["message"])
    return answer


def add_parsers(sub: Any) -> None:
    """The ``save`` and ``stop`` subcommands' options (``sub``: argparse's subparsers)."""
    helps = {
        "save": "ask a live run to write a checkpoint now (training goes on)",
        "stop": "ask a live run to save and stop cleanly",
    }
    for kind, text in helps.items():
        parser = sub.add_parser(kind, help=text, description=text[0].upper() + text[1:] + ".")
        parser.add_argument("run_name", help="the run's run_name")
        add_connection_options(
            parser,
            address_help="dashboard URL http://HOST:8265, or the cluster address HOST:6379 "
            "(default: RAY_ADDRESS, then RAY_API_SERVER_ADDRESS, then auto)",
            timeout_help="seconds to reach the run (default %(default)g)",
        )
        parser.add_argument("--reply-line", action="store_true", help=argparse.SUPPRESS)
        parser.set_defaults(main=control_main, timeout=DEFAULT_TIMEOUT_S)


def control_main(opts: argparse.Namespace) -> int:
    """``ray-trainer save|stop RUN_NAME [--address URL|HOST:PORT]``: 0 when the run took the
    request, 1 when no live run has that name (or it has ended), 2/3 when the cluster cannot
    be reached (or refused the credentials)."""
    kind = opts.command
    code, answer = asking.answer(opts, kind)
    if answer is None:
        return code
    if not answer["accepted"]:
        print(f"ray-trainer: {answer['message']}", file=sys.stderr)
        return EXIT_NOT_FOUND
    what = "save a checkpoint" if kind == "save" else "save and stop"
    print(
        f"run {opts.run_name} (at step {answer['step']}) will {what} at one step boundary "
        f"within about {HEARTBEAT_S:g} s and 3 steps; follow it with: "
        f"ray-trainer status {opts.run_name}",
        flush=True,
    )
    return EXIT_OK
