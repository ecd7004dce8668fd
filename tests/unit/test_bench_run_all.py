"""`bench/run_all.py` without running a benchmark: `normalise` on every table shape the
registered benchmarks write, a report it cannot normalise kept as written beside its error, the
results rewritten as each benchmark finishes, the exit status, and `--smoke` (issue 53).

The end-to-end tests run `run_all.main` on a registry of tiny stand-in scripts (a subprocess
each, well under a second), never a real benchmark: no Ray, no torch.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_path  # noqa: F401  (every bench folder on the path)
import run_all
from _support import table

BENCH = Path(run_all.HERE)

# bench_elastic.py's table, as its `table(rows)` writes it: times and steps, no ratio column.
ELASTIC_ROWS = [
    {"change": "node lost: 2 -> 1 workers", "to first step (s)": 67.4, "steps trained again": 3,
     "with periodic saves only": 10},
    {"change": "node back: 1 -> 2 workers", "to first step (s)": 28.4, "steps trained again": 0,
     "with periodic saves only": 10},
]  # fmt: skip
ELASTIC_TABLE = table(ELASTIC_ROWS) + "\n\nlargest relative loss difference: 1.3e-06"


def _committed() -> dict[str, dict]:
    with open(BENCH / "results.json") as f:
        return json.load(f)["benchmarks"]


def _shapes() -> dict[str, dict]:
    """A report of every registered benchmark, in the shape its script writes: the committed
    results where they hold it, else one built as the script builds it."""
    shapes = {name: dict(r) for name, r in _committed().items() if "error" not in r}
    shapes["dispatch"] = {  # bench_dispatch.py: rows only, no table
        "rows": [
            {
                "case": "direct calls (reference)",
                "ns_per_event": 364.0,
                "ratio": 1.0,
                "cpu_ns_per_event": 364.0,
                "cpu_ratio": 1.0,
            },
            {
                "case": "CallbackManager, 5 callbacks",
                "ns_per_event": 700.0,
                "ratio": 1.92,
                "cpu_ns_per_event": 690.0,
                "cpu_ratio": 1.9,
            },
        ]
    }
    shapes["elastic"] = {"baseline": "an uninterrupted run", "rows": ELASTIC_ROWS,
                         "table": ELASTIC_TABLE}  # fmt: skip
    shapes["packing"] = {  # two tables and a note; its own ratios and baseline
        "table": "| configuration | tokens/s | ratio |\n|---|---|---|\n| padded batches "
        "(baseline) | 100 | 1.000 |\n| packed | 199 | 1.99 |\n\n| preparation | s |\n|---|---|\n"
        "| pack | 0.1 |\n\nnote",
        "ratios": {"padded batches (baseline)": 1.0, "packed": 1.99},
        "baseline": "padded batches (baseline)",
    }
    shapes["save"] = {
        "table": "head\n\n| strategy | storage | pause (s) |\n|---|---|---|\n| ddp | local | 0.1 |"
        "\n\ntarget",
        "baseline": "synchronous saves",
        "ratios": {"ddp local: pause async / sync": 0.19},
    }
    shapes["data_scale"] = {
        "table": "| JSONL file | peak RSS (MiB) | ratio to the smallest |\n|---|---|---|\n"
        "| 0.1 GiB | 200 | 1.00x |\n| 1 GiB | 210 | 1.05x |",
        "ratios": {"0.1 GiB": 1.0, "1 GiB": 1.05},
        "worst_peak_mib": 210,
    }
    shapes["ray_data"] = {  # bench_ray_data.py: its own ratios, two per size and source
        "table": "| size, source | encoding (s) | time ratio to files |\n|---|---|---|\n"
        "| 0.05 GiB, files (baseline) | 10.0 | 1.00x |\n| 0.05 GiB, ray.data | 12.0 | 1.20x |",
        "ratios": {
            "0.05 GiB, files (baseline): encoding time": 1.0,
            "0.05 GiB, files (baseline): peak driver RSS": 1.0,
            "0.05 GiB, ray.data: encoding time": 1.2,
            "0.05 GiB, ray.data: peak driver RSS": 1.05,
        },
        "worst_ray_peak_mib": 280.0,
    }
    shapes["host_step"] = _host_step_report()
    shapes["grpo"] = _grpo_report()
    shapes["async_rl"] = _async_rl_report()
    shapes["grpo_agents"] = _grpo_report()  # bench_grpo.py --agents: the same report
    shapes["agents"] = {  # bench_agents.py: one ratio, the sleeping tool's step to the instant's
        "table": "| setting | step (s) | episodes/s | ratio |\n|---|---|---|---|\n"
        "| 64 episodes, instant tool | 4.0 | 16.0 | |\n"
        "| 64 episodes, tool sleeps 1 s | 5.0 | 12.8 | 1.250x |",
        "ratios": {"64 episodes, tool sleeps 1 s": 1.25},
        "target": 1.5,
        "max_episodes": 256,
    }
    return shapes


def test_agents_goals_hold_the_concurrency_and_the_overlap():
    report = _shapes()["agents"]
    goals = run_all.agents_goals(report)
    assert [g[3] for g in goals] == [True, True]
    report = {**report, "max_episodes": 64, "ratios": {"x": 1.6}}
    assert [g[3] for g in run_all.agents_goals(report)] == [False, False]


def _host_step_report() -> dict:
    """bench_host_step.py's report, from its own `summarize` of 8 rounds of 3 steps each."""
    import bench_host_step

    wall = {name: [[0.010 * k, 0.011 * k, 0.012 * k]] * 8 for name, k in
            (("bare", 1.0), ("bare_again", 1.01), ("runner", 1.15))}  # fmt: skip
    cpu = {name: [[0.9 * t for t in block] for block in rounds] for name, rounds in wall.items()}
    return bench_host_step.summarize(wall, cpu, _whole_runs())


