"""A run's driver as its own process on a test cluster: `node_loss_driver.py`, started, waited
for, and its ``OUTCOME`` line read back; or any driver script of `tests/support` given a
scenario, run to its end (`scenario_outcome`).

The pytest process (or a benchmark's) never joins the test cluster: it holds the shared embedded
Ray session, or none. Every wait is bounded and fails with the driver's output.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from s3_server import _free_port
from support_paths import SUPPORT, pythonpath
from waiting import wait_until


def embedded_env() -> dict[str, str]:
    """The environment of a driver that starts its own local Ray beside this test session's
    (`ray-trainer demo`, a guide's snippet): ports of its own where Ray's are fixed, metrics
    reported every second, no address of another cluster."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    env.update(
        PYTHONPATH=pythonpath(env=env),
        AUTOSCALER_METRIC_PORT=str(_free_port()),
        DASHBOARD_METRIC_PORT=str(_free_port()),
        RAY_metrics_report_interval_ms="1000",
    )
    return env


def start_driver(
    cluster: Any, fields: dict[str, Any], env: dict[str, str] | None = None,
    script: str = "node_loss_driver.py",
):  # fmt: skip
    """`script` (`node_loss_driver.py`, or another driver of `tests/support` that takes the same
    arguments) joined to `cluster` (a `LocalCluster`) with these run `fields` (and its
    test-only ``_`` fields); stdout and stderr together, as text."""
    return subprocess.Popen(
        [sys.executable, os.path.join(SUPPORT, script), cluster.gcs_address, json.dumps(fields)],
        env=cluster.env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def wait_for_run(driver, reached: Callable[[], bool], what: str, timeout_s: float = 180) -> None:
    """Until `reached()`; if the driver exits or the time runs out first, fail with its output."""
    import pytest

    with contextlib.suppress(AssertionError):  # judged below, with the driver's output
        wait_until(lambda: reached() or driver.poll() is not None, timeout_s, what, interval=0.2)
    if not reached():
        pytest.fail(stuck(driver, f"the run never reached {what}"))


def stuck(driver, headline: str) -> str:
    """A stuck driver's failure message: `headline`, the tail of what the driver printed (its
    workers' logs and waits) and its Ray Train processes' stacks, taken before the kill."""
    stacks = train_stacks()
    driver.kill()
    out, _ = driver.communicate()  # the rest of its output (a timed-out communicate keeps it)
    return f"{headline}:\n{out[-4000:]}\n{stacks}"


def train_stacks(limit: int = 12000) -> str:
    """The Python stacks (py-spy) of this machine's Ray Train processes (workers and
    controllers of every test cluster): what a hang's message shows."""
    py_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    found = subprocess.run(["pgrep", "-f", "ray::(RayTrainWorker|TrainController)"],
                           capture_output=True, text=True)  # fmt: skip
    dumps = []
    for pid in found.stdout.split():
        try:
            dump = subprocess.run([py_spy, "dump", "--pid", pid], capture_output=True,
                                  text=True, timeout=20)  # fmt: skip
            dumps.append(dump.stdout or dump.stderr)
        except (OSError, subprocess.TimeoutExpired) as e:
            dumps.append(f"{pid}: no stack ({e})")
    if not dumps:
        dumps.append("(no RayTrainWorker or TrainController process found)")
    return ("stacks of the Ray Train processes:\n" + "\n".join(dumps))[:limit]


def driver_outcome(driver, after: str, timeout_s: float = 240) -> tuple[dict[str, Any], str]:
    """The driver's OUTCOME line (a JSON object) and its whole output, once it exits; a driver
    still running after `timeout_s` is killed and the test fails, naming `after`."""
    import pytest

    try:
        out, _ = driver.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(stuck(driver, f"the run hung after {after}"))
    found = outcome_in(out)
    assert found is not None, out[-4000:]
    return found, out


def scenario_outcome(
    script: str, address: str, scenario: dict[str, Any], env: dict[str, str], cwd: Any,
    timeout_s: float = 600,
) -> Any:  # fmt: skip
    """Run ``python tests/support/SCRIPT ADDRESS SCENARIO_JSON`` (in `cwd`, with `env` over this
    process's environment) to its end; the JSON of its ``OUTCOME`` line. Fails with the
    driver's output when it printed none."""
    done = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, script), address, json.dumps(scenario)],
        env={**os.environ, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    found = outcome_in(done.stdout)
    assert found is not None, f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return found


def outcome_in(output: str) -> Any:
    """The JSON value a driver printed after ``OUTCOME `` in `output`; None when it printed none.

    Ray forwards the job's worker logs to the driver's stdout from a thread of its own, and
    `print` writes its text and its newline in two calls: a forwarded line can land on the same
    line, after the JSON (or before the marker). The value is read from the marker to its own
    end, whatever follows it.
    """
    for line in output.splitlines():
        at = line.find("OUTCOME ")
        if at >= 0:
            value, _ = json.JSONDecoder().raw_decode(line[at + len("OUTCOME ") :])
            return value
    return None
