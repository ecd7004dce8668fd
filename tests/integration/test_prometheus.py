"""Every panel of the Grafana dashboard against a real Prometheus (issue 38).

A local Ray head with its dashboard (which writes Ray's Prometheus configuration and the
service-discovery file of its metrics endpoints), Debian's ``prometheus`` started on Ray's own
scrape configuration (a copy with a 1 s interval), and one short demo run with `RayMetrics`, an
in-loop evaluation, a save evaluated by `EvalOnSave` and ``peak_flops`` (so MFU exists on a CPU).
The run holds its last step while the test evaluates every panel's PromQL from `PANELS`
through Prometheus's HTTP API, ``$run`` substituted, the repeating panel once per evaluation
metric that its variable's query finds; each must return a series for the run. Then ``ray-trainer
grafana install`` writes the dashboard beside Ray's own in that session.

Prometheus is installed by the set-up when missing (``apt-get install prometheus``, as root),
or the test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from driver_process import outcome_in
from local_cluster import LocalCluster
from prometheus_support import Prometheus, prometheus_binary
from support_paths import SUPPORT
from waiting import wait_until

from ray_trainer._monitoring.dashboard import EVAL_QUERY, RUN_QUERY
from ray_trainer._monitoring.panels import EVAL_VARIABLE, PANELS, substitute

RUN = "promrun"
#: The panels this (SFT) run exports: GRPO's RL row is asked of a real Prometheus on
#: test_multinode.py's GRPO job, and checked against the gauges a GRPO run's logs export in
#: tests/unit/test_monitoring_panels.py.
SFT_PANELS = [p for p in PANELS if p.row is None]
#: The evaluation metrics the repeating panel must find: the in-loop one, and EvalOnSave's.
WANTED_EVALS = {"ray_trainer_eval_val_loss", "ray_trainer_eval_score"}
MAX_STEPS = 8
#: What RayMetrics must put on a real Ray 2.60 endpoint for this run (counters with `_total`).
EXPORTED = {
    "ray_trainer_step",
    "ray_trainer_loss",
    "ray_trainer_val_loss",
    "ray_trainer_learning_rate",
    "ray_trainer_tokens_per_second",
    "ray_trainer_mfu_ratio",
    "ray_trainer_grad_norm",
    "ray_trainer_save_to_eval_seconds",
    "ray_trainer_workers",
    "ray_trainer_events_handled_total",
    "ray_trainer_events_dropped_total",
    "ray_trainer_callback_errors_total",
    "ray_trainer_checkpoints_saved_total",
}


@pytest.fixture(scope="module")
def cluster():
    head = LocalCluster(num_cpus=3)
    head.start()
    try:
        yield head
    finally:
        head.stop()


def _variable_values(prometheus: Prometheus) -> tuple[list[str], list[str]]:
    """The dashboard variables as Grafana's Prometheus datasource fills them: `label_values(
    METRIC, LABEL)` is the label's values on that metric's series; `metrics(REGEX)` the metric
    names that match (Grafana tests the regex unanchored), here only those of this run."""
    metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", RUN_QUERY).groups()
    runs = prometheus.get(f"/api/v1/label/{label}/values", **{"match[]": metric})
    regex = re.fullmatch(r"metrics\((.+)\)", EVAL_QUERY).group(1)
    names = prometheus.get("/api/v1/label/__name__/values", **{"match[]": f'{{run="{RUN}"}}'})
    return runs, sorted(n for n in names if re.search(regex, n))


def _panel_queries(evals: list[str]) -> list[tuple[str, str]]:
    """(what, PromQL) of every series of every panel, for this run; a repeating panel once per
    value of its variable."""
    out = []
    for panel in SFT_PANELS:
        copies = evals if panel.repeat == EVAL_VARIABLE else [None]
        for value in copies:
            for series in panel.series:
                what = f"{panel.title} / {series.legend}" + (f" [{value}]" if value else "")
                out.append((what, substitute(series.expr, RUN, value)))
    return out


def test_every_panel_returns_the_runs_series_from_a_real_prometheus(cluster, tmp_path):
    binary = prometheus_binary()
    began = time.monotonic()
    prometheus = Prometheus(binary, cluster, str(tmp_path))
    held, release = tmp_path / "held", tmp_path / "release"
    fields = {
        "run_name": RUN,
        "storage_path": str(tmp_path / "runs"),
        "num_workers": 1,
        "max_steps": MAX_STEPS,
        "log_every_steps": 2,
        "eval_every_steps": 6,  # the in-loop evaluation: val_loss and the demo's metrics
        "save_every_steps": 6,  # EvalOnSave scores it: save_to_eval_seconds, eval_score
        "peak_flops": 1e12,  # MFU on a CPU
        "_hold": {"at": MAX_STEPS, "held": str(held), "release": str(release)},
    }
    log = tmp_path / "driver.log"  # a file, not a pipe: a held driver never blocks on output
    with open(log, "w") as out:
        driver = subprocess.Popen(
            [sys.executable, os.path.join(SUPPORT, "metrics_driver.py"), cluster.gcs_address,
             json.dumps(fields)],
            env=cluster.node_env(), stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_until(lambda: held.exists() or driver.poll() is not None, 240, "the run's last step")
        assert held.exists(), log.read_text()[-4000:]
        at_hold = time.monotonic()
        queries: list[tuple[str, str]] = []

        def every_panel_has_the_run() -> bool:
            nonlocal queries
            runs, evals = _variable_values(prometheus)
            if RUN not in runs or not set(evals) >= WANTED_EVALS:
                return False
            queries = _panel_queries(evals)
            return all(
                any(r["metric"].get("run") == RUN for r in prometheus.query(q)) for _, q in queries
            )

        try:
            wait_until(every_panel_has_the_run, 60, "every panel's series for the run", interval=1)
        except AssertionError:
            empty = [w for w, q in queries if not prometheus.query(q)]
            pytest.fail(
                f"panels without a series for {RUN}: {empty}; {_variable_values(prometheus)}"
            )
        at_series = time.monotonic()
        names = set(
            prometheus.get("/api/v1/label/__name__/values", **{"match[]": f'{{run="{RUN}"}}'})
        )
        assert names >= EXPORTED, sorted(EXPORTED - names)
        assert not {"ray_trainer_tokens_per_s", "ray_trainer_eval_seconds_after_save"} & names
        print("exported for the run:", sorted(n for n in names if n.startswith("ray_trainer_")))
        # Counters that stayed at zero exist at 0 (a panel shows a flat line, not "no data").
        errors = prometheus.query(f'ray_trainer_callback_errors_total{{run="{RUN}"}}')
        assert errors and all(float(r["value"][1]) == 0 for r in errors), errors
        dropped = prometheus.query(f'ray_trainer_events_dropped_total{{run="{RUN}"}}')
        assert {r["metric"]["event"] for r in dropped} >= {"on_log"}, dropped
        saved = prometheus.query(f'sum(ray_trainer_checkpoints_saved_total{{run="{RUN}"}})')
        assert float(saved[0]["value"][1]) >= 1, saved  # step 6 (the final save: after the hold)
        assert len(queries) >= sum(len(p.series) for p in SFT_PANELS) + 1
    finally:
        release.touch()
        try:
            driver.wait(timeout=180)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        prometheus.stop()
    ended = time.monotonic()
    print(f"held after {at_hold - began:.1f} s, every series {at_series - at_hold:.1f} s later, "
          f"the run's end {ended - at_series:.1f} s after")  # fmt: skip
    out = log.read_text()
    outcome = outcome_in(out)
    assert outcome is not None, out[-4000:]
    assert outcome["global_step"] == MAX_STEPS and outcome["callback_errors"] == [], outcome

    # The dashboard goes where this session's Grafana provisions Ray's own from.
    from ray_trainer._client import grafana

    written = grafana.install(os.path.join(cluster.temp_dir, "session_latest"))
    assert (written.parent / "default_grafana_dashboard.json").is_file()
    assert json.loads(written.read_text())["uid"] == "ray-trainer"
