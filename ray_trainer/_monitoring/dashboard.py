"""Anywhere (pure data): the ray-trainer Grafana dashboard, built from `PANELS`.

`build_dashboard()` returns Grafana's dashboard model as plain dicts (what Grafana's "Export"
writes and its file provisioning and "Import" read); `dashboard_json()` is its JSON. It is
generated, not checked in: one list of panels (``panels.py``) feeds the dashboard, ``ray-trainer
plot`` and the Prometheus integration test, so a query cannot differ between them.

Built as Ray builds its own provisioned dashboards (``ray/dashboard/modules/metrics/
dashboards``: plain dicts, every panel's datasource the ``${datasource}`` variable of type
``prometheus``), so that it works in the Grafana that Ray's dashboard embeds, where Ray
provisions one Prometheus datasource as the default, and in a user's own Grafana, where the
variable offers every Prometheus datasource. Variables:

* ``datasource``: the Prometheus datasource;
* ``run``: ``label_values(ray_trainer_step, run)``, multi-value with "All";
* ``eval_metric``: ``metrics(ray_trainer_eval_.+)`` (the Prometheus datasource's query for
  metric names by regex), multi-value with "All"; the evaluation panel repeats over it.

The panels of a row (`Panel.row`: GRPO's) follow the others under that row's header (a Grafana
``row`` panel), so a run of another objective leaves only that row empty.

No library: grafana-foundation-sdk (a release per Grafana version, versioned
``<timestamp>!<grafana version>``) and grafanalib (in maintenance) would be a dependency of
the package for a dict that a unit test checks against the model instead.
"""

from __future__ import annotations

import json
from typing import Any

from ray_trainer._monitoring.panels import (
    EVAL_PREFIX,
    EVAL_VARIABLE,
    PANELS,
    RUN_VARIABLE,
    Panel,
)

__all__ = ["DASHBOARD_UID", "SCHEMA_VERSION", "build_dashboard", "dashboard_json"]

#: The dashboard's stable uid: its URL is ``/d/ray-trainer``, and installing it again replaces it.
DASHBOARD_UID = "ray-trainer"
#: Grafana's dashboard schema version of this JSON (Grafana 10.4/11; older schemas are migrated
#: on load, newer Grafanas migrate this one).
SCHEMA_VERSION = 39
DATASOURCE_VARIABLE = "datasource"
#: Every panel and query reads the datasource variable, as Ray's own dashboards do.
DATASOURCE = {"type": "prometheus", "uid": f"${{{DATASOURCE_VARIABLE}}}"}
RUN_QUERY = f"label_values(ray_trainer_step, {RUN_VARIABLE})"
EVAL_QUERY = f"metrics({EVAL_PREFIX}.+)"
_WIDTH, _HEIGHT, _PER_ROW = 12, 8, 2  # Grafana's grid is 24 columns wide


def build_dashboard() -> dict[str, Any]:
    """The dashboard model: one time-series panel per `Panel`, two per row, the repeating
    panel on a row of its own, the panels of a `Panel.row` under a row panel of that title."""
    panels: list[dict[str, Any]] = []
    x, y, row = 0, 0, None
    for number, panel in enumerate(PANELS, start=1):
        if panel.row != row:  # a row panel (id after every Panel's) heads them
            row = panel.row
            y, x = y + (_HEIGHT if x else 0), 0
            panels.append(_row(len(PANELS) + len(panels) + 1, row or "Training", y))
            y += 1
        if panel.repeat and x:  # a repeating panel starts a row (its copies fill it)
            x, y = 0, y + _HEIGHT
        panels.append(_panel(number, panel, {"h": _HEIGHT, "w": _WIDTH, "x": x, "y": y}))
        x += _WIDTH
        if x >= _WIDTH * _PER_ROW or panel.repeat:
            x, y = 0, y + _HEIGHT
    return {
        "id": None,
        "uid": DASHBOARD_UID,
        "title": "ray-trainer",
        "description": "Training runs of ray-trainer (RayMetrics): progress, evaluations, "
        "callbacks, checkpoints; GRPO's rewards, completions and rollouts.",
        "tags": ["ray", "ray-trainer"],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,  # a shared crosshair: one step lines up across panels
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": _variables()},
        "panels": panels,
    }


def dashboard_json() -> str:
    """The dashboard as the JSON Grafana imports or provisions from a file."""
    return json.dumps(build_dashboard(), indent=2) + "\n"


def _row(number: int, title: str, y: int) -> dict[str, Any]:
    """A Grafana row: the full-width header of the panels under it (open, so they show)."""
    grid = {"h": 1, "w": _WIDTH * _PER_ROW, "x": 0, "y": y}
    return {"id": number, "type": "row", "title": title, "collapsed": False, "gridPos": grid,
            "panels": []}  # fmt: skip


def _panel(number: int, panel: Panel, grid: dict[str, int]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": number,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": grid,
        "fieldConfig": {
            "defaults": {"unit": panel.unit, "custom": {"lineWidth": 2, "spanNulls": True}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "none"},
        },
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DATASOURCE,
                "expr": series.expr,
                "legendFormat": _legend(series.legend),
                "range": True,
            }
            for i, series in enumerate(panel.series)
        ],
    }
    if panel.repeat:
        out.update(repeat=panel.repeat, repeatDirection="h", maxPerRow=_PER_ROW)
    return out


def _legend(legend: str) -> str:
    """A series' legend, with the run in front when it has no label of its own: with several
    runs selected, each line says which run it is."""
    return legend if legend.startswith("{{") else f"{{{{run}}}} {legend}"


def _variables() -> list[dict[str, Any]]:
    return [
        {
            "name": DATASOURCE_VARIABLE,
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "hide": 0,
            "current": {},
            "refresh": 1,
        },
        _query_variable(RUN_VARIABLE, "Run", RUN_QUERY, "The run_name of a ray-trainer run."),
        _query_variable(
            EVAL_VARIABLE,
            "Evaluation metric",
            EVAL_QUERY,
            "The evaluation metrics (ray_trainer_eval_*): one panel each.",
        ),
    ]


def _query_variable(name: str, label: str, query: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "query",
        "datasource": DATASOURCE,
        "definition": query,
        "query": {"query": query, "refId": "StandardVariableQuery"},
        "refresh": 2,  # on every time-range change: a new run appears without a reload
        "multi": True,
        "includeAll": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
        "hide": 0,
        "regex": "",
        "options": [],
    }
