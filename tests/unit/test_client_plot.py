"""`ray-trainer plot`: every panel drawn from a metrics.jsonl or from a (canned) Prometheus,
the evaluation panel repeated per metric, GRPO's panels (the reward curve: ``reward`` and each
``rewards/<fn>/mean``) for a GRPO run only, and one clear line with exit 2 on bad input."""

from __future__ import annotations

import json
import math
import re
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ray_trainer._client import plot
from ray_trainer._monitoring.panels import PANELS, RL_ROW
from ray_trainer.cli import main

pytest.importorskip("matplotlib")

EVAL_TITLE = next(p.title for p in PANELS if p.repeat)
OTHER_TITLES = [p.title for p in PANELS if not p.repeat and p.row is None]
RL_TITLES = [p.title for p in PANELS if p.row == RL_ROW]


def write_run(folder, records):
    folder.mkdir(parents=True)
    lines = "".join(json.dumps(r) + "\n" for r in records)
    (folder / "metrics.jsonl").write_text(lines + '{"event": "on_log", "st')  # a cut last line
    return folder


def demo_records():
    records, t0 = [], 1_767_225_600.0
    for step in range(10, 110, 10):
        records.append(
            {"event": "on_log", "step": step, "epoch": 0, "time": t0 + step, "loss": 3 - step / 50,
             "learning_rate": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0 + step,
             "samples_seen": step * 8, "tokens_seen": step * 64, "mfu": None, "world_size": 2}
        )  # fmt: skip
        if step % 50 == 0:
            records.append({"event": "on_save", "step": step, "checkpoint_path": f"/c/{step}"})
            records.append(
                {"event": "on_evaluate", "step": step, "loss": 1.0,
                 "val_metrics": {"val_loss": 2.0 - step / 100, "exact_match": step / 100}}
            )  # fmt: skip
    # EvalOnSave results, with their save-to-result times; step 50's late, out of order.
    for step, value, after in ((100, 0.9, 3.0), (50, "nan", 12.5)):
        records.append(
            {"event": "on_evaluate", "step": step, "val_metrics": {"exact_match": value},
             "checkpoint_path": f"/c/{step}", "seconds_after_save": after}
        )  # fmt: skip
    return records


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def titles(fig):
    return [ax.get_title() for ax in fig.axes if ax.get_visible()]


def test_every_panel_from_metrics_jsonl_into_a_png(tmp_path, capsys):
    write_run(tmp_path / "runs" / "demo-1", demo_records())
    out = tmp_path / "panels.png"
    argv = ["plot", "demo-1", "--storage-path", str(tmp_path / "runs"), "-o", str(out)]
    assert main([*argv, "--dpi", "40"]) == 0
    assert str(out) in capsys.readouterr().out
    # 9 panels + the evaluation panel once per metric (2) = 11 frames: 4 rows of 3, 40 dpi.
    assert png_size(out) == (plot.COLUMNS * 4.0 * 40, round((4 * 2.6 + 0.4) * 40))

    # Default output: panels.png in the run's folder; a run folder works as RUN too.
    assert main(["plot", str(tmp_path / "runs" / "demo-1"), "--dpi", "20"]) == 0
    png_size(tmp_path / "runs" / "demo-1" / "panels.png")


def test_frames_titled_as_the_panels_with_the_evaluation_panel_repeated():
    frames = plot.frames_from_jsonl(demo_records())
    fig = plot.draw(frames, "run demo-1", dpi=20)
    evals = [EVAL_TITLE.replace("$eval_metric", n) for n in ("val_loss", "exact_match")]
    assert titles(fig) == OTHER_TITLES[:6] + evals + OTHER_TITLES[6:]
    by_title = {f.title: f for f in frames}

    assert [line.legend for line in by_title["Loss"].lines] == ["loss", "validation loss"]
    assert by_title["Loss"].lines[1].ys == [1.5, 1.0]  # val_loss from val_metrics
    in_loop, after_save = by_title[evals[1]].lines  # EvalOnSave's results drawn apart
    assert (in_loop.legend, in_loop.xs, in_loop.ys) == ("exact_match", [50, 100], [0.5, 1.0])
    assert after_save.legend == "exact_match (EvalOnSave)" and after_save.xs == [50, 100]
    assert math.isnan(after_save.ys[0]) and after_save.ys[1] == 0.9  # "nan" read; by step
    assert by_title["Save to evaluation result"].lines[0].ys == [12.5, 3.0]
    assert by_title["Checkpoints saved"].lines[0].ys == [1.0, 2.0]  # on_save lines counted
    assert by_title["Workers"].lines[0].ys == [2.0] * 10
    assert by_title["Step"].lines[0].xs[:2] == [0.0, 10 / 60]  # against minutes
    # No data: drawn with a note, never dropped.
    assert by_title["MFU"].lines == []
    assert by_title["MFU"].note == "mfu: null in every record of metrics.jsonl"  # a CPU run
    events = fig.axes[[f.title for f in frames].index("Callback events")]
    assert [t.get_text() for t in events.texts] == [plot.PROMETHEUS_ONLY]