def _whole_runs() -> dict:
    """`whole_runs`' shape: two rounds a side; idle the runner 1.1x wall and 1.05x CPU, beside
    the hogs 1.3x wall (one round 1.2x, one 1.4x) and 1.0x CPU."""

    def run(wall_ms: float, cpu_ms: float) -> dict:
        return {"wall": [wall_ms / 1e3] * 10, "cpu": [cpu_ms / 1e3] * 10, "torch_threads": 1}

    return {
        "idle": {"bare": [run(1.0, 1.0)] * 2, "runner": [run(1.1, 1.05)] * 2},
        "hogs": {"bare": [run(2.0, 1.0)] * 2, "runner": [run(2.4, 1.0), run(2.8, 1.0)]},
    }


def _grpo_report() -> dict:
    """bench_grpo.py's report, from its own `summarise` of one round."""
    import argparse

    import bench_grpo

    def run(steps_per_s: float, shares: dict[str, float], parts: dict[str, float]) -> dict:
        return {"steps_per_s": steps_per_s, "tokens_per_s": 30 * steps_per_s,
                "tokens_per_cpu_s": 40 * steps_per_s, "step_s": 1 / steps_per_s,
                "tokens_per_step": 30.0, "torch_threads": 1, "shares": shares,
                "cpu_per_step": sum(parts.values()), "cpu_parts": parts}  # fmt: skip

    rows = {"trl": [run(0.5, {"rollout": 0.4, "reward": 0.01, "training": 0.59},
                        {"training process": 0.8})],
            "runner": [run(0.47, {"rollout": 0.5, "reward": 0.1, "sync": 0.05,
                                  "training": 0.35},
                           {"training worker": 0.45, "rollout engine": 0.35,
                            "other Ray processes": 0.07})]}  # fmt: skip
    opts = argparse.Namespace(prompts=8, batch_prompts=2, generations=2, completion_length=4,
                              steps=3, skip=1, hidden_size=32, layers=1, threads=1, rounds=1)  # fmt: skip
    return bench_grpo.summarise(rows, opts)


def _async_rl_report() -> dict:
    """bench_async_rl.py's report, from its own `summarise` of the smoke run's two settings."""
    import argparse

    import bench_async_rl

    def run(steps_per_s: float, reward: float) -> dict:
        return {"steps_per_s": steps_per_s, "step_s": 1 / steps_per_s, "cpu_per_step": 0.1,
                "reward": reward, "stale_dropped": 0.0,
                "timings": dict.fromkeys(bench_async_rl.TIMINGS, 0.01)}  # fmt: skip

    opts = argparse.Namespace(prompts=8, batch_prompts=2, generations=2, completion_length=4,
                              steps=3, skip=1, reward_step=3, reward_window=1, hidden_size=32,
                              layers=1, threads=1, rounds=1, learning_rate=1e-5)  # fmt: skip
    return bench_async_rl.summarise({"1x0@42": [run(10.0, 0.8)], "1x1@42": [run(12.0, 0.8)]},
                                    opts)  # fmt: skip


def test_host_step_ratio_is_the_runners_cpu_time_over_the_bare_loops():
    report = _host_step_report()
    ratios = report["ratios"]
    assert ratios[report["baseline"]] == pytest.approx(1.0)
    runner = next(v for k, v in ratios.items() if k.startswith("runner step"))
    assert runner == pytest.approx(1.15)
    lo, hi = next(v for k, v in report["spreads"].items() if k.startswith("runner step"))
    assert lo == pytest.approx(1.15) and hi == pytest.approx(1.15)


def test_host_step_whole_runs_are_ratios_to_their_own_loads_bare_loop():
    report = _host_step_report()
    idle = "whole run: run_training, its embedded Ray, one worker, idle"
    hogs = "whole run: run_training, its embedded Ray, one worker, hogs"
    assert report["wall_ratios"][idle] == pytest.approx(1.1)
    assert report["ratios"][idle] == pytest.approx(1.05)
    assert report["wall_ratios"][hogs] == pytest.approx(1.3)  # median runner 2.6 / bare 2.0
    assert report["ratios"][hogs] == pytest.approx(1.0)
    assert "1.200-1.400 (rounds)" in report["table"]
    goals = {what: met for what, _, _, met in run_all.host_step_goals(report)}
    assert goals == {
        "host step in one worker: wall / bare": True,
        "host step in one worker: CPU / bare": True,
        "host step of a whole run, idle: wall / bare": True,
        "host step of a whole run, idle: CPU / bare": True,
        "host step of a whole run, hogs: wall / bare": False,
        "host step of a whole run, hogs: CPU / bare": True,
    }


