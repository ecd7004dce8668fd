"""Checkpoints that stop training, against checkpoints written in the background.

Every configuration is a real 2-worker `run_training` of a GPT-2-shaped Hugging Face model
(made here: `--n-layer` blocks of width `--n-embd`; its checkpoint holds the model, AdamW's
state and the ``hf/`` export), `--steps` steps saving every `--save-every` (the last step's
save is the run's final one, which waits for its write in both modes). Configurations: DDP and
FSDP; no saves (the baseline of the wall time), synchronous saves, ``async_checkpoint=True``;
on local disk and on slow storage: a ``pyarrow`` filesystem over the same disk whose writes
wait ``--slow-mb-s`` seconds per MiB and 0.05 s per file (``tests/support/slow_storage.py``,
as network storage at ~1/`--slow-mb-s` MiB/s).

A rank-0 callback timestamps every step's begin and end. The pause a configuration adds is the
time between one step's end and the next one's begin beyond the median of that gap in the
no-save run: summed over the run's boundaries before the last, divided by the saves before the
last (a publish at a later boundary counts in it). The wall time runs from the first step's
begin to ``on_train_end`` (the final save included).

Usage: python bench/runner/bench_save.py [--strategies ddp,fsdp] [--storages local,slow] [--steps 60]
       [--save-every 20] [--n-layer 6] [--n-embd 512] [--slow-mb-s 0.01] [--workers 2] [--smoke]
       [--json OUT]

``--smoke`` (`run_all.py --smoke`, in CI): no run without saves (two fits instead of three per
strategy and storage): the synchronous run's boundaries without a save stand for its step
boundary, and the wall time has no baseline. The same report, the ratios the target reads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "support")  # slow filesystem
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401

sys.path.insert(0, TESTS)

from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback  # noqa: E402

MODES = ("none", "sync", "async")


class StepClock(TrainerCallback):
    """Rank 0, in the training process: when each step began and ended, and when training
    ended; written to `path` at the end."""

    runs_on = "rank0"

    def __init__(self, path: str) -> None:
        self.path = path
        self.begins: list[float] = []
        self.ends: list[float] = []

    def on_step_begin(self, context, **kwargs):
        self.begins.append(time.perf_counter())

    def on_step_end(self, context, **kwargs):
        self.ends.append(time.perf_counter())

    def on_train_end(self, context, **kwargs):
        with open(self.path, "w") as f:
            json.dump({"begins": self.begins, "ends": self.ends, "end": time.perf_counter()}, f)


def boundary_gaps(clock: dict) -> list[float]:
    """The time between each step's end and the next step's begin."""
    return [b - e for e, b in zip(clock["ends"], clock["begins"][1:], strict=False)]


def pause_per_save(gaps: list[float], normal: float, every: int) -> tuple[float, float]:
    """The time the boundaries before the last took beyond `normal`, per save: at the save
    boundaries themselves (staging, or the whole synchronous save) and at the others (an
    asynchronous save's publish, a wait)."""
    saves = [i for i in range(len(gaps)) if (i + 1) % every == 0]
    excess = [max(0.0, g - normal) for g in gaps]
    at = sum(excess[i] for i in saves)
    return at / max(len(saves), 1), (sum(excess) - at) / max(len(saves), 1)


def unsaved_gap(clock: dict, every: int) -> float:
    """The median boundary without a save (before the last) of a run saving every `every`
    steps: the no-save run's figure, where there is none (``--smoke``)."""
    gaps = boundary_gaps(clock)[:-1]
    return statistics.median([g for i, g in enumerate(gaps) if (i + 1) % every != 0] or gaps)


def one_run(
    strategy: str, storage: str, mode: str, opts: argparse.Namespace, model: str, data: str
) -> dict:
    from slow_storage import slow_filesystem

    from ray_trainer import run_training

    with tempfile.TemporaryDirectory(prefix="bench_save_") as tmp:
        clock = os.path.join(tmp, "clock.json")
        fields = dict(
            model=model,
            data=data,
            strategy=strategy,
            num_workers=opts.workers,
            batch_size=2,
            max_length=64,
            mixed_precision="no",
            max_steps=opts.steps,
            log_every_steps=1000,
            save_every_steps=opts.save_every if mode != "none" else None,
            save_at_end=mode != "none",
            async_checkpoint=mode == "async",
            storage_path=os.path.join(tmp, "runs"),
            callbacks=[StepClock(clock)],
        )
        if storage == "slow":
            fields["storage_filesystem"] = slow_filesystem(per_file_s=0.05, per_mb_s=opts.slow_mb_s)
        run_training(**fields)
        with open(clock) as f:
            return json.load(f)


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="ddp,fsdp")
    parser.add_argument("--storages", default="local,slow")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--slow-mb-s", type=float, default=0.01, help="seconds per MiB written")
    parser.add_argument("--workers", type=int, default=2, help="workers of every run")
    parser.add_argument(
        "--smoke", action="store_true", help="no run without saves (run_all.py --smoke)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--report-from", default=None, help="JSON outputs to merge, no runs")
    opts = parser.parse_args()
    if opts.report_from:  # the tables again, from earlier runs (e.g. one per strategy)
        clocks = {}
        for path in opts.report_from.split(","):
            with open(path) as f:
                clocks.update({tuple(k.split("_")): v for k, v in json.load(f)["clocks"].items()})
        return emit(report(clocks, opts), opts.json)

    import ray

    from ray_trainer._demo.tiny_hf import TINY_WORDS
    from ray_trainer.demo import make_tiny_causal_lm

    work = tempfile.mkdtemp(prefix="bench_save_inputs_")
    try:  # the model and data: nothing of them left in /tmp
        model = str(make_tiny_causal_lm(os.path.join(work, "gpt2"), n_layer=opts.n_layer,
                                        n_embd=opts.n_embd, n_head=8, n_positions=64))  # fmt: skip
        data = os.path.join(work, "train.jsonl")
        with open(data, "w") as f:
            for i in range(2000):
                words = [TINY_WORDS[(i * 7 + j) % len(TINY_WORDS)] for j in range(40)]
                f.write(json.dumps({"text": " ".join(words)}) + "\n")
        init_ray(num_cpus=4, extra_paths=(TESTS,))
        clocks: dict[tuple, dict] = {}
        for strategy in opts.strategies.split(","):
            if not opts.smoke:
                clocks[(strategy, "-", "none")] = one_run(
                    strategy, "local", "none", opts, model, data
                )
            for storage in opts.storages.split(","):
                for mode in ("sync", "async"):
                    clocks[(strategy, storage, mode)] = one_run(
                        strategy, storage, mode, opts, model, data
                    )
                    print(strategy, storage, mode, "done", flush=True)
        ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return emit(report(clocks, opts), opts.json)


