"""Padding-free packing against padded batches, on chat data with long-tailed lengths.

Both configurations are a real 2-worker `run_training` of the same tiny chat model (a Qwen2
shape, `make_tiny_chat_model`, ChatML template) on the same generated conversations, the same
steps and the same samples per step (`batch_size x num_workers`):

* padded (baseline): each micro-batch is `batch_size` samples in the epoch's random order,
  right-padded to the longest of them (not to `max_length`, which would flatter packing);
* packed: the same samples per step, packed best-fit-decreasing into micro-batches of at most
  `max_tokens_per_batch` tokens, set to the padded run's mean positions per micro-batch (so both
  hold about as many positions), each sample attending to itself alone.

The conversations' token lengths are log-normal (median about 200 tokens, the longest 2,048).
Reported: non-padding tokens/s (rank 0's logs), padding share, step time, the attention path,
and the data preparation (CPU-seconds of the encoding tasks, time from `run_training` to the
first step) on a cache miss (the first run) and on a cache hit. Rounds alternate the
configurations; medians. Target: packed >= 1.5x the padded tokens/s, padding share <= 0.05.

Usage: python bench/data/bench_packing.py [--conversations 2000] [--steps 30] [--rounds 2]
       [--workers 2] [--smoke] [--json OUT]

``--smoke`` (`run_all.py --smoke`, in CI): a 2-layer model of width 64, one round, and the
cache-miss run's figures as the packed run's (two runs instead of three).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback  # noqa: E402

BATCH, WORKERS, MAX_LENGTH = 8, 2, 2048


class Watch(TrainerCallback):
    """Rank 0: the time of the first step's end and every log's metrics, written at the end."""

    runs_on = "rank0"

    def __init__(self, path: str) -> None:
        self.path = path
        self.first_step = None
        self.logs: list[dict] = []

    def on_step_end(self, context, **kwargs):
        if self.first_step is None:
            self.first_step = time.time()

    def on_log(self, context, **kwargs):
        self.logs.append(dict(context.batch_metrics or {}))

    def on_train_end(self, context, **kwargs):
        with open(self.path, "w") as f:
            json.dump({"first_step": self.first_step, "logs": self.logs}, f)


def conversations(tokenizer, n: int, seed: int = 0) -> list[list[dict]]:
    """Conversations whose rendered token counts are log-normal: median ~200, longest 2,048."""
    from ray_trainer._demo.chat import chat_conversations

    rng = random.Random(seed)
    pool = chat_conversations(4 * n, seed=seed, max_exchanges=1)
    out = []
    for i in range(n):
        target = min(MAX_LENGTH, max(24, int(rng.lognormvariate(math.log(200), 0.8))))
        if i == 0:
            target = MAX_LENGTH  # the longest
        messages = list(pool[i % len(pool)])
        while True:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
            if len(tokenizer(text)["input_ids"]) >= target - 16:
                break
            extra = pool[rng.randrange(len(pool))][-2:]
            messages += extra
        out.append(messages)
    return out


def padded_positions(lengths: list[int], seed: int = 0, trials: int = 2000) -> float:
    """The mean positions of a micro-batch of `BATCH` random samples padded to their longest."""
    rng = random.Random(seed)
    return statistics.mean(BATCH * max(rng.sample(lengths, BATCH)) for _ in range(trials))


def write_chat_data(tokenizer, n: int, folder: str) -> tuple[str, list[int], int]:
    """`n` conversations written to `folder`/chat.jsonl: the file, each one's token count, and
    the packed runs' `max_tokens_per_batch` (the padded runs' mean positions per micro-batch)."""
    convs = conversations(tokenizer, n)
    data = os.path.join(folder, "chat.jsonl")
    with open(data, "w") as f:
        for messages in convs:
            f.write(json.dumps({"messages": messages}) + "\n")
    lengths = [
        len(tokenizer(tokenizer.apply_chat_template(m, tokenize=False))["input_ids"]) for m in convs
    ]
    return data, lengths, max(MAX_LENGTH, round(padded_positions(lengths)))


def run(name: str, fields: dict, folder: str) -> dict:
    from ray_trainer import run_training
    from ray_trainer._driver.data import plan_data

    out = os.path.join(folder, f"{name}-{time.time_ns()}.json")
    started = time.time()
    result = run_training(**fields, callbacks=[Watch(out)])
    with open(out) as f:
        watched = json.load(f)
    from ray_trainer import TrainingArgs

    (plan,) = plan_data(TrainingArgs(**fields)).values()
    logs = watched["logs"][1:]  # the first window holds the warm-up steps
    return {
        "name": name,
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in logs),
        "padding_share": statistics.mean(m["padding_share"] for m in logs),
        "step_s": statistics.median(m["step_time"] for m in logs),
        "first_step_s": watched["first_step"] - started,
        "prep_cpu_s": plan.meta.get("cpu_s"),
        "prep_wall_s": plan.meta.get("wall_s"),
        "steps": result.global_step,
    }


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=WORKERS, help="workers of every run")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a 2-layer model of width 64, one round, the cache-miss run as the packed one "
        "(run_all.py --smoke)",
    )
    opts = parser.parse_args()
    hidden, layers = (64, 2) if opts.smoke else (128, 4)
    if opts.smoke:
        opts.rounds = 1

    from transformers import AutoTokenizer

    from ray_trainer._demo.chat import make_tiny_chat_model

    work = tempfile.mkdtemp(prefix="bench_packing_")
    try:  # its model, data and runs: nothing of it left in /tmp
        model = str(make_tiny_chat_model(os.path.join(work, "model"), hidden_size=hidden,
                                         num_layers=layers))  # fmt: skip
        data, lengths, max_tokens = write_chat_data(
            AutoTokenizer.from_pretrained(model), opts.conversations, work
        )
        common = dict(
            model=model, data=data, max_length=MAX_LENGTH, batch_size=BATCH, num_workers=opts.workers,
            max_steps=opts.steps, log_every_steps=5, save_at_end=False, warmup_steps=0,
            storage_path=os.path.join(work, "storage"),
        )  # fmt: skip
        configs = {
            "padded batches (baseline)": dict(common),
            "packed": dict(common, packing=True, max_tokens_per_batch=max_tokens),
        }
        init_ray(num_cpus=4)
        rows: dict[str, list[dict]] = {name: [] for name in configs}
        miss = run("packed", configs["packed"], work)  # the first run encodes the data: a miss
        if opts.smoke:  # its figures stand for the packed run's: one run fewer
            rows["packed"].append(miss)
        for r in range(opts.rounds):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            for name in names:
                if not (opts.smoke and name == "packed"):
                    rows[name].append(run(name, configs[name], work))
        report = summarise(rows, miss, lengths, max_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["machine"] = machine()
    return emit(report, opts.json)


def summarise(rows: dict, miss: dict, lengths: list[int], max_tokens: int) -> dict:
    base = statistics.median(r["tokens_per_s"] for r in rows["padded batches (baseline)"])
    attention = {"padded batches (baseline)": "SDPA, causal, padding masked",
                 "packed": "ray_trainer_packed: SDPA per sample group, no mask"}  # fmt: skip
    table_rows = []
    for name, runs in rows.items():
        tps = statistics.median(r["tokens_per_s"] for r in runs)
        table_rows.append({
            "configuration": name,
            "tokens/s (non-padding)": f"{tps:,.0f}",
            "ratio": f"{tps / base:.3f}",
            "padding share": f"{statistics.mean(r['padding_share'] for r in runs):.3f}",
            "step (s)": f"{statistics.median(r['step_s'] for r in runs):.3f}",
            "attention": attention[name],
            "first step, cache hit (s)": f"{statistics.median(r['first_step_s'] for r in runs):.1f}",
        })  # fmt: skip
    prep = [
        {"data preparation": "cache miss (first run)", "encoding CPU (s)": f"{miss['prep_cpu_s']:.1f}",
         "encoding wall (s)": f"{miss['prep_wall_s']:.1f}", "first step (s)": f"{miss['first_step_s']:.1f}"},
        {"data preparation": "cache hit", "encoding CPU (s)": "0.0", "encoding wall (s)": "0.0",
         "first step (s)": f"{statistics.median(r['first_step_s'] for r in rows['packed']):.1f}"},
    ]  # fmt: skip
    lengths_sorted = sorted(lengths)
    note = (
        f"{len(lengths)} conversations, tokens median {statistics.median(lengths):.0f}, "
        f"p90 {lengths_sorted[int(0.9 * len(lengths))]}, longest {max(lengths)}; "
        f"max_tokens_per_batch={max_tokens} (the padded run's mean positions per micro-batch)"
    )
    packed = float(table_rows[1]["ratio"])
    return {
        "table": table(table_rows) + "\n\n" + table(prep) + "\n\n" + note,
        "ratios": {r["configuration"]: float(r["ratio"]) for r in table_rows},
        "baseline": "padded batches (baseline)",
        "samples": {**rows, "miss": miss},
        "target_met": packed >= 1.5 and float(table_rows[1]["padding share"]) <= 0.05,
    }


if __name__ == "__main__":
    main()