def test_hf_trainer_cpu_window_interpolates_each_process_by_its_kind():
    import bench_hf_trainer

    sampler = bench_hf_trainer.CpuSampler()
    rank, raylet = ("ranks", "other")
    # A rank from 0 s (0 CPU-s) to 2 s (2 CPU-s); a daemon from 0 s to 2 s (0.2 CPU-s); a
    # process that appears at 1.5 s counts from its first sample only.
    sampler.samples = [
        (0.0, {1: (rank, 0.0), 2: (raylet, 0.0)}),
        (1.0, {1: (rank, 1.0), 2: (raylet, 0.1)}),
        (2.0, {1: (rank, 2.0), 2: (raylet, 0.2), 3: (raylet, 5.0)}),
    ]
    spent = sampler.window(0.5, 1.5)
    assert spent["ranks"] == pytest.approx(1.0) and spent["other"] == pytest.approx(0.1)
    assert bench_hf_trainer.rank_kind("ray::RayTrainWorker.__execute") == "ranks"
    assert bench_hf_trainer.rank_kind("python _hf_trainer_worker.py --steps 3") == "ranks"
    launcher = "python -m torch.distributed.run --nproc_per_node 2 _hf_trainer_worker.py"
    assert bench_hf_trainer.rank_kind(launcher) == "other"
    assert bench_hf_trainer.rank_kind("/usr/bin/raylet --node_ip_address=1") == "other"


def test_every_registered_benchmark_has_a_shape_here_and_a_script():
    """A benchmark registered without a shape in this file fails here (add its report's shape
    to `_shapes`), as `--smoke` fails in CI."""
    assert set(run_all.BENCHES) <= set(_shapes())
    for name, bench in run_all.BENCHES.items():
        assert (BENCH / bench.script).is_file(), name


@pytest.mark.parametrize("name", sorted(run_all.BENCHES))
def test_normalise_reads_every_registered_benchmarks_report(name):
    report = run_all.normalise(name, _shapes()[name])
    assert report["title"] == run_all.BENCHES[name].title
    assert isinstance(report["table"], str) and "|" in report["table"]
    assert isinstance(report["ratios"], dict)
    if name != "elastic":  # the one table without a ratio column
        assert report["ratios"], name
        assert all(isinstance(v, float) for v in report["ratios"].values())
    md = _markdown({name: {**report, "seconds": 1.0}})
    assert f"## {report['title']}" in md and "Not normalised" not in md


def test_a_table_without_a_ratio_column_gives_no_ratios_and_keeps_its_table():
    """The crash of the 2026-11-27 run: bench_elastic.py's table has no `ratio...` column."""
    assert run_all._ratios_from_table(ELASTIC_TABLE) == {}
    report = run_all.normalise("elastic", {"rows": ELASTIC_ROWS, "table": ELASTIC_TABLE})
    assert report["ratios"] == {} and report["baseline"] is None
    md = _markdown({"elastic": {**report, "seconds": 3.0}})
    assert "| node lost: 2 -> 1 workers | 67.4 | 3 | 10 |" in md


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("| a | ratio |\n|---|---|\n| x (baseline) | 1.000 |\n| y | 1.02x |", {"x (baseline)": 1.0, "y": 1.02}),
        ("Model: 96M.\n\n| c | ratio to DDP | met |\n|---|---|---|\n| FSDP | 0.51 | yes |", {"FSDP": 0.51}),
        ("| c | Ratio (tokens/s) |\n|---|---|\n| a | 1,234.5 |\n| b | - |\n| short |", {"a": 1234.5}),
        ("| c | ratio |\n|---|---|\n| a | 2.5e-01 |\n\n| d | ratio |\n|---|---|\n| other | 9 |", {"a": 0.25}),
        ("| c | ratio |\n|---|---|\n| a | 1.02x (0.99-1.05) |", {"a": 1.02}),
        ("no table at all", {}),
        ("| only a header |", {}),
    ],
)  # fmt: skip
def test_ratios_from_table_on_each_shape(text, want):
    assert run_all._ratios_from_table(text) == want


def test_a_report_that_cannot_be_normalised_is_kept_as_written_with_its_error():
    raw = {"rows": [{"case": "a", "no ns here": 1}], "wall_s": 12.5, "seconds": 4.0}
    kept = run_all.normalise_or_keep("dispatch", raw)
    assert "KeyError" in kept["normalise_error"] and kept["wall_s"] == 12.5
    assert kept["rows"] == raw["rows"]
    md = _markdown({"dispatch": kept})
    assert "**Not normalised** (KeyError" in md
    assert '"wall_s": 12.5' in md  # the figures, as the benchmark wrote them
    # A goal that cannot read a kept report is a missed row, not a crash.
    goals = run_all.goal_rows(
        {"benchmarks": {"hf_trainer": {"table": "x", "normalise_error": "e"}}}
    )
    assert (
        goals[0][0] == "hf_trainer"
        and goals[0][1].startswith("(not computed")
        and goals[0][4] == "MISSED"
    )


