"""Driver: the embedded Ray's background daemons run below the training ranks' priority.

Runs in the driver, once, right after it started an embedded local Ray (never for a cluster it
joins: those processes are not its own). On a machine whose cores the training ranks fill, every
wake-up of the dashboard, its head modules, the dashboard and runtime-env agents, the log monitor
and the autoscaler monitor takes a core from a rank, and the ranks wait for each other at every
step's all-reduce (docs/benchmarks.md, "Where the time of a step goes"). Raising those daemons'
niceness (any process may lower its own children's priority) lets them run when a rank waits
instead. The GCS and the raylet keep theirs: the run's scheduling and health checks go through
them, and the raylet starts the workers.
"""

from __future__ import annotations

import os

#: Niceness of the embedded Ray's background daemons (the ranks run at 0).
DAEMON_NICENESS = 10
#: Command-line marks of the daemons that are lowered (GCS and raylet are not among them).
_DAEMONS = (
    "dashboard/dashboard.py",
    "ray-dashboard-",  # the dashboard's head modules (its subprocesses)
    "ray::DashboardAgent",
    "dashboard/agent.py",
    "ray::RuntimeEnvAgent",
    "runtime_env/agent",
    "_private/log_monitor.py",
    "autoscaler/_private/monitor.py",
)


def lower_ray_daemons(niceness: int = DAEMON_NICENESS) -> list[int]:
    """Raise the niceness of this driver's embedded Ray's daemons to `niceness`; the pids
    changed. Linux only; a process that is gone or cannot be changed is skipped."""
    if not os.path.isdir("/proc") or not hasattr(os, "setpriority"):
        return []
    tree = _descendants(os.getpid())
    changed = []
    for pid, cmdline in tree.items():
        if not any(mark in cmdline for mark in _DAEMONS):
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, pid) < niceness:
                os.setpriority(os.PRIO_PROCESS, pid, niceness)
                changed.append(pid)
        except OSError:
            continue
    return changed


def _descendants(root: int) -> dict[int, str]:
    """Every process below `root`: pid -> command line."""
    parents: dict[int, int] = {}
    cmdlines: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        parents[int(entry)] = ppid
        cmdlines[int(entry)] = cmdline
    below: dict[int, str] = {}
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier and pid not in below}
        below.update({pid: cmdlines[pid] for pid in frontier})
    return below
