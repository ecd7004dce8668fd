"""`ray-trainer submit` and `ray-trainer status` against a real local Ray cluster.

The cluster is a separate Ray instance (`ray start --head` on 127.0.0.2, see `local_cluster`):
this module never calls `ray.init` in the pytest process; the commands run as subprocesses,
as a user runs them from a terminal. `status` is asked both ways while the submitted run is
live: through the cluster (GCS) address, and through the dashboard URL that `submit` uses (a
tiny Ray job on the head). Every wait is bounded and says what it waited for.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import urllib.request

import pytest
import yaml
from local_cluster import LocalCluster
from waiting import wait_until

RUN = "cluster-demo"
MAX_STEPS = 100  # ~5-15 s of training here: long enough to catch the run live with `status`
JOB_TIMEOUT_S = 180  # the job: runtime env, driver, Train start (~15-40 s on a loaded box), run
STATUS_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def cluster():
    head = LocalCluster(num_cpus=4)
    head.start(timeout_s=120)
    try:
        yield head
    finally:
        head.stop()


def _cli(cluster: LocalCluster, *args: str, timeout: float = STATUS_TIMEOUT_S):
    return subprocess.run(
        [sys.executable, "-m", "ray_trainer.cli", *args],
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=timeout,
    )


class _DashboardStatus(threading.Thread):
    """Asks `ray-trainer status RUN --address DASHBOARD_URL --json` again and again, as a laptop
    would, until one answer shows the run live or `stop` is set; keeps every answer."""

    def __init__(self, cluster: LocalCluster, run: str) -> None:
        super().__init__(daemon=True)
        self.cluster, self.run_name = cluster, run
        self.answers: list[subprocess.CompletedProcess] = []
        self.live: dict | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.live is None:
            # A status job on the head (a process that starts, imports and joins the cluster):
            # on 2 loaded cores it can take more than the default 30 s, which exits 2 (timeout).
            done = _cli(
                self.cluster,
                *("status", self.run_name, "--address", self.cluster.dashboard_url, "--json"),
                *("--timeout", str(STATUS_TIMEOUT_S)),
                timeout=STATUS_TIMEOUT_S + 30,
            )
            self.answers.append(done)
            if done.returncode == 0:
                self.live = json.loads(done.stdout)
            self.stop.wait(0.5)


class _MetricsWatcher(threading.Thread):
    """Polls the head's Prometheus endpoint and keeps the `ray_trainer_*` lines of one run."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.tag = url, f'run="{run}"'
        self.lines: dict[str, str] = {}  # metric name -> the first line seen
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("ray_trainer_") and self.tag in line:
                    self.lines.setdefault(line.split("{", 1)[0], line)
            self.stop.wait(0.5)


