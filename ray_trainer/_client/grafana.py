"""Terminal (on the Ray head node): ``ray-trainer grafana install``, the dashboard provisioned
beside Ray's own.

Ray's dashboard (``ray/dashboard/modules/metrics/metrics_head.py``), when it starts, writes
under the session folder (``/tmp/ray/session_latest``; ``RAY_METRICS_OUTPUT_ROOT`` moves the
``metrics`` folder):

* ``metrics/grafana/grafana.ini``, whose ``provisioning`` folder is
  ``session_latest/metrics/grafana/provisioning`` (start Grafana with ``--config`` that file);
* ``metrics/grafana/provisioning/dashboards/default.yml``: a file provider (folder "Ray") whose
  ``options.path`` is ``metrics/grafana/dashboards`` of that session, or
  ``RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR`` as the head saw it;
* Ray's dashboards (``default_grafana_dashboard.json``, ``train_grafana_dashboard.json``, ...)
  in that folder.

``install`` reads the provider's path from ``default.yml`` (so it follows the head's settings,
whatever this shell's environment says) and writes ``ray_trainer_grafana_dashboard.json``
there: Grafana's file provider loads it within its update interval (10 s by default), in the
"Ray" folder beside Ray's dashboards, with no restart and no clicking. Ray empties
``metrics/grafana`` each time its dashboard starts: ``install`` runs after ``ray start
--head`` (``--wait`` gives the dashboard time to write its files) and again after a restart.
``--output FILE`` writes the JSON for a Grafana of one's own (import it there).

Exit codes: 0 written, 2 no Ray session or provisioning folder (one message naming the folder
and the fix).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ray_trainer._monitoring.dashboard import dashboard_json

__all__ = ["DASHBOARD_FILE", "InstallError", "add_parser", "dashboards_folder", "install"]

#: The file name in Ray's dashboards folder (Ray names its own ``<name>_grafana_dashboard.json``).
DASHBOARD_FILE = "ray_trainer_grafana_dashboard.json"
DEFAULT_SESSION_DIR = "/tmp/ray/session_latest"
METRICS_ROOT_ENV = "RAY_METRICS_OUTPUT_ROOT"  # Ray's metrics_head reads the same variable
PROVIDER_FILE = Path("grafana", "provisioning", "dashboards", "default.yml")
EXIT_OK, EXIT_BAD_INPUT = 0, 2


class InstallError(Exception):
    """No Ray session, or one whose dashboard wrote no Grafana provisioning: says where it
    looked and what to do."""


def dashboards_folder(session_dir: str | os.PathLike[str] | None = None) -> Path:
    """The folder Ray's Grafana provisions dashboards from, for the session at `session_dir`
    (default ``/tmp/ray/session_latest``), read from Ray's provider file."""
    session = Path(session_dir or DEFAULT_SESSION_DIR).expanduser()
    root = Path(os.environ[METRICS_ROOT_ENV]) if os.environ.get(METRICS_ROOT_ENV) else None
    metrics = root or session / "metrics"
    provider = metrics / PROVIDER_FILE
    if not provider.is_file():
        raise InstallError(_missing(session, metrics, provider))
    folder = _provider_path(provider)
    if folder is None:
        raise InstallError(
            f"{provider} names no dashboards folder (providers[].options.path); Ray's "
            f"dashboard writes it when it starts: restart the head (ray stop; ray start --head)"
        )
    return Path(folder)


def install(session_dir: str | None = None, wait_s: float = 0.0) -> Path:
    """Write the dashboard into the session's provisioned dashboards folder, waiting up to
    `wait_s` for Ray's dashboard to write its provisioning (right after ``ray start``);
    returns the file written."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            folder = dashboards_folder(session_dir)
            break
        except InstallError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.5)  # polling a folder another process fills, bounded by the deadline
    folder.mkdir(parents=True, exist_ok=True)
    return _write(folder / DASHBOARD_FILE)


def write_output(path: str) -> Path:
    """``--output FILE``: the dashboard JSON for a Grafana of one's own."""
    target = Path(path).expanduser()
    if target.parent and not target.parent.is_dir():
        raise InstallError(f"--output {path}: folder {target.parent} does not exist")
    return _write(target)


