"""The Grafana dashboard: its JSON against Grafana's dashboard model, and against `PANELS`; an
objective's panels (GRPO's RL row) under a row of their own."""

from __future__ import annotations

import json
import re

from ray_trainer._monitoring.dashboard import (
    DASHBOARD_UID,
    EVAL_QUERY,
    RUN_QUERY,
    build_dashboard,
    dashboard_json,
)
from ray_trainer._monitoring.panels import EVAL_VARIABLE, PANELS, RL_ROW, RUN_VARIABLE

GRID_COLUMNS = 24  # Grafana's grid


def _charts(board):
    """The board's panels that draw (not its row headers)."""
    return [p for p in board["panels"] if p["type"] != "row"]


def _variables(board):
    return {v["name"]: v for v in board["templating"]["list"]}


def test_the_json_is_the_dashboard_model_with_a_stable_uid():
    board = json.loads(dashboard_json())
    assert board == build_dashboard()
    assert board["uid"] == DASHBOARD_UID == "ray-trainer"
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 27
    assert board["title"] and board["id"] is None  # Grafana assigns ids on import
    assert isinstance(board["panels"], list) and isinstance(board["templating"]["list"], list)


def test_panels_have_unique_ids_and_grid_places_that_do_not_overlap():
    panels = build_dashboard()["panels"]
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids)
    cells = set()
    for p in panels:
        grid = p["gridPos"]
        assert set(grid) == {"h", "w", "x", "y"} and all(isinstance(v, int) for v in grid.values())
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0
        assert grid["x"] + grid["w"] <= GRID_COLUMNS, p["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine


def test_every_panel_queries_prometheus_through_the_datasource_variable():
    board = build_dashboard()
    assert len(_charts(board)) == len(PANELS)
    for panel, spec in zip(_charts(board), PANELS, strict=True):
        assert panel["title"] == spec.title and panel["type"] == "timeseries"
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["fieldConfig"]["defaults"]["unit"] == spec.unit
        targets = panel["targets"]
        assert [t["expr"] for t in targets] == [s.expr for s in spec.series]
        refs = [t["refId"] for t in targets]
        assert len(set(refs)) == len(refs) and all(re.fullmatch(r"[A-Z]", r) for r in refs)
        for target in targets:
            assert target["datasource"] == panel["datasource"]
            assert f'run=~"${RUN_VARIABLE}"' in target["expr"], target["expr"]


def test_variables_datasource_run_and_eval_metric():
    variables = _variables(build_dashboard())
    assert list(variables) == ["datasource", RUN_VARIABLE, EVAL_VARIABLE]
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    run, evals = variables[RUN_VARIABLE], variables[EVAL_VARIABLE]
    assert run["query"]["query"] == run["definition"] == RUN_QUERY
    assert RUN_QUERY == "label_values(ray_trainer_step, run)"
    assert evals["query"]["query"] == evals["definition"] == EVAL_QUERY
    for variable in (run, evals):
        assert variable["type"] == "query" and variable["multi"] and variable["includeAll"]
        assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # metrics(REGEX): the evaluation metrics, and not the seconds from save to evaluation.
    regex = re.fullmatch(r"metrics\((.+)\)", EVAL_QUERY).group(1)
    assert re.fullmatch(regex, "ray_trainer_eval_accuracy")
    assert re.fullmatch(regex, "ray_trainer_eval_val_loss")
    assert not re.search(regex, "ray_trainer_save_to_eval_seconds")


def test_one_panel_repeats_over_the_eval_metric_and_every_variable_used_is_defined():
    board = build_dashboard()
    repeating = [p for p in board["panels"] if p.get("repeat")]
    assert [p["repeat"] for p in repeating] == [EVAL_VARIABLE]
    assert repeating[0]["repeatDirection"] in ("h", "v")
    defined = set(_variables(board))
    used = set()
    for panel in _charts(board):
        text = panel["title"] + " ".join(t["expr"] for t in panel["targets"])
        used |= set(re.findall(r"\$(\w+)", text))
    assert used <= defined, used - defined
    assert EVAL_VARIABLE in used and RUN_VARIABLE in used


def test_the_rl_panels_sit_under_a_row_of_their_own_after_the_others():
    panels = build_dashboard()["panels"]
    rows = [p for p in panels if p["type"] == "row"]
    assert [r["title"] for r in rows] == [RL_ROW]
    row = rows[0]
    assert row["collapsed"] is False and row["panels"] == []  # open: its panels follow it
    assert row["gridPos"] == {"h": 1, "w": GRID_COLUMNS, "x": 0, "y": row["gridPos"]["y"]}
    under = panels[panels.index(row) + 1 :]
    grpo = [p.title for p in PANELS if p.row == RL_ROW]
    assert [p["title"] for p in under] == grpo and len(grpo) >= 7
    above = panels[: panels.index(row)]
    assert all(p["gridPos"]["y"] < row["gridPos"]["y"] for p in above)
    assert all(p["gridPos"]["y"] > row["gridPos"]["y"] for p in under)
    assert {"Reward", "Completion length", "Truncated completions", "KL", "Rollout tokens/s",
            "Rollout, reward and sync seconds", "Engine against trainer log-probs"} <= set(grpo)  # fmt: skip