def grpo_records():
    """An asynchronous GRPO run's logs: TRL's metric names, two reward functions, no KL (beta
    0), the rollout queue's."""
    return [
        {"event": "on_log", "step": step, "time": 1_767_225_600.0 + step, "loss": 0.01,
         "learning_rate": 1e-3, "reward": 0.2 + step / 100, "reward_std": 0.3,
         "rewards/exact/mean": step / 100, "rewards/exact/std": 0.4,
         "rewards/brevity/mean": 0.2, "rewards/brevity/std": 0.1,
         "completions/mean_length": 7.5, "completions/clipped_ratio": 0.25,
         "rollout/tokens_per_s": 300.0, "rollout/seconds": 0.4, "reward/seconds": 0.05,
         "sync/seconds": 0.1, "rollout/logprob_diff": 0.0, "rollout/queue_depth": 1.0,
         "rollout/stale_dropped": 0.0, "rollout/age_min": 1.0, "rollout/age_mean": 1.0,
         "rollout/age_max": 1.0, "rollout/wait_seconds": 0.01, "rollout/overlap_seconds": 0.3}
        for step in (1, 2, 3)
    ]  # fmt: skip


def test_a_grpo_run_draws_the_reward_curve_and_the_rl_panels(tmp_path):
    frames = {f.title: f for f in plot.frames_from_jsonl(grpo_records())}
    assert set(RL_TITLES) <= set(frames)
    reward = frames["Reward"]
    assert [line.legend for line in reward.lines] == [
        "reward", "reward std", "rewards/brevity/mean", "rewards/exact/mean"
    ]  # fmt: skip
    assert reward.lines[0].xs == [1, 2, 3] and reward.lines[0].ys == pytest.approx(
        [0.21, 0.22, 0.23]
    )
    assert reward.lines[3].ys == pytest.approx([0.01, 0.02, 0.03])
    timings = frames["Rollout, reward and sync seconds"]
    assert [line.legend for line in timings.lines] == ["rollout", "reward", "sync"]
    assert frames["Truncated completions"].lines[0].ys == [0.25] * 3
    assert frames["KL"].lines == [] and frames["KL"].note == "no kl in metrics.jsonl"
    # The PNG: the training panels, the evaluation note and the 7 RL panels.
    write_run(tmp_path / "runs" / "grpo-1", grpo_records())
    out = tmp_path / "p.png"
    assert main(["plot", str(tmp_path / "runs" / "grpo-1"), "-o", str(out), "--dpi", "20"]) == 0
    count = len(OTHER_TITLES) + 1 + len(RL_TITLES)
    assert png_size(out)[1] == round((math.ceil(count / plot.COLUMNS) * 2.6 + 0.4) * 20)


def test_an_sft_run_draws_no_rl_panel():
    assert not {f.title for f in plot.frames_from_jsonl(demo_records())} & set(RL_TITLES)


# ---- Prometheus ---------------------------------------------------------------------------


