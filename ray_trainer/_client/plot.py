"""Terminal (or anywhere): ``ray-trainer plot RUN``, a run's panels drawn into one PNG.

The panels are `PANELS` (``panels.py``), the ones the Grafana dashboard shows, drawn with
matplotlib (its Agg canvas: no display, no pyplot state) for those without Grafana and for the
docs. Two sources:

* the run's ``metrics.jsonl`` (``JsonlLogger``), the default: each `Series`' ``jsonl`` field
  of the records of its ``event``, against the step. A field that holds no number (the
  ``checkpoint_path`` of ``on_save`` records) is counted: the running count of records with it,
  as a ``_total`` counter counts. Prometheus-only series (``jsonl`` None) are left out, and a
  panel left with nothing says so in its frame;
* Prometheus (``--prometheus http://HOST:9090``): each `Series`' PromQL with ``$run``
  substituted, through ``/api/v1/query_range``, against time. The run's span is found first
  (its ``ray_trainer_step`` series over ``--since``), then every panel is asked over that span.

The evaluation panel repeats: one frame per evaluation metric (the ``val_metrics`` keys of the
``on_evaluate`` records; in Prometheus, the ``ray_trainer_eval_*`` names that carry the run).
A row's panels (GRPO's RL row: the reward curve, with a line for ``reward`` and one per
``rewards/<fn>/mean``, completions, rollout timings) are drawn for a run that has any of their
data, and left out of the others'.

Exit codes: 0 the PNG was written, 2 bad input (no such run or file, Prometheus unreachable or
without the run, matplotlib missing): one line naming the path or URL and the fix.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ray_trainer._monitoring.panels import (
    EVAL_PREFIX,
    EVAL_VARIABLE,
    PANELS,
    RUN_VARIABLE,
    Panel,
    jsonl_fields,
    promql_string,
    substitute,
)
from ray_trainer._storage import Location, is_uri, locate

__all__ = [
    "Frame",
    "Line",
    "PlotError",
    "add_parser",
    "draw",
    "frames_from_jsonl",
    "frames_from_prometheus",
    "plot_main",
]

EXIT_OK, EXIT_INPUT = 0, 2
#: Frames per row of the picture.
COLUMNS = 3
PROMETHEUS_ONLY = "no data in metrics.jsonl (Prometheus only)"


class PlotError(RuntimeError):
    """Bad input for ``ray-trainer plot``: its message is the one line the user sees."""


@dataclass
class Line:
    """One drawn line: x (steps, or datetimes for Prometheus) and y."""

    legend: str
    xs: list[Any]
    ys: list[float]


@dataclass
class Frame:
    """One subplot: a panel (a repeated panel gives one frame per value), its lines, and the
    note drawn in its frame when it has none."""

    title: str
    unit: str
    lines: list[Line] = field(default_factory=list)
    note: str = ""
    x_label: str = "step"


# ---- from metrics.jsonl -------------------------------------------------------------------


def find_metrics(run: str, storage_path: str) -> Location:
    """The ``metrics.jsonl`` of ``run``: a metrics.jsonl file, a run folder, or a run name
    under ``storage_path`` (local or a bucket URI). Raises ``PlotError`` naming where it looked."""
    if is_uri(run) or "/" in run or os.sep in run or run.endswith(".jsonl"):
        given = locate(run)
        found = given.child("metrics.jsonl") if given.is_dir() else given
        if not found.exists():
            raise PlotError(
                f"{found.name} does not exist: pass a run folder that holds a metrics.jsonl "
                "(the run needs a JsonlLogger), a metrics.jsonl file, or use --prometheus"
            )
        return found
    storage = locate(storage_path)
    found = storage.child(run, "metrics.jsonl")
    if found.exists():
        return found
    runs = [n for n in storage.listdir() if storage.child(n, "metrics.jsonl").exists()]
    shown = (", ".join(runs[:10]) + (" ..." if len(runs) > 10 else "")) if runs else "none"
    raise PlotError(
        f"no metrics.jsonl for run {run!r}: {found.name} does not exist (runs with one under "
        f"{storage.name}: {shown}); pass --storage-path (the run's storage_path), a run "
        "folder or a metrics.jsonl file"
    )


def read_records(location: Location) -> list[dict[str, Any]]:
    """The JSON records of a metrics.jsonl; lines that do not parse are skipped."""
    records = []
    for line in (location.read_text() or "").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    if not records:
        raise PlotError(f"{location.name} holds no records yet: try again after the first log")
    return records


def _number(value: Any) -> float | None:
    """A record's value as a float (``"nan"``/``"inf"`` as JsonlLogger writes them); None for
    what is no number."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value in ("nan", "inf", "-inf"):
        return float(value)
    return None