def add_parser(sub: Any) -> None:
    """The ``grafana`` subcommand and its ``install`` (``sub`` is argparse's subparsers)."""
    grafana = sub.add_parser("grafana", help="the ray-trainer Grafana dashboard")
    actions = grafana.add_subparsers(dest="grafana_command", metavar="install", required=True)
    cmd = actions.add_parser(
        "install",
        help="provision the dashboard in the Grafana of the Ray session on this machine "
        "(the head node), or write its JSON with --output",
    )
    cmd.add_argument(
        "--session-dir",
        default=None,
        help=f"the Ray session folder (default {DEFAULT_SESSION_DIR}; with ray start "
        "--temp-dir T: T/session_latest)",
    )
    cmd.add_argument(
        "--output", metavar="FILE", help="write the dashboard JSON to FILE instead (to import)"
    )
    cmd.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="wait up to SECONDS for Ray's dashboard to write its Grafana files (right after "
        "ray start --head; default 0)",
    )
    cmd.set_defaults(main=install_main)


def install_main(opts: argparse.Namespace) -> int:
    """``ray-trainer grafana install [--session-dir DIR] [--output FILE] [--wait S]``."""
    try:
        if opts.output:
            path = write_output(opts.output)
            print(f"ray-trainer: wrote the dashboard to {path}; import it in Grafana "
                  "(Dashboards > New > Import), and pick your Prometheus datasource")  # fmt: skip
            return EXIT_OK
        path = install(opts.session_dir, wait_s=opts.wait)
    except (InstallError, OSError) as e:
        print(f"ray-trainer grafana install: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    print(
        f"ray-trainer: installed the dashboard as {path}; Ray's Grafana loads it within about "
        "10 s (Dashboards > Ray > ray-trainer, uid ray-trainer)",
        flush=True,
    )
    return EXIT_OK


# ---- internals ------------------------------------------------------------------------------


def _write(path: Path) -> Path:
    """Written whole into a private temp file of the target's folder (a new, unpredictable
    name, created exclusively, mode 0600 until it is complete), then renamed over the target:
    Grafana never reads half a dashboard, and a name planted in a shared folder (a symlink to
    another file) is never written through. A target that is a symlink is refused."""
    if path.is_symlink():
        raise InstallError(
            f"{path} is a symbolic link (to {os.readlink(path)}); refusing to replace it: "
            "remove it, or write elsewhere with --output FILE"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(dashboard_json())
        os.chmod(tmp, 0o644)  # Grafana (another user, often) reads it
        os.replace(tmp, path)  # atomic; replaces a name, never follows it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _provider_path(provider: Path) -> str | None:
    import yaml

    try:
        config = yaml.safe_load(provider.read_text()) or {}
    except yaml.YAMLError:
        return None
    for entry in config.get("providers") or []:
        path = (entry.get("options") or {}).get("path") if isinstance(entry, dict) else None
        if path:
            return str(path)
    return None


def _missing(session: Path, metrics: Path, provider: Path) -> str:
    if not session.exists():
        return (
            f"no Ray session at {session}: run this on the head node after `ray start --head` "
            "(or give --session-dir TEMP_DIR/session_latest for ray start --temp-dir), or write "
            "the JSON for your own Grafana with --output FILE"
        )
    return (
        f"the Ray session at {session} has no Grafana provisioning ({provider} is missing): "
        f"Ray's dashboard writes {metrics}/grafana when it starts, so start the head with the "
        "dashboard (pip install 'ray[default]'; ray start --head, without "
        "--include-dashboard=false), wait for it (--wait 60), or use --output FILE"
    )
