"""Run every benchmark in one command and write `bench/results.{md,json,png}` (`make bench`).

Each benchmark runs as its own subprocess with ``--json`` (so each gets a clean Ray), one after
the other. Their reports are put together with the machine, the versions and the date:
`results.json` (every report, raw samples included), `results.md` (one section per benchmark:
what the baseline is, then its table) and `results.png` (one panel of ratios per benchmark, see
`plot.py`). Every figure is a ratio to a baseline measured side by side in the same run.

Usage: python bench/run_all.py [--quick] [--only NAME[,NAME]]

``--quick`` runs fewer steps and rounds (a smoke run of the whole chain, a few minutes);
``--only`` runs the named benchmarks and replaces only their sections of the existing results.
The full run takes about 15 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_JSON = os.path.join(HERE, "results.json")
RESULTS_MD = os.path.join(HERE, "results.md")
RESULTS_PNG = os.path.join(HERE, "results.png")
TIMEOUT_S = 3600  # per benchmark: a hung run fails instead of blocking forever


@dataclass(frozen=True)
class Bench:
    script: str  # relative to bench/, e.g. "runner/bench_loop.py"
    title: str
    baseline: str  # one line: what the ratios are measured against
    full: list[str] = field(default_factory=list)  # extra arguments for the full run
    quick: list[str] = field(default_factory=list)  # extra arguments for --quick
    target: float | None = None
    target_note: str = ""
    # The figures held against their targets: report -> [(what, figure, target, met)]; printed
    # in the run's summary and in results.md, where a miss shows as "MISSED".
    goals: Callable[[dict[str, Any]], list[tuple[str, str, str, bool]]] | None = None


def hf_trainer_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """run_training's tokens/s (the defaults: the embedded Ray with its dashboard) at least
    HF Trainer's, median of the rounds of one run."""
    ratio = next(v for k, v in report["ratios"].items() if k.startswith("run_training (this"))
    return [("run_training tokens/s / HF Trainer's", f"{ratio:.3f}x", ">= 1.000x", ratio >= 1.0)]


def startup_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's own start-up over a bare TorchTrainer.fit of the same one step."""
    samples = report["samples_s"]
    extra = statistics.median(samples["runner"]) - statistics.median(samples["bare"])
    return [("run_training start-up over a bare TorchTrainer.fit", f"{extra:+.2f} s", "<= +1.50 s",
             extra <= 1.5)]  # fmt: skip


def dpo_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The runner's DPO tokens/s against TRL's padded `DPOTrainer` (reference precomputed on
    both sides): padded at least 1.0x, packed at least 1.5x."""
    padded = next(v for k, v in report["ratios"].items() if k.startswith("ray-trainer, padded, r"))
    packed = next(v for k, v in report["ratios"].items() if "packing=True" in k)
    return [
        ("DPO padded tokens/s / TRL's padded", f"{padded:.3f}x", ">= 1.000x", padded >= 1.0),
        ("DPO packed tokens/s / TRL's padded", f"{packed:.3f}x", ">= 1.500x", packed >= 1.5),
    ]


def data_scale_goals(report: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """The driver's peak RSS, over every file size, under 500 MiB."""
    worst = float(report["worst_peak_mib"])
    return [("peak driver RSS, largest over the sizes", f"{worst:.0f} MiB", "< 500 MiB",
             worst < 500)]  # fmt: skip