def test_a_failed_benchmark_passes_normalise_untouched():
    failed = {"error": "exit 1; see log", "seconds": 2.0}
    assert run_all.normalise_or_keep("loop", failed) is failed
    assert "Failed: exit 1; see log" in _markdown({"loop": failed})


def _markdown(benchmarks: dict[str, dict]) -> str:
    results = {
        "date": "2026-11-27 10:00 UTC", "machine": "2 cores", "versions": {"python": "3"},
        "commit": "abc", "quick": False, "mode": "full", "load": [1.0, 2.0],
        "ran": list(benchmarks), "benchmarks": benchmarks,
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "results.md")
        run_all.write_markdown(results, path)
        return Path(path).read_text()


# ---- main() on stand-in scripts ----------------------------------------------------------------

GOOD = """
import json, sys
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"table": "| c | ratio |\\n|---|---|\\n| base (baseline) | 1.0 |\\n| fast | 1.5 |",
           "args": sys.argv[3:]}, open(out, "w"))
"""
ELASTIC_LIKE = f"""
import json, sys
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({{"table": {ELASTIC_TABLE!r}, "rows": {ELASTIC_ROWS!r}}}, open(out, "w"))
"""
# Reads results.md in the output folder while it runs: what finished before it is written.
PEEK = """
import json, os, sys
out = sys.argv[sys.argv.index("--json") + 1]
md = open(os.path.join(os.environ["PEEK_DIR"], "results.md")).read()
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |", "seen": "## good" in md}, open(out, "w"))
"""
UNNORMALISABLE = """
import json, sys
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"rows": [{"case": "x"}], "figure_s": 42.0}, open(out, "w"))
"""
CRASH = "import sys; sys.exit(3)\n"


def _registry(tmp_path: Path, monkeypatch, scripts: dict[str, str]) -> None:
    benches = {}
    for name, code in scripts.items():
        path = tmp_path / f"{name}.py"
        path.write_text(textwrap.dedent(code))
        benches[name] = run_all.Bench(
            str(path), name, f"{name}'s baseline", quick=["--q"], smoke=["--s"]
        )
    monkeypatch.setattr(run_all, "BENCHES", benches)
    monkeypatch.setattr(run_all, "TIMEOUT_S", 60)
    monkeypatch.setenv("PEEK_DIR", str(tmp_path / "out"))