def _field(record: dict[str, Any], name: str) -> Any:
    """A record's field, or (``val_loss`` of an ``on_evaluate`` record) its val_metrics'."""
    if name in record:
        return record[name]
    return (record.get("val_metrics") or {}).get(name)


def _jsonl_line(legend: str, records: list[dict[str, Any]], name: str) -> Line:
    points: list[tuple[float, float]] = []
    count = 0
    for r in records:
        value = _field(r, name)
        if value is None or not isinstance(r.get("step"), int):
            continue
        number = _number(value)
        if number is None:  # a field that is no number counts, like a _total counter
            count += 1
            number = float(count)
        points.append((r["step"], number))
    points.sort(key=lambda p: p[0])  # EvalOnSave results may arrive out of order
    return Line(legend, [p[0] for p in points], [p[1] for p in points])


def _eval_names(records: list[dict[str, Any]]) -> list[str]:
    names: dict[str, None] = {}
    for r in records:
        if r.get("event") == "on_evaluate":
            names.update(dict.fromkeys(r.get("val_metrics") or {}))
    return list(names)


def frames_from_jsonl(records: list[dict[str, Any]]) -> list[Frame]:
    """Every panel's frames from a run's metrics.jsonl records, in `PANELS` order."""
    frames = []
    by_event: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_event.setdefault(str(r.get("event")), []).append(r)
    fields = {f: None for r in records for f in r}
    filled = {p.row for p in PANELS if any(_drawn(s, fields) for s in p.series)}
    for panel in PANELS:
        if panel.row is not None and panel.row not in filled:
            continue  # a row of what this run does not log (GRPO's, for an SFT run)
        if panel.repeat == EVAL_VARIABLE:
            names = _eval_names(records)
            evaluations = by_event.get("on_evaluate", [])
            # EvalOnSave results (they carry seconds_after_save) apart from in-loop evaluation.
            after_save = [r for r in evaluations if "seconds_after_save" in r]
            in_loop = [r for r in evaluations if "seconds_after_save" not in r]
            for name in names:
                frame = Frame(panel.title.replace(f"${EVAL_VARIABLE}", name), panel.unit)
                frame.lines.append(_jsonl_line(name, in_loop, name))
                frame.lines.append(_jsonl_line(f"{name} (EvalOnSave)", after_save, name))
                frames.append(_noted(frame, f"no numeric {name} in metrics.jsonl"))
            if not names:
                frame = Frame(panel.title.replace(f"${EVAL_VARIABLE}", "(none)"), panel.unit)
                frames.append(_noted(frame, "no evaluation in metrics.jsonl"))
            continue
        frame = Frame(panel.title, panel.unit)
        if panel.title == "Step":  # the step against the step says nothing: against time
            frame.x_label = "minutes since the first record"
            frame.lines.append(_step_over_time(records))
        else:
            for s in panel.series:
                for name in jsonl_fields(s, fields) if "*" in (s.jsonl or "") else [s.jsonl]:
                    if name is not None:
                        legend = name if "*" in (s.jsonl or "") else s.legend
                        frame.lines.append(_jsonl_line(legend, by_event.get(s.event, []), name))
        frames.append(_noted(frame, _missing(panel, by_event)))
    return frames


def _drawn(series: Any, fields: dict[str, None]) -> bool:
    """Whether the records' `fields` hold a field of `series`."""
    return bool(jsonl_fields(series, list(fields)))