BENCHES: dict[str, Bench] = {
    "dispatch": Bench(
        "runner/bench_dispatch.py",
        "Callback dispatch, cost per event",
        "direct method calls on the same 5 callbacks in a plain Python loop (no manager), "
        "same process; median ns per event",
        quick=["--repeat", "3", "--target-s", "0.005"],
    ),
    "forward": Bench(
        "runner/bench_event_forwarder.py",
        "Rank-0 cost of sending events to the callback actor",
        "one fire-and-forget Ray actor call per event to the same `CallbackActor`; CPU time of "
        "the sending process per event, steps paced as in training (8 events, then 50 ms)",
        quick=["--events", "800", "--rounds", "1"],
    ),
    "startup": Bench(
        "runner/bench_startup.py",
        "Start-up: one-step run, and the embedded Ray's dashboard, wall time",
        "a bare `TorchTrainer(fn).fit()` taking the same one accelerate step on 2 workers, Ray "
        "already initialised; for the dashboard rows, the embedded Ray started without its "
        "dashboard in a fresh process, alternating",
        quick=["--rounds", "1"],
        target_note="run_training at most 1.5 s over the bare TorchTrainer.fit",
        goals=startup_goals,
    ),
    "first_step": Bench(
        "baselines/bench_first_step.py",
        "Time to the first step: `make demo` against torchrun",
        "the demo's first step written by hand for `torchrun --nproc_per_node 2` (DDP over "
        "gloo, the same model, data and AdamW); each side a fresh process tree, from its launch "
        "to the first step's begin, alternating",
        quick=["--rounds", "1"],
    ),
    "loop": Bench(
        "runner/bench_loop.py",
        "Training step time (demo model, 2 workers)",
        "a bare accelerate loop (forward, backward, clip, optimizer and scheduler step), no "
        "callbacks, in the same 2 Ray "
        "Train workers, stepped in turn with every configuration (blocks of 8 steps, random "
        "order); mean step time from rank 0 without the slowest 10% of steps; median of 3 "
        "independent runs",
        quick=["--runs", "1", "--rounds", "8", "--warmup", "7"],
        target=1.02,
        target_note="each comparison the issues name (worker-side callbacks against the bare "
        "loop; a slow actor-side callback against none; every built-in callback + the slow "
        "actor callback against no callbacks) at a step-time ratio of at most 1.02; the noise "
        "floor row shows how far two identical loops land apart",
    ),
    "eval": Bench(
        "eval/bench_eval.py",
        "Evaluation on save: whole-run wall time",
        "the same evaluation function run synchronously in a rank-0 `on_save` callback (the "
        "loop waits, as with HF Trainer's in-loop evaluation)",
        quick=["--max-steps", "40", "--save-every", "10", "--eval-seconds", "1", "--rounds", "1"],
    ),
    "hf_trainer": Bench(
        "baselines/bench_hf_trainer.py",
        "Against Hugging Face Trainer: tokens/s",
        "`transformers.Trainer` under `torchrun --nproc_per_node 2` (gloo, CPU) on the same "
        "model, data, batch size, steps, optimizer and schedule, with equivalent callbacks",
        quick=["--steps", "60", "--skip", "10", "--rounds", "1"],
        target=1.0,
        target_note="run_training's tokens/s (defaults: the embedded Ray with its dashboard) at "
        "least 1.0x HF Trainer's, median of the rounds",
        goals=hf_trainer_goals,
    ),
    "hf_trainer_1rank": Bench(
        "baselines/bench_hf_trainer.py",
        "Against Hugging Face Trainer, one rank each: tokens/s with a core left to Ray",
        "`transformers.Trainer` under `torchrun --nproc_per_node 1` (one compute thread, as a "
        "runner rank of 1 CPU) on the same model, data, batch size, steps, optimizer and "
        "schedule; here Ray's own processes have a core of their own, so the ratio is the "
        "runner's loop against HF Trainer's, without the competition for cores",
        full=["--num-workers", "1", "--rounds", "3"],
        quick=["--num-workers", "1", "--steps", "60", "--skip", "10", "--rounds", "1"],
        target=1.0,
        target_note="run_training's tokens/s (defaults: the embedded Ray with its dashboard) at "
        "least 1.0x HF Trainer's, median of the rounds",
        goals=hf_trainer_goals,
    ),
    "packing": Bench(
        "data/bench_packing.py",
        "Chat data: packed against padded batches, tokens/s and data preparation",
        "the same 2-worker `run_training` of a tiny chat model on the same conversations "
        "(log-normal lengths, median ~200 tokens, longest 2,048) and samples per step, each "
        "micro-batch padded to its longest sample; non-padding tokens/s, median of rounds",
        quick=["--conversations", "300", "--steps", "10", "--rounds", "1"],
        target=1.5,
        target_note="packed at least 1.5x the padded run's non-padding tokens/s, with a padding "
        "share of at most 0.05",
    ),
    "data_scale": Bench(
        "data/bench_data_scale.py",
        "A big data file in the driver: peak memory and preparation time against its size",
        "the smallest file (0.1 GiB of JSONL, ~1 KiB records), through the same driver steps: "
        "`plan_data` (detection and the scan, before Ray), then `prepare_data` on an embedded "
        "Ray; a fresh driver process per size, RSS sampled every 10 ms",
        quick=["--sizes", "0.02", "0.1"],
        target_note="peak driver RSS under 500 MiB at every size (0.1, 1 and 4 GiB), so the "
        "ratio to the smallest file stays near 1; preparation time is reported, without a "
        "target",
        goals=data_scale_goals,
    ),
    "dpo": Bench(
        "baselines/bench_dpo.py",
        "DPO against TRL's DPOTrainer: tokens/s padded and packed, the reference pass, memory",
        "TRL 1.16's `DPOTrainer` in one process (padded, `precompute_ref_log_probs=True`) on the "
        "same tiny chat model, uneven preference pairs, pairs per step, AdamW and torch threads, "
        'against `run_training(objective="dpo", num_workers=1)`; non-padding tokens of chosen '
        "and rejected sequences per second of steps after the first ones",
        quick=["--quick"],
        target=1.0,
        target_note="the runner's padded tokens/s at least 1.0x TRL's padded, packed at least "
        "1.5x; the reference pass against training and the peak RSS of a reference in each "
        "step are reported, without a target",
        goals=dpo_goals,
    ),
    "memory": Bench(
        "memory/bench_memory.py",
        "Models larger than one device: FSDP against DDP, state per rank and checkpoints",
        "DDP through the runner's own `prepare` (accelerate) on the same GPT-2-shaped model "
        "(~96M parameters), the same number of gloo workers, in the same run; state = bytes of "
        "parameters + gradients + AdamW state on the largest rank after one step; checkpoint = "
        "rank 0's `torch.save` of model and optimizer (FSDP: every rank's DCP shards), slowest "
        "rank's save time and bytes of all files",
        quick=["--quick", "--saves", "1", "--rounds", "1"],
        target_note="FSDP's state per rank at most 1/N + 10% of DDP's (ratio <= 0.55 on 2 "
        "workers, <= 0.275 on 4); checkpoint time and size are reported, without a target; "
        "the load phase: the peak anonymous memory a pretrained 254M-parameter Llama adds to a "
        "worker at most (fp32 model / N) x 1.1 + its largest tensor under FSDP, against "
        "from_pretrained's whole load in every worker",
    ),
    "save": Bench(
        "runner/bench_save.py",
        "Checkpoints: the pause in training, synchronous against asynchronous",
        "synchronous saves (`ray.train.report` uploads, then training goes on), same strategy "
        "and storage; wall time against the same run without saves; 2 workers, a GPT-2-shaped "
        "HF model (72 MiB of weights), local disk and a filesystem that writes at 100 MiB/s",
        quick=["--steps", "8", "--save-every", "4", "--n-layer", "2", "--n-embd", "256"],
        target_note="on slow storage, the pause of an asynchronous save at most 0.2x the "
        "synchronous one",
    ),
    "elastic": Bench(
        "faults/bench_elastic.py",
        "Elastic training: a node lost and back, on a local cluster with a CPU-less head",
        "an uninterrupted run on both nodes, same seed and global batch (num_workers=[1, 2])",
        quick=["--quick"],
        target_note="the loss of every step after a change within 1e-4 relative of the "
        "uninterrupted run's; times and steps trained again are reported, without a target",
    ),
}


