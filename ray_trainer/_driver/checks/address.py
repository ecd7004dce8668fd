"""Driver: the cluster a run joins (``ray_address`` / ``RAY_ADDRESS``), checked before ``ray.init``.

Runs in the driver, after the inputs' checks and before the run folder is written
(`check_cluster_address`; `ray.init` comes after the run's lease): the address's form
(``RAY_ADDRESS`` too, which `TrainingArgs` does not see; ``ray_address`` was checked when the
args were built) and, for a ``host:port`` or ``ray://host:port`` address, a TCP connection to
it that must answer within :data:`CONNECT_TIMEOUT_S`. Without it an address where nothing
answers (a stopped head node, a firewall, a host that drops packets) left `ray.init` retrying its
GCS connection for minutes, with warnings and no error. ``auto`` and ``local`` are left to Ray,
which answers them at once.
"""

from __future__ import annotations

import os
import socket
import sys

from ray_trainer._config.rules import address_host_port, ray_address
from ray_trainer._errors import TrainingArgsError

#: How long the cluster's address has to accept a TCP connection before the run is refused.
CONNECT_TIMEOUT_S = 10.0


def check_cluster_address(given: str | None) -> None:
    """Refuse the cluster a run would join (`given`: its ``ray_address``) when ``RAY_ADDRESS``
    is not an address, or the address does not answer (:func:`check_reachable`). Nothing is
    checked where this process has Ray running already (the run uses it, as `ray.init` is
    not called again)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return
    joining = cluster_address(given)
    if joining is not None:
        check_reachable(*joining)


def cluster_address(given: str | None) -> tuple[str, str] | None:
    """The address the run joins and where it comes from (``ray_address``, else the
    ``RAY_ADDRESS`` variable), checked; None: no address, an embedded local Ray."""
    if given:
        return given, "ray_address"
    env = os.environ.get("RAY_ADDRESS")
    if not env:
        return None
    try:
        ray_address(env, "RAY_ADDRESS")
    except ValueError as e:
        raise TrainingArgsError(str(e)) from None
    return env, "RAY_ADDRESS"


def check_reachable(address: str, name: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a ``host:port`` (or ``ray://host:port``) `address` that does not accept a TCP
    connection within `timeout_s` (`name`: the field or variable it came from, named in the
    error with the fix). ``auto`` and ``local`` are not probed."""
    target = address_host_port(address)
    if target is None:
        return
    host, port = target
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except socket.gaierror:
        why = f"the host {host!r} is not known here (no such name)"
    except TimeoutError:
        why = f"nothing answered within {timeout_s:g} s"
    except OSError as e:  # refused, unreachable
        why = f"the connection failed ({e.strerror or e})"
    client = address.startswith("ray://")
    server = "the Ray Client server (port 10001 by default)" if client else "its GCS"
    raise TrainingArgsError(
        f"{name}={address!r}: {why}, so no Ray cluster can be joined there; check that the "
        f"cluster is up (`ray status` on its head node) and that this machine reaches "
        f"{server} at {host}:{port} (the address `ray start --head` printed), or unset {name} "
        "to train on an embedded local Ray"
    )


__all__ = ["CONNECT_TIMEOUT_S", "check_cluster_address", "check_reachable", "cluster_address"]