def _missing(panel: Panel, by_event: dict[str, list[dict[str, Any]]]) -> str:
    """The note of a panel with no data in metrics.jsonl: which fields are absent, or null."""
    fields = [(s.jsonl, s.event) for s in panel.series if s.jsonl is not None]
    fields = [(f, e) for f, e in fields if "*" not in f]  # a pattern's fields: drawn if any
    if not fields:
        return PROMETHEUS_ONLY
    present = [f for f, event in fields if any(f in r for r in by_event.get(event, []))]
    if present:
        return f"{', '.join(present)}: null in every record of metrics.jsonl"
    return f"no {', '.join(f for f, _ in fields)} in metrics.jsonl"


def _step_over_time(records: list[dict[str, Any]]) -> Line:
    logs = [r for r in records if r.get("event") == "on_log" and _number(r.get("time")) is not None]
    start = min((float(r["time"]) for r in logs), default=0.0)
    points = [((float(r["time"]) - start) / 60.0, float(r["step"])) for r in logs]
    return Line("step", [p[0] for p in points], [p[1] for p in points])


def _noted(frame: Frame, note: str) -> Frame:
    """Drop the lines with no point; a frame left with none carries `note`."""
    frame.lines = [line for line in frame.lines if line.xs]
    if not frame.lines or all(all(math.isnan(y) for y in line.ys) for line in frame.lines):
        frame.lines, frame.note = [], note
    return frame


# ---- from Prometheus ----------------------------------------------------------------------


class Prometheus:
    """Prometheus's HTTP API at ``url``, asked from this process."""

    def __init__(self, url: str, timeout_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise PlotError(f"--prometheus {url!r}: expected a URL such as http://HOST:9090")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def get(self, path: str, params: list[tuple[str, Any]]) -> Any:
        """The ``data`` of a successful answer; ``PlotError`` with the URL and the fix else."""
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as answer:
                body = json.loads(answer.read())
        except urllib.error.HTTPError as e:
            try:
                body = json.loads(e.read())
            except (ValueError, OSError):
                body = {"error": f"HTTP {e.code}"}
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", None) or e
            raise PlotError(
                f"cannot reach Prometheus at {self.url} ({reason}): check --prometheus "
                "(the Prometheus that scrapes the cluster, e.g. http://HEAD:9090)"
            ) from None
        if body.get("status") != "success":
            raise PlotError(
                f"Prometheus at {self.url} refused {path} "
                f"{dict(params).get('query', '')!r}: {body.get('error', body)}"
            )
        return body.get("data")

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        """The matrix result of a range query: ``[{"metric": {...}, "values": [[t, "v"]]}]``."""
        params = [("query", query), ("start", start), ("end", end), ("step", f"{step:g}")]
        return self.get("/api/v1/query_range", params).get("result", [])

    def metric_names(self, match: str, start: float, end: float) -> list[str]:
        params = [("match[]", match), ("start", start), ("end", end)]
        return sorted(self.get("/api/v1/label/__name__/values", params) or [])


def _legend(template: str, metric: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), template)


def _auto_step(span_s: float) -> float:
    """About 300 points over the span, at least one a second."""
    return max(1.0, math.ceil(span_s / 300.0))


def run_span(prom: Prometheus, run: str, start: float, end: float) -> tuple[float, float]:
    """The first and last time the run's step series has a sample in [start, end]."""
    step = _auto_step(end - start)
    expr = next(p for p in PANELS if p.title == "Step").series[0].expr
    times = [
        float(t)
        for series in prom.query_range(substitute(expr, run), start, end, step)
        for t, _ in series.get("values", [])
    ]
    if not times:
        raise PlotError(
            f"Prometheus at {prom.url} has no {expr.split('{')[0]} series for run {run!r} in "
            f"the last {(end - start) / 3600:g} h: check the run name (the run needs the "
            "RayMetrics callback) or widen --since"
        )
    return max(start, min(times) - step), min(end, max(times) + step)