# ---- running ------------------------------------------------------------------------------


def run_one(name: str, quick: bool, workdir: str) -> dict[str, Any]:
    """Run one benchmark script in a subprocess; returns its JSON report (or an error)."""
    bench = BENCHES[name]
    out = os.path.join(workdir, f"{name}.json")
    log = os.path.join(workdir, f"{name}.log")
    args = bench.quick if quick else bench.full
    cmd = [sys.executable, os.path.join(HERE, bench.script), "--json", out, *args]
    print(f"[{name}] {' '.join(cmd[1:])}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(
                cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False
            )
            code = proc.returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    seconds = time.perf_counter() - started
    if code != 0 or not os.path.exists(out):
        with open(log) as f:
            tail = f.read()[-3000:]
        print(f"[{name}] FAILED ({code}) after {seconds:.0f} s; log {log}:\n{tail}", flush=True)
        return {"error": f"exit {code}; see {log}", "seconds": seconds}
    with open(out) as f:
        report = json.load(f)
    report["seconds"] = seconds
    report["command"] = " ".join(["python3", f"bench/{bench.script}", *args])
    report["measured"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"[{name}] done in {seconds:.0f} s", flush=True)
    return report


def normalise(name: str, report: dict[str, Any]) -> dict[str, Any]:
    """Give every report `table`, `ratios`, `baseline` and the registry's title and target."""
    bench = BENCHES[name]
    report = dict(report)
    if "table" not in report and "rows" in report:  # bench_dispatch.py writes rows only
        report["table"] = _dispatch_table(report["rows"])
        report.setdefault(
            "ratios",
            {r["case"]: r["ratio"] for r in report["rows"] if "reference" not in r["case"]},
        )
    if "ratios" not in report and "table" in report:
        report["ratios"] = _ratios_from_table(report["table"])
    ratios = report.get("ratios") or {}
    if "baseline" not in report:
        report["baseline"] = next((k for k in ratios if "baseline" in k), None)
    report["title"] = bench.title
    report["baseline_note"] = bench.baseline
    report["target"] = bench.target
    return report


