"""User's terminal: the dashboard's job API, reached in bounded time, its refusals made clear.

Runs in the user's terminal (``ray-trainer submit`` and ``ray-trainer status``), never inside a
run. Both commands talk to a cluster only through the dashboard's HTTP job API
(``JobSubmissionClient``), as ``ray job submit`` does: no ``ray.init`` on the laptop. This module
holds what they share: the address rules, the ``--headers`` / ``--verify`` / ``--timeout``
options, a probe of the dashboard bounded by ``--timeout``, and the translation of the client's
errors into one message and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
from collections.abc import Iterator
from typing import Any

#: Exit codes of ``submit`` and ``status``: 0 ok / job SUCCEEDED, 1 no such live run / job did
#: not succeed, 2 bad input or cluster unreachable, 3 the cluster refused the credentials.
EXIT_OK, EXIT_NOT_FOUND, EXIT_ERROR, EXIT_AUTH = 0, 1, 2, 3
DEFAULT_TIMEOUT_S = 30.0
DASHBOARD_PORT = 8265
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception): ")


class DashboardError(RuntimeError):
    """The job API cannot be used: a wrong address, no answer in time, a refused request."""

    exit_code = EXIT_ERROR


class AuthRefused(DashboardError):
    """The cluster answered 401/403: credentials missing or wrong."""

    exit_code = EXIT_AUTH


def is_dashboard_url(address: str) -> bool:
    return address.startswith(("http://", "https://"))


def not_a_dashboard_message(address: str) -> str:
    """What to say for an address without ``http(s)://``: most often the GCS address."""
    scheme, sep, rest = address.rpartition("://")
    host = (rest.rsplit(":", 1)[0] if ":" in rest else rest) or "HOST"
    what = (
        f"a {scheme}:// address"
        if sep
        else "the cluster's GCS address (the head's `ray start --port`, 6379 by default)"
    )
    return (
        f"{address} is {what}, not the dashboard, whose job API submit and status use: pass "
        f"the dashboard URL --address http://{host}:{DASHBOARD_PORT} (after `ray dashboard "
        f"cluster.yaml`, http://127.0.0.1:{DASHBOARD_PORT})"
    )


def dashboard_address(address: str | None) -> str:
    """The dashboard URL: ``--address``, else ``RAY_API_SERVER_ADDRESS``, else an ``http``
    ``RAY_ADDRESS`` (as ``ray job submit`` reads them). Anything but ``http(s)://`` is refused
    at once, with the dashboard URL to use instead."""
    env = os.environ.get("RAY_ADDRESS", "")
    found = (
        address
        or os.environ.get("RAY_API_SERVER_ADDRESS")
        or (env if is_dashboard_url(env) else None)
    )
    if not found:
        raise DashboardError(
            f"no dashboard address: pass --address http://HOST:{DASHBOARD_PORT} (after "
            f"`ray dashboard cluster.yaml`, http://127.0.0.1:{DASHBOARD_PORT})"
        )
    if not is_dashboard_url(found):
        raise DashboardError(not_a_dashboard_message(found))
    return found.rstrip("/")


def parse_headers(text: str | None) -> dict[str, Any] | None:
    """``--headers JSON``, else ``RAY_JOB_HEADERS`` (as ``ray job submit`` reads it)."""
    source = "--headers"
    if text is None:
        text, source = os.environ.get("RAY_JOB_HEADERS"), "RAY_JOB_HEADERS"
    if text is None:
        return None
    try:
        headers = json.loads(text)
    except json.JSONDecodeError as e:
        raise DashboardError(
            f"{source}: not JSON ({e}); pass an object, e.g. "
            '\'{"Authorization": "Bearer TOKEN"}\''
        ) from None
    if not isinstance(headers, dict):
        raise DashboardError(f"{source}: expected a JSON object of headers, got {text!r}")
    return headers


def parse_verify(text: str | None) -> bool | str:
    """``--verify``: ``true`` (default) / ``false``, or the path of a CA bundle (file or
    folder) that signed the dashboard's TLS certificate."""
    if text is None or text.lower() in ("true", "yes", "1"):
        return True
    if text.lower() in ("false", "no", "0"):
        return False
    if not os.path.exists(text):
        raise DashboardError(
            f"--verify {text!r}: no such CA bundle; pass true, false or the path of the "
            "cluster's CA certificate"
        )
    return text