def test_submit_wait_while_status_and_metrics_follow_the_run(cluster, tmp_path):
    workdir = tmp_path / "job"
    workdir.mkdir()
    config = workdir / "demo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "num_workers": 2,
                "max_steps": MAX_STEPS,
                "log_every_steps": 10,
                "storage_path": str(tmp_path / "runs"),
                "run_name": RUN,
                "callbacks": [{"class": "callbacks:RayMetrics", "report_every_s": 1.0}],
            }
        )
    )
    metrics = _MetricsWatcher(cluster.metrics_url, RUN)
    metrics.start()
    remote = _DashboardStatus(cluster, RUN)
    remote.start()
    submit = subprocess.Popen(
        [
            *(sys.executable, "-m", "ray_trainer.cli", "submit", str(config)),
            *("--address", cluster.dashboard_url, "--working-dir", str(workdir), "--wait"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=cluster.env(),
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(submit.stdout), daemon=True)
    reader.start()

    # While the job runs: ask `ray-trainer status` until it reports the live run past step 0.
    live: dict | None = None
    polls: list[str] = []

    def job_ended() -> bool:
        nonlocal live
        if live is None:
            done = _cli(cluster, "status", RUN, "--address", cluster.gcs_address, "--json")
            polls.append(f"rc={done.returncode} {done.stderr.strip()[-200:]}")
            if done.returncode == 0:
                status = json.loads(done.stdout)
                if (status.get("global_step") or 0) > 0:
                    live = status
        return submit.poll() is not None

    with contextlib.suppress(AssertionError):  # judged below, with the job's output
        wait_until(job_ended, JOB_TIMEOUT_S, "the job to end", interval=0.5)
    if submit.poll() is None:
        submit.kill()
        reader.join(10)
        pytest.fail(
            f"`ray-trainer submit --wait` still running after {JOB_TIMEOUT_S} s; "
            f"its output:\n{''.join(output)[-4000:]}"
        )
    reader.join(30)
    remote.stop.set()
    remote.join(STATUS_TIMEOUT_S + 40)
    # Counters outlive the run on the endpoint; gauges lapse ~2 report intervals after it.
    with contextlib.suppress(AssertionError):  # judged below
        wait_until(lambda: metrics.lines, 20, "the run's metrics", interval=0.5)
    metrics.stop.set()
    metrics.join(10)

    out = "".join(output)
    assert submit.returncode == 0, f"submit exited {submit.returncode}:\n{out[-4000:]}"
    job_id = re.search(r"submitted job (\S+) \(run cluster-demo\)", out)
    assert job_id, f"no job id in the submit output:\n{out[-4000:]}"
    assert f"ray job logs --follow --address {cluster.dashboard_url} {job_id[1]}" in out
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in out, f"no final progress line:\n{out[-4000:]}"
    assert f"job {job_id[1]} SUCCEEDED" in out

    assert live is not None, (
        f"`ray-trainer status {RUN}` never saw the run live past step 0 "
        f"({len(polls)} polls; last: {polls[-3:]})"
    )
    assert live["run_name"] == RUN and 0 < live["global_step"] <= MAX_STEPS
    assert live["num_callback_errors"] == 0, live["callback_errors"]

    # Through the dashboard URL: the same status, from a job on the head; before the actor
    # exists (or after it ended) the answer is "no live run" (1), never an error.
    tried = [f"rc={a.returncode} {a.stderr.strip()[-300:]}" for a in remote.answers]
    assert remote.live is not None, (
        f"status over {cluster.dashboard_url} never saw the run: {tried}"
    )
    assert remote.live["run_name"] == RUN and remote.live["num_callback_errors"] == 0
    for answer in remote.answers:
        assert answer.returncode in (0, 1), tried
        assert answer.returncode == 0 or f"no live run named {RUN}" in answer.stderr, tried

    # The job got nothing it did not ask for (no dashboard URL of the laptop in its env).
    with urllib.request.urlopen(f"{cluster.dashboard_url}/api/jobs/{RUN}", timeout=10) as r:
        runtime_env = json.loads(r.read())["runtime_env"]
    assert "env_vars" not in runtime_env, runtime_env

    # The run name is the job's submission id: a second job of the same run is refused.
    again = _cli(
        cluster,
        "submit",
        str(config),
        "--address",
        cluster.dashboard_url,
        "--no-wait",
        "--working-dir",
        str(workdir),
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"already has a job {RUN}" in again.stderr and "Traceback" not in again.stderr

    assert metrics.lines, f"no ray_trainer_* line for run {RUN} at {cluster.metrics_url}"
    assert {"ray_trainer_step", "ray_trainer_loss"} & set(metrics.lines), (
        f"no training gauge seen while the run was live; seen: {sorted(metrics.lines)}"
    )


@pytest.mark.parametrize("how", ["gcs", "dashboard"])
def test_status_of_an_unknown_run_exits_1_and_lists_live_runs(cluster, how):
    address = cluster.gcs_address if how == "gcs" else cluster.dashboard_url
    done = _cli(cluster, "status", "no-such-run", "--address", address)
    assert done.returncode == 1, done.stderr
    # The query runs beside the cluster either way and names the cluster it asked.
    assert f"no live run named no-such-run on {cluster.gcs_address}; live runs:" in done.stderr