def _dispatch_table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| case | ns/event | vs direct calls | CPU ns/event | CPU vs direct |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['ns_per_event']:,.0f} | {r['ratio']:.2f}x "
            f"| {r['cpu_ns_per_event']:,.0f} | {r['cpu_ratio']:.2f}x |"
        )
    return "\n".join(out)


def _ratios_from_table(table: str) -> dict[str, float]:
    """The first column against the column named `ratio...` of a markdown table."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    col = next(i for i, c in enumerate(header) if c.startswith("ratio"))
    ratios = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        number = re.sub(r"[^0-9.eE+-]", "", cells[col])
        if number:
            ratios[cells[0]] = float(number)
    return ratios


# ---- the record -----------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """The machine, the versions, the commit and the date of this run."""
    versions = {"python": platform.python_version()}
    for dist in ("torch", "ray", "accelerate", "transformers", "matplotlib"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                cpu,
            )
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}",
        "versions": versions,
        "commit": commit,
    }


def goal_rows(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(benchmark, what, figure, target, "met"/"MISSED") for every goal of the benchmarks in
    the results (a failed benchmark's goals are missed)."""
    rows = []
    for name, report in results["benchmarks"].items():
        goals = BENCHES[name].goals if name in BENCHES else None
        if goals is None:
            continue
        if "error" in report:
            rows.append((name, "(benchmark failed)", "-", "-", "MISSED"))
            continue
        for what, figure, target, met in goals(report):
            rows.append((name, what, figure, target, "met" if met else "MISSED"))
    return rows


