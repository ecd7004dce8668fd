"""Driver: a clean console, and the embedded Ray's dashboard on this machine only.

Runs in the driver. A healthy run prints no traceback, no error-level line and no Ray noise:

* the embedded local Ray is a new instance (``address="local"``), even where a ``ray start``
  cluster runs on the machine; it starts with its dashboard on 127.0.0.1 (the dashboard can
  submit jobs and run code: never on every interface), and the driver prints its URL once, with
  one line of ours about Ray's token authentication (asked of Ray) instead of Ray's own
  warning; a run that joins a cluster says which one; where the run needs more logical CPUs
  at once than the machine has cores, the embedded Ray offers them and one more line says so
  (``shared_cores_line``; nothing where the run fits the cores);
* two lines Ray itself repeats although nothing is wrong are dropped from the worker logs this
  driver prints: Ray Train's PlacementGroupCleaner retrying the state API (when the cluster has
  no dashboard), and Ray core's error-level note that an actor Ray Train creates has
  constructor arguments in the object store;
* Ray Train's print patching is off (``RAY_TRAIN_ENABLE_PRINT_PATCH=0``): a worker-side
  callback's print appears once, not twice; and its state tracking is on
  (``RAY_TRAIN_ENABLE_STATE_TRACKING=1``): the dashboard's Ray Train view shows the run (off
  where the Ray the driver uses has no dashboard, where nothing would show it);
* the embedded Ray starts its worker processes at the same priority as its own daemons
  (``RAY_worker_niceness=0``; Ray's default is 15): on a machine whose cores the training ranks
  fill, a rank at niceness 15 is preempted whenever the dashboard, its agents, the log monitor
  or the raylet wake up, and with ranks in lockstep (one all-reduce a step) every such delay
  stalls all of them (docs/benchmarks.md, "Where the time of a step goes");
* Ray Train's preemption watcher is not started on the embedded Ray: a single local node is
  never drained, and the watcher's actor process would wake up ~150 times a second during the
  steps (``RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=0`` for the processes Ray starts; a value the
  user set is kept);
* on the embedded Ray, Ray Train's controller polls its workers every 0.25 s instead of 2 s
  (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, as the tests' Rays run; a value the user set is
  kept): a checkpoint's report waits while the one before is not taken, and the run's end
  waits for a poll, so a short run ended 2-4 s later at 2 s.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: Lines Ray prints in a healthy run that say nothing is wrong (matched as substrings): each
#: about Ray's own code, nothing a user can act on.
HARMLESS_RAY_LINES = (
    # Ray Train's placement group cleaner, retrying the state API (a cluster without dashboard).
    "Failed to query Ray Train Controller actor state",
    # Ray core, about actors Ray Train creates (PreemptionWatcher).
    "has constructor arguments in the object store and max_restarts > 0",
    # Ray Train's state tracking constructs a Ray Data option Ray itself deprecated.
    "`ExecutionOptions.exclude_resources` is deprecated",
    "self.exclude_resources = exclude_resources",
)
DASHBOARD_PORTS = range(8265, 8300)
_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
_PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
_STATE_TRACKING = "RAY_TRAIN_ENABLE_STATE_TRACKING"
#: What the embedded Ray's processes start with (`start_embedded_ray`), where the user set none.
EMBEDDED_RAY_ENV = {
    # one local node is never drained: no preemption watcher actor
    _PREEMPTION_WATCHER: "0",
    # Ray Train's controller takes the workers' reports every 0.25 s, not 2 s: a worker's
    # report waits while the one before is not taken (a queue of one), and the run's end
    # waits for a poll (docs/benchmarks.md, "The controller's poll on one machine")
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
}


@contextlib.contextmanager
def ray_train_settings() -> Iterator[None]:
    """While Ray Train starts a run (it reads these in the driver and hands them on): worker
    prints once (no print patching, which copies each print into its log), and the run in the
    dashboard's Ray Train view (state tracking) where the cluster has a dashboard: without one
    nothing would show it, and its actor would poll a state API that is not there. Decided for
    each run, and gone from this process's environment after it (a process this driver starts
    later, e.g. a run of its own with a dashboard, decides again); a value the user set is kept."""
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    if _STATE_TRACKING in os.environ:  # the user's
        yield
        return
    os.environ[_STATE_TRACKING] = "1" if cluster_has_dashboard() else "0"
    try:
        yield
    finally:
        os.environ.pop(_STATE_TRACKING, None)


def cluster_has_dashboard() -> bool:
    """Whether the Ray this driver is connected to runs a dashboard (True where Ray cannot say:
    state tracking is Ray Train's own default for a cluster)."""
    try:
        from ray._private.worker import get_dashboard_url

        return bool(get_dashboard_url())
    except Exception:  # a Ray whose internals moved
        return True


def free_dashboard_port(host: str = "127.0.0.1") -> int:
    """The first free port from 8265 on (Ray's default first)."""
    for port in DASHBOARD_PORTS:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return 0  # let Ray choose


def start_embedded_ray(num_cpus: int, dashboard: bool) -> str | None:
    """Start the embedded local Ray; with its dashboard on 127.0.0.1 when `dashboard`. The
    dashboard's URL (None without one)."""
    import ray

    # address="local": a new instance of our own, even where `ray start` runs a cluster on this
    # machine (without it, ray.init joins the cluster in /tmp/ray/ray_current_cluster, which
    # refuses num_cpus). A run that means to join one gives ray_address or RAY_ADDRESS.
    options: dict[str, Any] = {
        "address": "local",
        "num_cpus": num_cpus,
        "include_dashboard": dashboard,
    }
    # Read by the raylet this starts: training ranks not below Ray's own daemons (kept if set).
    os.environ.setdefault("RAY_worker_niceness", "0")
    url = None
    if dashboard:
        port = free_dashboard_port()
        url = f"http://127.0.0.1:{port}"
        options.update(dashboard_host="127.0.0.1", dashboard_port=port)
        # The state API (Ray Train's placement group cleaner, `ray list`) finds this dashboard
        # even where another Ray runs on the machine.
        options["runtime_env"] = {"env_vars": {"RAY_API_SERVER_ADDRESS": url}}
    auth = logging.getLogger(_AUTH_LOGGER)
    level = auth.level
    auth.setLevel(logging.ERROR)  # our one line below says what Ray's warning says
    # Set for the processes Ray starts now (Ray Train's controller reads them) and gone from
    # this process after; a user's value is kept.
    ours = [k for k in EMBEDDED_RAY_ENV if k not in os.environ]
    os.environ.update({k: EMBEDDED_RAY_ENV[k] for k in ours})
    try:
        ray.init(**options)
    finally:
        auth.setLevel(level)
        for k in ours:
            del os.environ[k]
    filter_ray_noise()
    return url


def dashboard_line(url: str | None) -> str:
    """The one line the driver prints about the embedded Ray: a new local instance of its own,
    its dashboard, and whether Ray's token authentication is on (Ray's own answer)."""
    where = f"Ray dashboard at {url} (this machine only)" if url else "no Ray dashboard"
    return (
        f"ray-trainer: local Ray started (a new instance for this run); {where}; "
        f"Ray's token authentication is {token_auth()}"
    )


def shared_cores_line(cpus: float, cores: float, counts: list[tuple[str, int]]) -> str | None:
    """The line the driver prints when the embedded Ray offers more logical CPUs (`cpus`) than
    the machine has `cores`, naming what shares them (`counts`: ``[("worker", 2), ...]``);
    None when the run fits the cores."""
    if cpus <= cores:
        return None
    items = [f"{n} {noun}{'' if n == 1 else 's'}" for noun, n in counts]
    what = items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
    return (
        f"ray-trainer: the embedded Ray offers {cpus:g} logical CPUs for this run's {what}, "
        f"on {cores:g} cores: they share them"
    )


def joined_line(address: str) -> str:
    """The line the driver prints when it joins a running cluster (ray_address / RAY_ADDRESS)."""
    import ray

    where = getattr(ray.get_runtime_context(), "gcs_address", None) or address
    return (
        f"ray-trainer: joined the Ray cluster at {where} (from {address!r}); "
        f"Ray's token authentication is {token_auth()}"
    )


def token_auth() -> str:
    """``"on"`` or ``"off"``, as Ray itself decides it (after ``ray.init``: its mode may have
    been turned on by the start); ``"unknown"`` with a Ray that does not say."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:
        return "unknown"
    return "on" if is_token_auth_enabled() else "off"


def filter_ray_noise(harmless: tuple[str, ...] = HARMLESS_RAY_LINES) -> bool:
    """Drop `harmless` lines from the worker logs Ray prints in this driver; True when the
    filter is in place (False with a Ray whose log printing we do not know)."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        handlers = dispatcher.handlers
        for i, (name, handle) in enumerate(handlers):
            if name == "ray_print_logs" and not getattr(handle, "_ray_trainer_filter", False):
                handlers[i] = (name, _filtered(handle, harmless))
                _ARRIVALS.watching = True
                return True
    return False


class _Arrivals:
    """When the driver last printed output from each worker process (its pid)."""

    def __init__(self) -> None:
        self.seen: dict[Any, float] = {}
        self.changed = threading.Condition()
        self.watching = False  # only while this driver's filter sees Ray's worker output

    def note(self, pid: Any) -> None:
        with self.changed:
            self.seen[pid] = time.monotonic()
            self.changed.notify_all()

    def wait(self, pid: Any, since: float, timeout: float) -> bool:
        if not self.watching:
            return False  # output is not printed through us: nothing to wait for
        deadline = time.monotonic() + timeout
        with self.changed:
            while self.seen.get(pid, 0.0) < since:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(left)
        return True


_ARRIVALS = _Arrivals()


def wait_for_output(pid: Any, since: float, timeout: float = 3.0) -> bool:
    """Wait (at most `timeout`) until output that process `pid` wrote after `since` (a
    `time.monotonic()`) has reached this driver's console: Ray forwards worker output
    asynchronously, and a driver that exits at once loses the last lines (the actor's
    end-of-run summary)."""
    return _ARRIVALS.wait(pid, since, timeout)


def _filtered(handle: Callable[[dict], Any], harmless: tuple[str, ...]) -> Callable[[dict], Any]:
    def keep(data: dict) -> Any:
        _ARRIVALS.note(data.get("pid"))
        lines = data.get("lines") or []
        kept = [line for line in lines if not any(h in line for h in harmless)]
        if lines and not kept:
            return None
        return handle({**data, "lines": kept} if len(kept) != len(lines) else data)

    keep._ray_trainer_filter = True
    return keep
