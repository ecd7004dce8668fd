"""The driver lowers its embedded Ray's daemons below the training ranks (Linux)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ray_trainer._driver.priority import DAEMON_NICENESS, lower_ray_daemons

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux /proc")


def _child(*marks: str) -> subprocess.Popen:
    # The marks ride in argv, where lower_ray_daemons reads a process's command line.
    code = "import sys, time; sys.stdin.read()"
    return subprocess.Popen([sys.executable, "-c", code, *marks], stdin=subprocess.PIPE)


def test_daemons_below_the_driver_are_lowered_others_not():
    agent = _child("ray::DashboardAgent")
    raylet = _child("core/src/ray/raylet/raylet")
    try:
        changed = lower_ray_daemons()
        assert agent.pid in changed
        assert os.getpriority(os.PRIO_PROCESS, agent.pid) == DAEMON_NICENESS
        assert raylet.pid not in changed
        assert os.getpriority(os.PRIO_PROCESS, raylet.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        assert lower_ray_daemons() == []  # already lowered: nothing to change
    finally:
        for proc in (agent, raylet):
            proc.communicate(b"")