def add_connection_options(parser: argparse.ArgumentParser, address_help: str, timeout_help: str):
    """``--address``, ``--headers``, ``--verify``, ``--timeout``: how to reach the job API."""
    parser.add_argument("--address", default=None, help=address_help)
    parser.add_argument(
        "--headers",
        default=None,
        metavar="JSON",
        help="HTTP headers for the job API, e.g. an Authorization token (default: RAY_JOB_HEADERS)",
    )
    parser.add_argument(
        "--verify",
        default=None,
        metavar="TRUE|FALSE|CA_BUNDLE",
        help="check the dashboard's TLS certificate (default true), or trust this CA bundle",
    )
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help=timeout_help)


def auth_message(address: str, status: int, body: str) -> str:
    what = "authentication required" if status == 401 else "authentication failed"
    detail = (body or "").strip().splitlines()
    return (
        f"the cluster refused the request: {what} (HTTP {status} from {address}"
        f"{': ' + detail[0][:200] if detail else ''}). Pass the credentials it expects: "
        '--headers \'{"Authorization": "Bearer TOKEN"}\' or the same JSON in RAY_JOB_HEADERS '
        "(as `ray job submit` reads it)"
    )


def probe(address: str, headers: dict | None, verify: bool | str, timeout_s: float) -> str:
    """Ask the dashboard for its Ray version, within ``timeout_s``; the version, or
    ``DashboardError`` / ``AuthRefused`` saying what is wrong and what to do."""
    import requests

    reach = (
        f"check the address (the dashboard, http://HEAD:{DASHBOARD_PORT}) and that `ray "
        "dashboard cluster.yaml` is running"
    )
    try:
        r = requests.get(
            f"{address}/api/version", headers=headers or {}, verify=verify, timeout=timeout_s
        )
    except requests.exceptions.SSLError as e:
        raise DashboardError(
            f"TLS with the dashboard at {address} failed ({_first_line(e)}); pass --verify "
            "CA_BUNDLE (the cluster's CA certificate), or --verify false to skip the check"
        ) from None
    except requests.exceptions.Timeout:
        raise DashboardError(
            f"no answer from the Ray dashboard at {address} within {timeout_s:g} s "
            f"(--timeout); {reach}"
        ) from None
    except requests.exceptions.RequestException as e:
        raise DashboardError(
            f"cannot reach the Ray dashboard at {address} ({_first_line(e)}); {reach}"
        ) from None
    if r.status_code in (401, 403):
        raise AuthRefused(auth_message(address, r.status_code, r.text))
    try:
        return str(r.json()["ray_version"])
    except (ValueError, KeyError, TypeError):
        raise DashboardError(
            f"{address} answered HTTP {r.status_code} to /api/version, not as a Ray dashboard "
            f"does; {reach}"
        ) from None


def connect(address: str, headers: dict | None, verify: bool | str, timeout_s: float) -> Any:
    """A ``JobSubmissionClient`` for ``address``, after a bounded probe of the dashboard."""
    probe(address, headers, verify, timeout_s)
    from ray.job_submission import JobSubmissionClient

    with job_api(address, "connecting to the job API"), _only_this_address(address):
        return JobSubmissionClient(address, headers=headers, verify=verify)


@contextlib.contextmanager
def _only_this_address(address: str) -> Iterator[None]:
    """``JobSubmissionClient`` prefers ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS`` to its
    argument; make both name the address we resolved for the client's construction."""
    saved = {k: os.environ.get(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")}
    os.environ["RAY_API_SERVER_ADDRESS"] = address
    os.environ.pop("RAY_ADDRESS", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def job_api(address: str, action: str) -> Iterator[None]:
    """Turn whatever the job client raises into one ``DashboardError`` (``AuthRefused`` for
    401/403) that names the address and the action."""
    try:
        yield
    except DashboardError:
        raise
    except Exception as e:  # AuthenticationError, RuntimeError("Request failed..."), OSError
        raise explain(e, address, action) from None


def explain(e: BaseException, address: str, action: str) -> DashboardError:
    """One message for an error of the job client (Ray's ``AuthenticationError`` says
    "Authentication required" for a 401, "Authentication failed" for a 403)."""
    text = str(e)
    if "status code 403" in text or text.startswith("Authentication failed"):
        return AuthRefused(auth_message(address, 403, _first_line(e)))
    if type(e).__name__ == "AuthenticationError" or "status code 401" in text:
        return AuthRefused(auth_message(address, 401, _first_line(e)))
    return DashboardError(f"{action} at {address} failed: {_first_line(e)}")


def _first_line(e: BaseException | str) -> str:
    """The gist of an error: its first line or, after a server's traceback, the last line
    that names an exception (``ValueError: ...``)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    if "Traceback" in lines[0]:
        named = [line for line in lines if _ERROR_LINE.match(line)]
        return (named[-1] if named else lines[-1])[:300]
    return lines[0][:300]