def frames_from_prometheus(
    prom: Prometheus, run: str, start: float, end: float, step: float | None = None
) -> list[Frame]:
    """Every panel's frames from Prometheus, over the run's span within [start, end]."""
    start, end = run_span(prom, run, start, end)
    step = step or _auto_step(end - start)
    other = {n for p in PANELS if not p.repeat for s in p.series for n in _names(s.expr)}
    frames = []
    by_row: dict[str, list[Frame]] = {}
    for panel in PANELS:
        if panel.repeat == EVAL_VARIABLE:
            match = f'{{__name__=~"{promql_string(EVAL_PREFIX)}.+", {substitute(_RUN_MATCH, run)}}}'
            names = [n for n in prom.metric_names(match, start, end) if n not in other]
            for name in names:
                title = panel.title.replace(f"${EVAL_VARIABLE}", name.removeprefix(EVAL_PREFIX))
                frames.append(_prometheus_frame(prom, panel, title, run, name, start, end, step))
            if not names:
                title = panel.title.replace(f"${EVAL_VARIABLE}", "(none)")
                frames.append(Frame(title, panel.unit, note="no ray_trainer_eval_* series"))
            continue
        frame = _prometheus_frame(prom, panel, panel.title, run, None, start, end, step)
        frames.append(frame)
        if panel.row is not None:
            by_row.setdefault(panel.row, []).append(frame)
    # A row with no series for this run in any of its panels (GRPO's, for an SFT run): left out.
    unused = [id(f) for fs in by_row.values() if not any(f.lines for f in fs) for f in fs]
    return [f for f in frames if id(f) not in unused]


_RUN_MATCH = f'run=~"${RUN_VARIABLE}"'


def _names(expr: str) -> set[str]:
    return set(re.findall(r"\bray_trainer_\w+", expr))


def _prometheus_frame(
    prom: Prometheus,
    panel: Panel,
    title: str,
    run: str,
    eval_metric: str | None,
    start: float,
    end: float,
    step: float,
) -> Frame:
    frame = Frame(title, panel.unit, x_label="time")
    for s in panel.series:
        for series in prom.query_range(substitute(s.expr, run, eval_metric), start, end, step):
            metric = {"__name__": eval_metric or "", **series.get("metric", {})}
            values = series.get("values", [])
            xs = [datetime.fromtimestamp(float(t)) for t, _ in values]
            frame.lines.append(Line(_legend(s.legend, metric), xs, [float(v) for _, v in values]))
    return _noted(frame, f"no data in Prometheus for run {run}")


# ---- drawing ------------------------------------------------------------------------------


def draw(frames: list[Frame], title: str, dpi: int = 80) -> Any:
    """One matplotlib ``Figure`` with a grid of the frames (titled as the panels)."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator, PercentFormatter
    except ImportError:
        raise PlotError(
            "ray-trainer plot needs matplotlib: pip install 'ray-trainer[plot]' "
            "(or pip install matplotlib)"
        ) from None
    rows = max(1, math.ceil(len(frames) / COLUMNS))
    fig = Figure(figsize=(COLUMNS * 4.0, rows * 2.6 + 0.4), dpi=dpi, layout="constrained")
    fig.suptitle(title, fontsize=11)
    axes = fig.subplots(rows, COLUMNS, squeeze=False).ravel()
    for ax, frame in zip(axes, frames, strict=False):
        ax.set_title(frame.title, fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel(frame.x_label, fontsize=7)
        for line in frame.lines:
            marker = "o" if len(line.xs) < 20 else None
            ax.plot(line.xs, line.ys, label=line.legend, marker=marker, markersize=3, lw=1.2)
        if frame.note:
            ax.text(0.5, 0.5, frame.note, transform=ax.transAxes, ha="center", va="center",
                    fontsize=8, color="0.45", wrap=True)  # fmt: skip
            ax.set_xticks([])
            ax.set_yticks([])
        if len(frame.lines) > 1:
            ax.legend(fontsize=7)
        ys = [y for line in frame.lines for y in line.ys if not math.isnan(y)]
        if ys and all(y >= 0 and y == int(y) for y in ys):  # counts: whole numbers from 0
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_ylim(bottom=0, top=max(ys) * 1.1 or 1)
        if frame.unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif frame.lines:
            ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 5))
        if frame.unit == "s":
            ax.set_ylabel("seconds", fontsize=7)
        if frame.x_label == "time":
            ax.tick_params(axis="x", labelrotation=30)
    for ax in axes[len(frames) :]:
        ax.set_visible(False)
    return fig


def png_bytes(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


# ---- the command ----------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """``90``, ``30m``, ``24h``, ``2d`` as seconds (argparse type)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"expected a duration such as 30m, 24h or 2d: {text!r}")
    return float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]