class CannedPrometheus(BaseHTTPRequestHandler):
    """Answers query_range with two points per series and the label API with eval names."""

    queries: list[dict[str, list[str]]] = []
    answer_status = 200
    empty = False
    no_series_for: tuple[str, ...] = ()  # queries naming one of these: no series

    def do_GET(self):  # http.server calls do_<METHOD>
        url = urllib.parse.urlparse(self.path)
        params = urllib.parse.parse_qs(url.query)
        self.queries.append({"path": [url.path], **params})
        now = time.time()
        if self.answer_status != 200:
            body = {"status": "error", "errorType": "bad_data", "error": "parse error at char 3"}
        elif url.path == "/api/v1/label/__name__/values":
            names = ["ray_trainer_eval_accuracy", "ray_trainer_eval_val_loss"]
            body = {"status": "success", "data": names}
        else:
            metric = {"run": "r1", "event": "on_log"}
            values = [[now - 60, "1.5"], [now - 30, "2.5"]]
            query = params.get("query", [""])[0]
            none = self.empty or any(n in query for n in self.no_series_for)
            result = [] if none else [{"metric": metric, "values": values}]
            body = {"status": "success", "data": {"resultType": "matrix", "result": result}}
        data = json.dumps(body).encode()
        self.send_response(self.answer_status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def prometheus():
    handler = type("Handler", (CannedPrometheus,), {"queries": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_prometheus_queries_have_the_run_and_the_lines_carry_their_values(prometheus):
    handler, url = prometheus
    prom = plot.Prometheus(url)
    end = time.time()
    frames = plot.frames_from_prometheus(prom, "r1", end - 3600, end)
    fig = plot.draw(frames, "r1", dpi=20)

    ranged = [q for q in handler.queries if q["path"] == ["/api/v1/query_range"]]
    sent = [q["query"][0] for q in ranged]
    assert sent and all("$" not in q and 'run=~"r1"' in q for q in sent)
    # The span was found first (the step series over --since), then asked at a finer step.
    assert sent[0] == 'ray_trainer_step{run=~"r1"}' and float(ranged[0]["step"][0]) == 12
    assert float(ranged[1]["end"][0]) - float(ranged[1]["start"][0]) <= 30 + 3 * 12
    [names] = [q for q in handler.queries if q["path"] == ["/api/v1/label/__name__/values"]]
    assert names["match[]"] == ['{__name__=~"ray_trainer_eval_.+", run=~"r1"}']
    assert '{__name__=~"ray_trainer_eval_accuracy", run=~"r1"}' in sent

    evals = [EVAL_TITLE.replace("$eval_metric", n) for n in ("accuracy", "val_loss")]
    assert titles(fig) == OTHER_TITLES[:6] + evals + OTHER_TITLES[6:] + RL_TITLES
    for ax in fig.axes[: len(frames)]:
        for line in ax.get_lines():
            assert list(line.get_ydata()) == [1.5, 2.5]
    events = {f.title: f for f in frames}["Callback events"]
    legends = [line.legend for line in events.lines]
    assert legends == ["handled on_log", "dropped on_log", "callback errors"]
    accuracy = {f.title: f for f in frames}[evals[0]]
    assert accuracy.lines[0].legend == "ray_trainer_eval_accuracy"


def test_prometheus_leaves_out_the_rl_panels_of_a_run_without_their_series(prometheus):
    handler, url = prometheus
    rl = {
        n for p in PANELS if p.row for s in p.series for n in re.findall(r"ray_trainer_\w+", s.expr)
    }
    handler.no_series_for = tuple(rl)
    end = time.time()
    frames = plot.frames_from_prometheus(plot.Prometheus(url), "r1", end - 3600, end)
    assert not {f.title for f in frames} & set(RL_TITLES)
    assert {f.title for f in frames} >= set(OTHER_TITLES)


def test_prometheus_png_goes_to_the_working_folder_by_default(prometheus, tmp_path, monkeypatch):
    _, url = prometheus
    monkeypatch.chdir(tmp_path)
    assert main(["plot", "r1", "--prometheus", url, "--since", "2h", "--dpi", "20"]) == 0
    png_size(tmp_path / "r1-panels.png")


def test_a_run_name_is_matched_exactly():
    assert plot.substitute('x{run=~"$run"}', "a.b") == r'x{run=~"a\\.b"}'


def test_prometheus_errors_name_the_url_and_the_fix(prometheus, tmp_path, capsys):
    handler, url = prometheus
    handler.empty = True
    assert main(["plot", "r9", "--prometheus", url, "-o", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err
    assert f"Prometheus at {url} has no ray_trainer_step series for run 'r9'" in err
    assert "--since" in err and err.count("\n") == 1

    handler.answer_status = 400
    assert main(["plot", "r1", "--prometheus", url]) == 2
    assert "parse error at char 3" in capsys.readouterr().err

    assert main(["plot", "r1", "--prometheus", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach Prometheus at http://127.0.0.1:9" in err and "--prometheus" in err
    assert main(["plot", "r1", "--prometheus", "localhost:9090"]) == 2
    assert "expected a URL such as http://HOST:9090" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


# ---- metrics.jsonl errors -----------------------------------------------------------------


def test_unknown_run_or_missing_file_is_one_line_with_exit_2(tmp_path, capsys):
    write_run(tmp_path / "runs" / "demo-1", demo_records())
    assert main(["plot", "demo-2", "--storage-path", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "runs" / "demo-2" / "metrics.jsonl") in err
    assert "runs with one under" in err and "demo-1" in err and "--storage-path" in err

    assert main(["plot", str(tmp_path / "nowhere" / "metrics.jsonl")]) == 2
    assert f"{tmp_path}/nowhere/metrics.jsonl does not exist" in capsys.readouterr().err

    (tmp_path / "runs" / "empty").mkdir()
    (tmp_path / "runs" / "empty" / "metrics.jsonl").write_text("")
    assert main(["plot", str(tmp_path / "runs" / "empty")]) == 2
    assert "holds no records yet" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "-1h", "1w", "h"])
def test_since_takes_a_duration(text):
    with pytest.raises(Exception, match="duration"):
        plot.parse_duration(text)
    assert plot.parse_duration("30m") == 1800 and plot.parse_duration("2d") == 172800


def test_the_docs_list_every_panel_and_its_metric_names():
    text = (Path(__file__).parents[2] / "docs" / "operating.md").read_text()
    assert "![" in text and "(img/panels.png)" in text
    for panel in PANELS:
        assert f"| {panel.title.split(':')[0]}" in text, panel.title
        for series in panel.series:
            for name in re.findall(r"ray_trainer_\w+", series.expr):
                assert f"`{name}" in text, name