def test_main_keeps_every_figure_names_the_failed_benchmark_and_exits_1(
    tmp_path, monkeypatch, capsys
):
    _registry(tmp_path, monkeypatch, {"good": GOOD, "peek": PEEK, "elastic_like": ELASTIC_LIKE,
                                      "odd": UNNORMALISABLE, "crash": CRASH})  # fmt: skip
    out = tmp_path / "out"
    assert run_all.main(["--out", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "FAILED benchmarks: crash " in printed
    assert "Kept as written (not normalised; see results.md): odd" in printed
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert results["peek"]["seen"] is True  # results.md held "good" before "peek" ran
    assert results["good"]["ratios"] == {"base (baseline)": 1.0, "fast": 1.5}
    assert results["good"]["args"] == []  # a full run: the registry's `full` arguments
    assert results["elastic_like"]["ratios"] == {}
    assert results["odd"]["figure_s"] == 42.0 and "KeyError" in results["odd"]["normalise_error"]
    assert "exit 3" in results["crash"]["error"]
    md = (out / "results.md").read_text()
    assert "| node lost: 2 -> 1 workers | 67.4 | 3 | 10 |" in md
    assert "**Not normalised**" in md and '"figure_s": 42.0' in md
    assert "Failed: exit 3" in md
    assert (out / "results.png").is_file()


def test_main_exits_0_where_only_the_normalising_failed(tmp_path, monkeypatch, capsys):
    _registry(tmp_path, monkeypatch, {"good": GOOD, "odd": UNNORMALISABLE})
    assert run_all.main(["--out", str(tmp_path / "out")]) == 0
    assert "FAILED" not in capsys.readouterr().out


def test_smoke_runs_every_registered_benchmark_into_a_temporary_folder(
    tmp_path, monkeypatch, capsys
):
    _registry(tmp_path, monkeypatch, {"good": GOOD, "elastic_like": ELASTIC_LIKE})
    committed = (BENCH / "results.md").read_bytes()
    assert run_all.main(["--smoke"]) == 0
    printed = capsys.readouterr().out
    assert "smoke run ok: 2 benchmarks" in printed
    out = Path(printed.split("results into ", 1)[1].split("\n", 1)[0])
    assert out != BENCH and "ray_trainer_bench_smoke_" in out.name
    assert "smoke run (2 benchmarks at a time) of" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["benchmarks"]["good"]["args"] == ["--s"]
    assert (BENCH / "results.md").read_bytes() == committed


@pytest.mark.parametrize("bad", [UNNORMALISABLE, CRASH])
def test_smoke_fails_on_a_benchmark_without_a_normalised_report(bad, tmp_path, monkeypatch, capsys):
    _registry(tmp_path, monkeypatch, {"good": GOOD, "bad": bad})
    assert run_all.main(["--smoke", "--out", str(tmp_path / "out")]) == 1
    printed = capsys.readouterr().out
    assert (
        "SMOKE RUN FAILED" in printed
        and "[bad]" in printed
        and "[good]" not in printed.split("SMOKE RUN FAILED")[1]
    )


# ---- the smoke run's own settings --------------------------------------------------------------

# The arguments of a full run, as `make bench` has always run them: a smoke setting changed in
# the registry must never reach them.
FULL_ARGS = {
    "hf_trainer_1rank": ["--num-workers", "1", "--rounds", "3"],
    "host_step": ["--rounds", "30", "--block", "20"],
    "grpo_agents": ["--agents"],
}


def test_a_full_run_keeps_its_arguments():
    for name in run_all.BENCHES:
        assert run_all.bench_args(name, "full") == FULL_ARGS.get(name, []), name


@pytest.mark.parametrize("name", sorted(run_all.BENCHES))
def test_every_smoke_flag_is_one_its_script_parses(name):
    """A smoke argument its script does not know fails in CI after minutes: here, at once."""
    source = (BENCH / run_all.BENCHES[name].script).read_text()
    flags = [a for a in run_all.bench_args(name, "smoke") if a.startswith("--")]
    assert flags, f"{name}: no smoke setting of its own"
    for flag in flags:
        assert f'"{flag}"' in source, f"{name}: {flag} is not an option of its script"


def test_smoke_arguments_name_the_runs_own_work_folder(tmp_path, monkeypatch, capsys):
    """data_scale's `--dir {work}/...`: never the folder a full run beside it writes."""
    _registry(tmp_path, monkeypatch, {"good": GOOD})
    bench = run_all.BENCHES["good"]
    monkeypatch.setitem(run_all.BENCHES, "good", run_all.Bench(
        bench.script, "good", "b", smoke=["--dir", "{work}/data_scale"]))  # fmt: skip
    assert run_all.main(["--smoke", "--out", str(tmp_path / "out")]) == 0
    work = capsys.readouterr().out.split("logs and raw reports in ", 1)[1].split(";", 1)[0]
    args = json.loads((tmp_path / "out" / "results.json").read_text())["benchmarks"]["good"]
    assert args["args"] == ["--dir", f"{work}/data_scale"]


class _FakeSharedRay:
    """Stands in for `run_all.SharedRay` (a real `ray start`): records its start and stop; the
    first one made has the address 127.0.0.2:1, the next 127.0.0.2:2, ..."""

    log: list[str] = []

    def __init__(self) -> None:
        port = 1 + sum(1 for _ in self.log if _ == "made")
        self.log.append("made")
        self.cluster = type("C", (), {"gcs_address": f"127.0.0.2:{port}"})()

    def start(self) -> None:
        self.log.append("start")

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.cluster.gcs_address}

    def stop(self) -> None:
        self.log.append("stop")


SEES_ADDRESS = """
import json, os, sys
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |",
           "address": os.environ.get("RAY_ADDRESS")}, open(out, "w"))
"""


@pytest.mark.parametrize("crash", [False, True])
def test_smoke_shares_one_ray_with_the_benchmarks_that_join_it_and_stops_it(
    crash, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    scripts = {"joins": SEES_ADDRESS, "alone": SEES_ADDRESS} | ({"crash": CRASH} if crash else {})
    _registry(tmp_path, monkeypatch, scripts)
    for name in ("joins", "crash"):
        if name in run_all.BENCHES:
            b = run_all.BENCHES[name]
            monkeypatch.setitem(run_all.BENCHES, name, run_all.Bench(
                b.script, name, "b", smoke=["--s"], shares_ray=True))  # fmt: skip
    monkeypatch.setattr(run_all, "SharedRay", _FakeSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--out", str(out)]) == (1 if crash else 0)
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert results["joins"]["address"] == "127.0.0.2:1"
    assert results["alone"]["address"] is None  # elastic, memory: Ray of their own or none
    # one Ray per benchmark that may run at once (2 here where two join), each stopped, also
    # after a failed benchmark
    rays = 2 if crash else 1
    assert _FakeSharedRay.log.count("start") == _FakeSharedRay.log.count("stop") == rays


def test_a_full_run_and_a_smoke_run_without_ray_start_no_shared_ray(tmp_path, monkeypatch):
    _registry(tmp_path, monkeypatch, {"joins": SEES_ADDRESS, "alone": SEES_ADDRESS})
    b = run_all.BENCHES["joins"]
    monkeypatch.setitem(run_all.BENCHES, "joins", run_all.Bench(
        b.script, "joins", "b", smoke=["--s"], shares_ray=True))  # fmt: skip
    monkeypatch.setattr(run_all, "SharedRay", _FakeSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--only", "joins", "--out", str(out)]) == 0
    assert run_all.main(["--smoke", "--only", "alone", "--out", str(out)]) == 0
    assert _FakeSharedRay.log == []


# ---- several benchmarks at once (--smoke --jobs) -----------------------------------------------

# Writes its marker, then waits (bounded) for the marker of `OTHER` to appear: it passes only when
# the other benchmark ran at the same time.
MEETS = """
import json, os, sys, time
started = time.monotonic()
out = sys.argv[sys.argv.index("--json") + 1]
here, other = os.environ["MARKS"], os.environ["OTHER_" + os.path.basename(sys.argv[0])[:-3]]
open(os.path.join(here, os.path.basename(sys.argv[0])), "w").close()
deadline = time.monotonic() + 30
while not os.path.exists(os.path.join(here, other + ".py")) and time.monotonic() < deadline:
    time.sleep(0.05)
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |",
           "met": os.path.exists(os.path.join(here, other + ".py")),
           "started": started}, open(out, "w"))
"""
STARTED = """
import json, sys, time
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |", "started": time.monotonic()},
          open(out, "w"))
"""


def _set(name: str, monkeypatch, **fields) -> None:
    b = run_all.BENCHES[name]
    monkeypatch.setitem(run_all.BENCHES, name, run_all.Bench(
        b.script, name, "b", smoke=["--s"], **fields))  # fmt: skip


def test_smoke_runs_two_benchmarks_at_once_the_longest_first(tmp_path, monkeypatch, capsys):
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setenv("OTHER_long", "longer")
    monkeypatch.setenv("OTHER_longer", "long")
    _registry(tmp_path, monkeypatch, {"short": STARTED, "long": MEETS, "longer": MEETS})
    for name, seconds in (("short", 1), ("long", 30), ("longer", 60)):
        _set(name, monkeypatch, smoke_s=seconds)
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--jobs", "2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    got = results["benchmarks"]
    assert got["long"]["met"] and got["longer"]["met"]  # side by side
    assert got["short"]["started"] > max(got["long"]["started"], got["longer"]["started"])
    assert list(got) == ["short", "long", "longer"] and results["jobs"] == 2  # registry order
    assert "smoke run ok: 3 benchmarks" in capsys.readouterr().out


def test_one_at_a_time_outside_smoke(tmp_path, monkeypatch):
    _registry(tmp_path, monkeypatch, {"good": GOOD})
    with pytest.raises(SystemExit):  # side by side, the figures of a real run would be wrong
        run_all.main(["--jobs", "2", "--out", str(tmp_path / "out")])
    assert run_all.main(["--jobs", "1", "--out", str(tmp_path / "out")]) == 0


class _SlowSharedRay(_FakeSharedRay):
    """Its start waits (bounded) until the benchmark that does not join it has run."""

    def start(self) -> None:
        marker = Path(os.environ["MARKS"]) / "alone.py"
        assert _wait_for(marker.exists, 30), "the benchmark without Ray did not run meanwhile"
        super().start()


class _BrokenSharedRay(_FakeSharedRay):
    def start(self) -> None:
        self.log.append("start")
        raise RuntimeError("`ray start --head` failed: no ports")


def _wait_for(predicate, timeout_s: float) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


MARKS_AND_ADDRESS = """
import json, os, sys
out = sys.argv[sys.argv.index("--json") + 1]
open(os.path.join(os.environ["MARKS"], os.path.basename(sys.argv[0])), "w").close()
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |",
           "address": os.environ.get("RAY_ADDRESS")}, open(out, "w"))
"""


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_benchmarks_without_ray_run_while_the_shared_ray_starts(
    jobs, tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    _registry(tmp_path, monkeypatch, {"joins": MARKS_AND_ADDRESS, "alone": MARKS_AND_ADDRESS})
    _set("joins", monkeypatch, shares_ray=True)
    monkeypatch.setattr(run_all, "SharedRay", _SlowSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--jobs", jobs, "--out", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())["benchmarks"]
    assert got["joins"]["address"] == "127.0.0.2:1" and got["alone"]["address"] is None
    assert _FakeSharedRay.log == ["made", "start", "stop"]


def test_a_shared_ray_that_does_not_start_fails_each_benchmark_that_joins_it(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    _registry(tmp_path, monkeypatch, {"joins": SEES_ADDRESS, "also": SEES_ADDRESS,
                                      "alone": SEES_ADDRESS})  # fmt: skip
    for name in ("joins", "also"):
        _set(name, monkeypatch, shares_ray=True)
    monkeypatch.setattr(run_all, "SharedRay", _BrokenSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--out", str(out)]) == 1
    failed = capsys.readouterr().out.split("SMOKE RUN FAILED")[1]
    assert "[joins] failed: the shared Ray did not start: RuntimeError: `ray start" in failed
    assert "[also] failed" in failed and "[alone]" not in failed
    got = json.loads((out / "results.json").read_text())["benchmarks"]
    assert got["alone"]["address"] is None and "error" not in got["alone"]
    assert _FakeSharedRay.log == ["made", "made", "start", "start"]  # start stops its own


def test_the_shared_ray_stops_while_benchmarks_that_do_not_join_it_still_run(tmp_path, monkeypatch):
    """Its daemons would take CPU from them: stopped as soon as no benchmark left joins it.
    "after" runs from the start (no Ray) and waits (bounded) for the stop."""

    class Recorded(_FakeSharedRay):
        def stop(self) -> None:
            super().stop()
            (tmp_path / "marks" / "stopped.py").touch()

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setenv("OTHER_after", "stopped")
    _registry(tmp_path, monkeypatch, {"joins": STARTED, "after": MEETS})
    _set("joins", monkeypatch, shares_ray=True)
    monkeypatch.setattr(run_all, "SharedRay", Recorded)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--jobs", "2", "--out", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())["benchmarks"]
    assert got["after"]["met"]  # it saw the stop while it ran
    assert _FakeSharedRay.log == ["made", "start", "stop"]


def test_the_smoke_rays_settings_reach_its_head_and_every_benchmark_that_joins_it(monkeypatch):
    """No preemption watcher per fit, the controller's 0.25 s poll, Ray's default metrics
    interval (the tests' clusters export every 1 s); never a full run's settings."""
    shared = run_all.SharedRay()
    for env in (shared.cluster.node_env(), shared.env()):
        assert env["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
        assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.25"
        assert env["RAY_metrics_report_interval_ms"] == "10000"
        assert env["RAY_TRAIN_METRICS_ENABLED"] == "0"
        assert env["RAY_worker_niceness"] == "0"
        # the project and every bench folder, for the head's workers too
        assert env["PYTHONPATH"].split(os.pathsep)[:2] == [run_all.ROOT, run_all.HERE]
    assert shared.env()["RAY_ADDRESS"] == shared.cluster.gcs_address
    assert shared.cluster.num_cpus == 4  # one benchmark on it at a time
    shared.cluster.stop()  # never started: removes its temp dir
    assert not os.path.exists(shared.cluster.temp_dir)


def test_save_smoke_report_without_a_run_without_saves(monkeypatch):
    """bench_save.py --smoke: the synchronous run's boundaries without a save stand for the
    no-save run's; the ratios the target reads, normalised."""
    import argparse

    import bench_save

    def clock(save_pause: float) -> dict:  # 4 steps of 0.1 s, 0.01 s boundaries, a save every 2
        begins, ends, t = [], [], 0.0
        for step in range(4):
            begins.append(t)
            ends.append(t + 0.1)
            t += 0.11 + (save_pause if step % 2 == 1 else 0.0)
        return {"begins": begins, "ends": ends, "end": t}

    opts = argparse.Namespace(
        n_layer=1, n_embd=64, steps=4, save_every=2, slow_mb_s=0.01, workers=1
    )
    clocks = {("ddp", "local", "sync"): clock(0.5), ("ddp", "local", "async"): clock(0.05)}
    assert bench_save.unsaved_gap(clocks[("ddp", "local", "sync")], 2) == pytest.approx(0.01)
    monkeypatch.setattr(bench_save, "machine", lambda: "2 cores")  # _support's imports Ray
    report = run_all.normalise("save", bench_save.report(clocks, opts))
    assert report["ratios"]["ddp local: pause async / sync"] == pytest.approx(0.1)
    assert "| DDP, local storage, synchronous | 0.50 |" in report["table"]


def test_two_benchmarks_at_once_each_on_a_ray_of_its_own(tmp_path, monkeypatch):
    """Two runs on one Ray would take the same callback actor name (the default run name)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    monkeypatch.setenv("OTHER_one", "two")
    monkeypatch.setenv("OTHER_two", "one")
    sees_address = MEETS.replace('"met":', '"address": os.environ.get("RAY_ADDRESS"), "met":')
    _registry(tmp_path, monkeypatch, {"one": sees_address, "two": sees_address, "alone": STARTED})
    for name in ("one", "two"):
        _set(name, monkeypatch, shares_ray=True)
    monkeypatch.setattr(run_all, "SharedRay", _FakeSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--jobs", "2", "--out", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())["benchmarks"]
    assert got["one"]["met"] and got["two"]["met"]  # side by side
    assert {got["one"]["address"], got["two"]["address"]} == {"127.0.0.2:1", "127.0.0.2:2"}
    assert _FakeSharedRay.log.count("start") == _FakeSharedRay.log.count("stop") == 2


NICENESS = """
import json, os, sys
out = sys.argv[sys.argv.index("--json") + 1]
json.dump({"table": "| c | ratio |\\n|---|---|\\n| b | 1.0 |",
           "niceness": os.environ.get("RAY_worker_niceness")}, open(out, "w"))
"""


def test_a_smoke_runs_settings_reach_the_benchmarks_without_a_shared_ray_too(tmp_path, monkeypatch):
    """elastic's own cluster: its workers at niceness 0 beside the other benchmark's processes;
    a full run's benchmarks keep the environment they were started with."""
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    _registry(tmp_path, monkeypatch, {"alone": NICENESS})
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["benchmarks"]["alone"]["niceness"] == "0"
    assert run_all.main(["--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["benchmarks"]["alone"]["niceness"] is None


def test_first_step_smoke_sides_on_one_process_each():
    import bench_first_step

    torchrun = bench_first_step.command("torchrun", "out.json", "runs", 1)
    demo = bench_first_step.command("demo", "out.json", "runs", 1)
    assert torchrun[torchrun.index("--nproc_per_node") + 1] == "1"
    assert demo[demo.index("--num-workers") + 1] == "1"
    full = bench_first_step.command("demo", "out.json", "runs")  # make demo's 2 workers
    assert full[full.index("--num-workers") + 1] == "2"


class _WatchedSharedRay(_FakeSharedRay):
    """Its start waits (bounded) for the benchmark without Ray, and fails where the one with a
    cluster of its own has run meanwhile."""

    def start(self) -> None:
        marks = Path(os.environ["MARKS"])
        assert _wait_for((marks / "alone.py").exists, 30), "nothing ran while Ray started"
        assert not (marks / "cluster.py").exists(), "a cluster started beside the shared Ray's"
        super().start()


def test_a_benchmark_with_a_cluster_of_its_own_waits_for_the_shared_rays_start(
    tmp_path, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setenv("MARKS", str(marks))
    _registry(tmp_path, monkeypatch, {"joins": MARKS_AND_ADDRESS, "alone": MARKS_AND_ADDRESS,
                                      "cluster": MARKS_AND_ADDRESS})  # fmt: skip
    _set("joins", monkeypatch, shares_ray=True)
    _set("cluster", monkeypatch, own_cluster=True, smoke_s=100)  # the longest: first, but waits
    monkeypatch.setattr(run_all, "SharedRay", _WatchedSharedRay)
    monkeypatch.setattr(_FakeSharedRay, "log", [])
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--jobs", "2", "--out", str(out)]) == 0
    got = json.loads((out / "results.json").read_text())["benchmarks"]
    assert "error" not in got["joins"] and "error" not in got["cluster"]
    assert _FakeSharedRay.log == ["made", "start", "stop"]


# ---- a smoke run shared by two benchmarks (`Bench.smoke_as`) ---------------------------------

SMOKE_COUNTING = """
import json, os, sys
out = sys.argv[sys.argv.index("--json") + 1]
open(os.environ["LAUNCHES"], "a").write("x")
json.dump({"table": "| c | ratio |\\n|---|---|\\n| base (baseline) | 1.0 |\\n| fast | 1.5 |",
           "args": sys.argv[3:]}, open(out, "w"))
"""


def _shared_smoke_registry(tmp_path, monkeypatch):
    path = tmp_path / "a.py"
    path.write_text(textwrap.dedent(SMOKE_COUNTING))
    monkeypatch.setattr(
        run_all,
        "BENCHES",
        {
            "a": run_all.Bench(str(path), "A", "a's baseline", smoke=["--s"]),
            "b": run_all.Bench(
                str(path), "B", "b's baseline", smoke=None, quick=["--q"], smoke_as="a"
            ),
        },
    )
    monkeypatch.setattr(run_all, "TIMEOUT_S", 60)
    monkeypatch.setenv("LAUNCHES", str(tmp_path / "launches"))


def test_a_smoke_run_shared_by_two_benchmarks_runs_once_and_reports_both(
    tmp_path, monkeypatch, capsys
):
    _shared_smoke_registry(tmp_path, monkeypatch)
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--out", str(out)]) == 0
    assert (tmp_path / "launches").read_text() == "x"
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert results["a"]["args"] == results["b"]["args"] == ["--s"]
    assert results["b"]["smoke_as"] == "a" and results["b"]["title"] == "B"
    assert results["b"]["ratios"] == {"base (baseline)": 1.0, "fast": 1.5}
    md = (out / "results.md").read_text()
    assert "## A" in md and "## B" in md and "The smoke run of `a`" in md
    assert "b (a's run)" in capsys.readouterr().out


def test_alone_it_runs_the_shared_smoke_settings_itself(tmp_path, monkeypatch):
    _shared_smoke_registry(tmp_path, monkeypatch)
    out = tmp_path / "out"
    assert run_all.main(["--smoke", "--only", "b", "--out", str(out)]) == 0
    assert (tmp_path / "launches").read_text() == "x"
    results = json.loads((out / "results.json").read_text())["benchmarks"]
    assert results["b"]["args"] == ["--s"] and "smoke_as" not in results["b"]


def test_the_smoke_heads_run_without_dashboard_and_log_monitor():
    ray = run_all.SharedRay()
    try:
        command = ray.cluster.start_command()
        assert "--include-dashboard=false" in command and "--include-log-monitor=false" in command
        assert not any(a.startswith("--dashboard-port=") for a in command)
        assert ray.cluster.env()["REPORTER_UPDATE_INTERVAL_MS"] == "60000"
    finally:
        ray.cluster.stop()


def test_a_head_whose_start_fails_is_started_once_more_on_new_ports(monkeypatch):
    ray = run_all.SharedRay()
    first = ray.cluster
    calls = []

    def start(self, timeout_s):
        calls.append(self)
        if len(calls) == 1:
            raise RuntimeError("raylet did not register")

    monkeypatch.setattr(type(first), "start", start)
    monkeypatch.setattr(type(first), "stop", lambda self, timeout_s=5.0: None)
    ray.start()
    assert len(calls) == 2 and calls[1] is ray.cluster and ray.cluster is not first
    assert ray.cluster.ports["port"] != first.ports["port"]