def goals_table(rows: list[tuple[str, str, str, str, str]]) -> str:
    out = ["| benchmark | figure | measured | target | |", "|---|---|---:|---:|---|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(out)


def write_markdown(results: dict[str, Any], path: str) -> None:
    v = results["versions"]
    lines = [
        "# Benchmark results",
        "",
        f"{results['date']}, {'quick (smoke) run' if results['quick'] else 'full run'} of "
        f"`python3 bench/run_all.py`, commit `{results['commit']}`.",
        "",
        f"- machine: {results['machine']}",
        "- versions: " + ", ".join(f"{k} {v[k]}" for k in v),
        f"- load average (1 min) at start / end: {results['load'][0]:.1f} / "
        f"{results['load'][1]:.1f} (other work on the machine inflates absolute times; "
        "compare ratios)",
        "",
        "Every figure is a ratio to a baseline measured side by side in the same run "
        "(configurations alternate, or rotate, in rounds; medians). Plot: [results.png](results.png).",
        "",
        "![ratios to baseline](results.png)",
    ]
    goals = goal_rows(results)
    if goals:
        lines += ["", "## Targets", "", goals_table(goals)]
    for name, b in results["benchmarks"].items():
        lines += ["", f"## {b.get('title', name)}", ""]
        if "error" in b:
            lines.append(f"Failed: {b['error']}")
            continue
        when = "" if name in results["ran"] else f", from an earlier run ({b.get('measured')})"
        lines.append(
            f"Baseline: {b['baseline_note']}. `{b.get('command', BENCHES[name].script)}`, "
            f"{b['seconds']:.0f} s{when}."
        )
        if BENCHES[name].target_note:
            lines += ["", f"Target: {BENCHES[name].target_note}."]
        lines += ["", b["table"]]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (smoke run)")
    parser.add_argument(
        "--only", help=f"comma-separated benchmarks to run, of: {', '.join(BENCHES)}"
    )
    opts = parser.parse_args()
    names = list(BENCHES)
    if opts.only:
        names = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BENCHES]
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(BENCHES)}")

    previous: dict[str, Any] = {}
    if opts.only and os.path.exists(RESULTS_JSON):
        with open(RESULTS_JSON) as f:
            previous = json.load(f).get("benchmarks", {})

    load_start = os.getloadavg()[0]
    started = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="ray_trainer_bench_")
    print(f"logs and raw reports in {workdir}", flush=True)
    fresh = {name: run_one(name, opts.quick, workdir) for name in names}
    total = time.perf_counter() - started

    benchmarks = {}
    for name in BENCHES:  # registry order, whatever ran this time
        if name in fresh:
            report = fresh[name]
            benchmarks[name] = report if "error" in report else normalise(name, report)
        elif name in previous:
            benchmarks[name] = previous[name]
    results = {
        **environment(),
        "quick": opts.quick,
        "total_seconds": total,
        "load": [load_start, os.getloadavg()[0]],
        "ran": names,
        "benchmarks": benchmarks,
    }
    with open(RESULTS_JSON, "w") as f:
        json.dump(results, f, indent=1)
        f.write("\n")
    write_markdown(results, RESULTS_MD)
    sys.path.insert(0, HERE)
    from plot import draw

    draw(results, RESULTS_PNG)
    print(f"\nwrote {RESULTS_MD}, {RESULTS_JSON}, {RESULTS_PNG} in {total / 60:.1f} min\n")
    with open(RESULTS_MD) as f:
        print(f.read())
    goals = goal_rows(results)
    if goals:  # last, where a reader of the console sees it
        print("Targets:")
        for name, what, figure, target, met in goals:
            print(
                f"  {'ok    ' if met == 'met' else 'MISSED'} [{name}] {what}: {figure} ({target})"
            )
    return 1 if any("error" in fresh[n] for n in fresh) else 0


if __name__ == "__main__":
    sys.exit(main())