def add_parser(sub: Any) -> None:
    """The ``plot`` subcommand's options (``sub`` is argparse's subparsers object)."""
    plot = sub.add_parser(
        "plot",
        help="draw a run's panels into a PNG, from its metrics.jsonl or from Prometheus",
        description="Draw the panels of the ray-trainer Grafana dashboard for one run into a "
        "PNG: from the run's metrics.jsonl (JsonlLogger), or from Prometheus (RayMetrics).",
    )
    plot.add_argument(
        "run",
        metavar="RUN",
        help="a run name under --storage-path, a run folder, or a metrics.jsonl file (local "
        "or s3://...); with --prometheus, the run name (its `run` label)",
    )
    plot.add_argument(
        "--storage-path",
        default="./runs",
        help="where runs are (the run's storage_path; default ./runs, as `ray-trainer demo`)",
    )
    plot.add_argument(
        "--prometheus",
        metavar="URL",
        help="draw from Prometheus at this URL (http://HOST:9090) instead of metrics.jsonl",
    )
    plot.add_argument(
        "--since",
        type=parse_duration,
        default=parse_duration("24h"),
        metavar="DURATION",
        help="with --prometheus: look for the run this far back (30m, 24h, 2d; default 24h)",
    )
    plot.add_argument(
        "--step",
        type=parse_duration,
        default=None,
        metavar="DURATION",
        help="with --prometheus: the query resolution (default about 300 points over the run)",
    )
    plot.add_argument(
        "--output",
        "-o",
        metavar="PNG",
        help="the PNG to write (default: panels.png in the run's folder when it is on this "
        "machine, else ./RUN-panels.png)",
    )
    plot.add_argument("--dpi", type=int, default=80, help="resolution (default 80)")
    plot.add_argument(
        "--timeout", type=float, default=10.0, help="seconds per Prometheus request (default 10)"
    )
    plot.set_defaults(main=plot_main)


def plot_main(opts: argparse.Namespace) -> int:
    """``ray-trainer plot RUN [--prometheus URL] [--output PNG]``: exit 0, or 2 with one line."""
    try:
        fig, output = render(opts)
        data = png_bytes(fig)
        target = locate(output)
        try:
            target.write_bytes(data)
        except OSError as e:
            raise PlotError(f"cannot write {target.name}: {e}; pass another --output") from None
    except PlotError as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    shown = sum(ax.get_visible() for ax in fig.axes)
    print(f"ray-trainer: wrote {target.name} ({shown} panels)", flush=True)
    return EXIT_OK


def render(opts: argparse.Namespace) -> tuple[Any, str]:
    """The figure for the command's options, and where it goes."""
    if opts.prometheus:
        name = opts.run.rstrip("/").rsplit("/", 1)[-1]
        end = time.time()
        prom = Prometheus(opts.prometheus, opts.timeout)
        frames = frames_from_prometheus(prom, name, end - opts.since, end, opts.step)
        fig = draw(frames, f"ray-trainer run {name} (Prometheus {prom.url})", opts.dpi)
        return fig, opts.output or f"{name}-panels.png"
    location = find_metrics(opts.run, opts.storage_path)
    folder = location.path.rsplit("/", 1)[0]
    name = folder.rsplit("/", 1)[-1]
    fig = draw(frames_from_jsonl(read_records(location)), f"ray-trainer run {name}", opts.dpi)
    default = f"{folder}/panels.png" if location.is_local else f"{name}-panels.png"
    return fig, opts.output or default