def report(clocks: dict[tuple, dict], opts: argparse.Namespace) -> dict:
    """Rows per configuration; the ratios async / sync of the pause and the wall time."""
    size = opts.n_layer * 12 * opts.n_embd**2 * 4  # fp32 weights of the blocks (tiny vocab)
    rows, ratios, pauses, walls = [], {}, {}, {}
    for (strategy, storage, mode), clock in clocks.items():
        base = clocks.get((strategy, "-", "none"))
        if base is not None:
            normal = statistics.median(boundary_gaps(base)[:-1])
        else:  # --smoke: the synchronous run's boundaries without a save
            normal = unsaved_gap(clocks[(strategy, storage, "sync")], opts.save_every)
        wall = clock["end"] - clock["begins"][0]
        at, later = pause_per_save(boundary_gaps(clock)[:-1], normal, opts.save_every)
        pause = at + later
        step = statistics.median(
            e - b for b, e in zip(clock["begins"], clock["ends"], strict=False)
        )
        pauses[(strategy, storage, mode)], walls[(strategy, storage, mode)] = pause, wall
        rows.append({
            "configuration": f"{strategy.upper()}, " + ("no saves (baseline)" if mode == "none"
                             else f"{storage} storage, {'asynchronous' if mode == 'async' else 'synchronous'}"),
            "pause per save (s)": f"{pause:.2f}" if mode != "none" else "",
            "of which at the save (s)": f"{at:.2f}" if mode != "none" else "",
            "median step (s)": f"{step:.2f}",
            f"wall of {opts.steps} steps (s)": f"{wall:.1f}",
            "wall vs no saves": f"{wall / (base['end'] - base['begins'][0]):.2f}" if base else "-",
        })  # fmt: skip
    verdicts = []
    for strategy, storage, mode in list(pauses):
        if mode != "async":
            continue
        sync = pauses[(strategy, storage, "sync")]
        ratio = pauses[(strategy, storage, "async")] / sync
        ratios[f"{strategy} {storage}: pause async / sync"] = ratio
        ratios[f"{strategy} {storage}: wall async / sync"] = (
            walls[(strategy, storage, "async")] / walls[(strategy, storage, "sync")]
        )
        if storage == "slow":
            verdicts.append(f"{strategy}: {ratio:.3f} ({'met' if ratio <= 0.2 else 'NOT met'})")
    head = (
        f"GPT-2-shaped model, {opts.n_layer} blocks of width {opts.n_embd} "
        f"({size / 2**20:,.0f} MiB of weights), {opts.workers} workers, {opts.steps} steps, a "
        f"save every "
        f"{opts.save_every} (and the final one); slow storage: {opts.slow_mb_s} s per MiB "
        "written and 0.05 s per file."
    )
    target = "target on slow storage, pause async / sync <= 0.2: " + ", ".join(verdicts)
    return {
        "machine": machine(),
        "table": "\n\n".join([head, table(rows), target]),
        "baseline": "synchronous saves, same strategy and storage, same run",
        "ratios": ratios,
        "clocks": {"_".join(k): v for k, v in clocks.items()},
    }


if __name__ == "__main__":
    main()
