"""DPO against TRL 1.16's `DPOTrainer`: tokens/s padded and packed, the reference pass, memory.

Both sides train the same tiny chat model (a Qwen2 shape, `make_tiny_chat_model`, ChatML
template, fp32) on the same generated preference pairs (conversational: a user prompt, a chosen
and a rejected assistant answer, each of log-normal length, so pairs are uneven), with the same
pairs per step, AdamW (same lr, weight decay 0.01 on matrices, linear decay, no warm-up, clip
1.0), the sigmoid loss with beta 0.1, dropout off and no gradient checkpointing, one training
process each with the same torch threads (`--threads`):

* TRL (baseline): `DPOTrainer` in a subprocess of this script (`OMP_NUM_THREADS` and
  `torch.set_num_threads` = `--threads`), `padding_free=False` (its only mode in 1.16),
  `max_length` above the longest pair (no truncation), `use_cpu=True`, `bf16=False`,
  `gradient_checkpointing=False` (TRL defaults both to True), `optim="adamw_torch"` (what the
  runner uses off CUDA). The baseline is `precompute_ref_log_probs=True`: the reference pass
  runs once before training, so a step is the policy's forward and backward only, as in the
  runner's default (`precompute_reference=True`); TRL's default, a reference model's forward in
  every step, is measured too and compared with the runner's in-step reference;
* the runner: `run_training(objective="dpo", num_workers=1)` in this process's embedded Ray, a
  worker of `--threads` CPUs (Ray sets its OMP threads to that); padded (each micro-batch of
  `batch_size` pairs right-padded to its longest sequence, as TRL does), packed (`packing=True`:
  each step's pairs without padding in micro-batches of at most `max_tokens_per_batch`, set to the
  padded runs' mean positions per micro-batch), and padded with `precompute_reference=False` (no
  LoRA: a frozen copy of the model computes the reference in each step).

Throughput counts the same tokens on both sides, in the training process: the non-padding
tokens of every chosen and rejected sequence (prompt included) a step trains on (TRL: its
batch's attention mask; the runner: each micro-batch's, or a packed row's tokens before its
filler), over the wall time from the begin of step `--skip` to the begin of the last step (data
loading and logging included; start-up and the first steps left out). The reference pass: the
runner's Ray tasks (wall time and task-seconds from the reference folder's meta.json) and TRL's
in-process pass (its `_precompute_ref_logps`), against each side's training wall time. Memory,
in a phase of its own on a wider model (`--memory-hidden-size`, whose weights dominate the
peak) and a few steps: each training process's peak RSS (`VmHWM`, read at the end of training:
the runner's worker, an `all_ranks` callback; TRL's process), with the reference precomputed
against computed in each step.
Rounds alternate the order; medians. Targets: the runner's padded tokens/s >= 1.0x TRL's
(precomputed reference both), packed >= 1.5x TRL's padded.

Usage: python bench/baselines/bench_dpo.py [--pairs 256] [--steps 24] [--skip 4] [--rounds 1]
       [--batch-size 8] [--threads 1] [--quick | --smoke] [--json OUT]

``--smoke`` (`run_all.py --smoke`, in CI): ``--quick``'s sizes, 24 pairs, 3 steps, and only the
three configurations the targets read (TRL padded, the runner padded and packed); no memory phase.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback  # noqa: E402

MAX_LENGTH = 1024  # above the longest sequence: nothing is truncated on either side
LR, BETA, SEED = 1e-4, 0.1, 42
MiB = 1024 * 1024


# ---- the data ----------------------------------------------------------------------------------


def preference_pairs(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` conversational pairs whose prompt and answers have log-normal word counts (medians
    ~24, ~48, ~48 words; at most 260 each), so pairs and their two sequences are uneven."""
    from ray_trainer._demo.chat import _WORDS

    rng = random.Random(seed)

    def text(median: float) -> str:
        words = min(260, max(2, int(rng.lognormvariate(math.log(median), 0.7))))
        return " ".join(rng.choice(_WORDS) for _ in range(words)).capitalize() + "."

    return [
        {
            "prompt": [{"role": "user", "content": text(24)}],
            "chosen": [{"role": "assistant", "content": text(48)}],
            "rejected": [{"role": "assistant", "content": text(48)}],
        }
        for _ in range(n)
    ]


def write_pairs(pairs: list[dict[str, Any]], folder: str) -> str:
    path = os.path.join(folder, "pairs.jsonl")
    with open(path, "w") as f:
        for pair in pairs:
            f.write(json.dumps(pair) + "\n")
    return path


def pair_lengths(tokenizer: Any, pairs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Each pair's (chosen, rejected) token counts, prompt included, as the chat template renders
    them (what both sides train on)."""

    def count(messages: list[dict[str, str]]) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False))

    return [(count(p["prompt"] + p["chosen"]), count(p["prompt"] + p["rejected"])) for p in pairs]


def padded_positions(lengths: list[tuple[int, int]], batch: int, trials: int = 2000) -> float:
    """The mean positions of a padded micro-batch of `batch` random pairs: 2 x `batch` rows
    padded to the longest of them."""
    rng = random.Random(0)
    return statistics.mean(
        2 * batch * max(max(p) for p in rng.sample(lengths, batch)) for _ in range(trials)
    )


# ---- measuring a run ---------------------------------------------------------------------------


def batch_tokens(batch: dict[str, Any]) -> tuple[int, int, int]:
    """(non-padding tokens, positions, sequences) of a DPO micro-batch on either side: a padded
    batch's attention mask and rows; a packed row (no mask) up to its filler, the sample after
    the row's last pair (each sample's `position_ids` start at 0), and its sequences."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum()), ids.numel(), ids.shape[0]
    starts = (batch["position_ids"][0] == 0).nonzero()[:, 0].tolist()
    sequences = int(batch["answer_tokens"].numel())
    tokens = starts[sequences] if len(starts) > sequences else ids.shape[-1]
    return int(tokens), ids.numel(), sequences


def peak_rss_bytes() -> int:
    """This process's peak resident set (`VmHWM`), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def tokens_per_s(clock: dict[str, Any], skip: int, pairs: int) -> dict[str, float]:
    """Tokens/s from step `skip` to the begin of the last step (steps that ended before the
    next began), the same tokens per CPU-second of the training process (every thread of it:
    less sensitive than the wall clock to other work on the machine), the median step time and
    the padding share. Every step must have trained `pairs` pairs (both sides the same work)."""
    begins, tokens, positions = clock["begins"], clock["tokens"], clock["positions"]
    last = len(begins) - 1
    if last - skip < 1:
        raise ValueError(f"{len(begins)} steps leave none to time after skipping {skip}")
    wrong = [(i, n) for i, n in enumerate(clock["sequences"]) if n != 2 * pairs]
    if wrong:
        raise ValueError(f"(step, sequences) {wrong[:5]}: a step trained other than {pairs} "
                         f"pairs ({2 * pairs} sequences)")  # fmt: skip
    seconds = begins[last] - begins[skip]
    steps = range(skip, last)
    tok, pos = sum(tokens[i] for i in steps), sum(positions[i] for i in steps)
    gaps = [begins[i + 1] - begins[i] for i in steps]
    cpu = clock["cpu"][last] - clock["cpu"][skip]
    return {
        "tokens_per_s": tok / seconds,
        "tokens_per_cpu_s": tok / cpu if cpu > 0 else float("nan"),
        "step_s": statistics.median(gaps),
        "padding_share": 1.0 - tok / pos,
        "tokens_per_step": tok / len(steps),
        "steps_timed": len(steps),
    }


class DpoClock(TrainerCallback):
    """Every rank, in the training worker: each step's begin time and tokens, and the process's
    peak RSS and torch threads at the end, written to `path` (one file per rank)."""

    runs_on = "all_ranks"

    def __init__(self, path: str) -> None:
        self.path = path
        self.begins: list[float] = []
        self.cpu: list[float] = []
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.sequences: list[int] = []
        self.peak_rss_begin = 0

    def on_train_begin(self, context, **kwargs):
        self.peak_rss_begin = peak_rss_bytes()

    def on_step_begin(self, context, **kwargs):
        self.begins.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.tokens.append(0)
        self.positions.append(0)
        self.sequences.append(0)

    def on_before_forward(self, context, **kwargs):
        tokens, positions, sequences = batch_tokens(kwargs["batch"])
        self.tokens[-1] += tokens
        self.positions[-1] += positions
        self.sequences[-1] += sequences

    def on_train_end(self, context, **kwargs):
        import torch

        with open(f"{self.path}.{context.rank}", "w") as f:
            json.dump(
                {
                    "begins": self.begins,
                    "cpu": self.cpu,
                    "tokens": self.tokens,
                    "positions": self.positions,
                    "sequences": self.sequences,
                    "end": time.perf_counter(),
                    "peak_rss": peak_rss_bytes(),
                    "peak_rss_begin": self.peak_rss_begin,
                    "torch_threads": torch.get_num_threads(),
                },
                f,
            )


# ---- the runner's side -------------------------------------------------------------------------


def runner_run(name: str, fields: dict[str, Any], folder: str, skip: int) -> dict[str, Any]:
    """One `run_training` in this process's Ray; its figures from rank 0's clock."""
    from ray_trainer import run_training

    out = os.path.join(folder, f"{name.replace(' ', '_')}-{time.time_ns()}.json")
    run_training(**fields, callbacks=[DpoClock(out)])
    with open(f"{out}.0") as f:
        clock = json.load(f)
    return clock_figures(clock, skip, fields["batch_size"])


def clock_figures(clock: dict[str, Any], skip: int, batch_size: int) -> dict[str, Any]:
    """A side's figures from its clock (either side writes one): tokens/s after `skip` steps,
    the training's wall time, its steps, peak RSS and torch threads."""
    return {
        **tokens_per_s(clock, skip, batch_size),
        "train_wall_s": clock["end"] - clock["begins"][0],
        "steps": len(clock["begins"]),
        "peak_rss": clock["peak_rss"],
        "peak_rss_begin": clock["peak_rss_begin"],
        "torch_threads": clock["torch_threads"],
    }


def reference_meta(storage: str) -> dict[str, Any] | None:
    """The runner's reference folder's meta (its pass's wall time, tasks, task-seconds)."""
    found = glob.glob(os.path.join(storage, ".ray_trainer", "data-cache", "*", "reference-*",
                                   "meta.json"))  # fmt: skip
    if not found:
        return None
    with open(found[0]) as f:
        return json.load(f)


# ---- TRL's side (a subprocess) -----------------------------------------------------------------


def trl_side(opts: argparse.Namespace) -> None:
    """In the subprocess: one `DPOTrainer.train()`; its clock written to `opts.out`."""
    import torch

    torch.set_num_threads(opts.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    clock: dict[str, Any] = {"begins": [], "cpu": [], "tokens": [], "positions": [],
                             "sequences": [], "reference_s": 0.0}  # fmt: skip

    class Counting(DPOTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            tokens, positions, sequences = batch_tokens(inputs)
            clock["tokens"].append(tokens)
            clock["positions"].append(positions)
            clock["sequences"].append(sequences)
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

        def _precompute_ref_logps(self, dataset, name, batch_size):
            started = time.perf_counter()
            out = super()._precompute_ref_logps(dataset, name, batch_size)
            clock["reference_s"] += time.perf_counter() - started
            return out

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["peak_rss_begin"] = peak_rss_bytes()

        def on_step_begin(self, args, state, control, **kwargs):
            clock["begins"].append(time.perf_counter())
            clock["cpu"].append(time.process_time())

        def on_train_end(self, args, state, control, **kwargs):
            clock["end"] = time.perf_counter()

    with open(opts.data) as f:
        pairs = [json.loads(line) for line in f]
    precompute = opts.side == "trl"
    with tempfile.TemporaryDirectory(prefix="bench_dpo_trl_") as out:
        config = DPOConfig(
            output_dir=out, per_device_train_batch_size=opts.batch_size, max_steps=opts.steps,
            learning_rate=LR, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=0,
            max_grad_norm=1.0, optim="adamw_torch", beta=BETA, loss_type=["sigmoid"],
            max_length=MAX_LENGTH, padding_free=False, precompute_ref_log_probs=precompute,
            use_cpu=True, bf16=False, gradient_checkpointing=False, disable_dropout=True,
            report_to="none", logging_steps=10, save_strategy="no", seed=SEED,
            dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Counting(
            model=AutoModelForCausalLM.from_pretrained(opts.model),
            args=config,
            train_dataset=Dataset.from_list(pairs),
            processing_class=AutoTokenizer.from_pretrained(opts.model),
            callbacks=[Steps()],
        )
        trainer.train()
    clock["peak_rss"] = peak_rss_bytes()
    clock["torch_threads"] = torch.get_num_threads()
    with open(opts.out, "w") as f:
        json.dump(clock, f)


def trl_run(
    side: str, model: str, data: str, folder: str, size: dict[str, int], threads: int
) -> dict[str, Any]:
    """TRL's side in a fresh subprocess with `threads` compute threads; `size`: its steps,
    batch_size and skip."""
    out = os.path.join(folder, f"{side}-{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", side, "--model", model]
    cmd += ["--data", data, "--out", out, "--steps", str(size["steps"])]
    cmd += ["--batch-size", str(size["batch_size"]), "--threads", str(threads)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{side} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")  # fmt: skip
    with open(out) as f:
        clock = json.load(f)
    return {
        **clock_figures(clock, size["skip"], size["batch_size"]),
        "reference_s": clock["reference_s"],
    }


# ---- the benchmark -----------------------------------------------------------------------------

LABELS = {
    "trl": "TRL DPOTrainer, padded, `precompute_ref_log_probs=True` (baseline)",
    "trl_ref_model": "TRL DPOTrainer, padded, reference model in each step (TRL's default)",
    "padded": "ray-trainer, padded, reference precomputed (default)",
    "packed": "ray-trainer, `packing=True`, reference precomputed",
    "in_step": "ray-trainer, padded, `precompute_reference=False` (frozen copy in each step)",
}
#: The configurations of the memory phase: each side, reference precomputed or in each step.
MEMORY = ("trl", "trl_ref_model", "padded", "in_step")


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=256, help="preference pairs in the data")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--skip", type=int, default=4, help="first steps left out (start-up)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--memory-hidden-size", type=int, default=768,
                        help="the memory phase's model (its weights show)")  # fmt: skip
    parser.add_argument("--memory-layers", type=int, default=4)
    parser.add_argument("--memory-pairs", type=int, default=8)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, 1 round")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="--quick, 3 steps, only TRL padded, runner padded and packed; no memory phase "
        "(run_all.py --smoke)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--side", choices=["trl", "trl_ref_model"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.side:
        trl_side(opts)
        return {}
    if opts.quick or opts.smoke:
        opts.pairs, opts.steps, opts.skip, opts.rounds = 48, 6, 2, 1
        opts.hidden_size, opts.layers, opts.memory_hidden_size, opts.memory_layers = 64, 2, 128, 2
        opts.memory_pairs = 8
    labels = list(LABELS)
    if opts.smoke:  # the targets' three configurations, the fewest steps tokens/s needs
        opts.pairs, opts.steps, opts.skip = 24, 3, 1
        labels = ["trl", "padded", "packed"]

    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_dpo_")
    pairs = preference_pairs(opts.pairs)
    init_ray(num_cpus=max(2, opts.threads + 1))
    try:  # models, data, storage and clocks: removed at the end (the figures are in the report)
        throughput = Phase(work, "throughput", opts.hidden_size, opts.layers, pairs, opts)
        size = {"steps": opts.steps, "batch_size": opts.batch_size, "skip": opts.skip}
        rows: dict[str, list[dict]] = {name: [] for name in labels}
        for r in range(opts.rounds):
            for name in labels if r % 2 == 0 else list(reversed(labels)):
                rows[name].append(throughput.run(name, size))
                _progress(f"round {r}", name, rows[name][-1])
        meta = reference_meta(throughput.storage)  # the pass of the first precomputing run
        peaks, memory = {}, None
        if not opts.smoke:
            memory = Phase(work, "memory", opts.memory_hidden_size, opts.memory_layers,
                           pairs[: opts.memory_pairs], opts)  # fmt: skip
            small = {"steps": opts.memory_steps, "batch_size": 2, "skip": 1}
            peaks = {name: memory.run(name, small) for name in MEMORY}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, run in peaks.items():
        _progress("memory", name, run)
    report = summarise(rows, meta, throughput, opts)
    if memory is not None:
        report.update(memory_report(peaks, memory))
        report["table"] += "\n\n" + report.pop("memory_table")
    report["seconds"] = time.perf_counter() - started
    report["machine"] = (
        machine() + f", trl {_version('trl')}, transformers {_version('transformers')}"
    )
    return emit(report, opts.json)


class Phase:
    """One model and one data file, and how each configuration runs on them: TRL in a
    subprocess, the runner in this process's Ray (a storage of the phase's own, so the runs after
    the first reuse its token cache and its reference pass)."""

    def __init__(
        self, work: str, name: str, hidden: int, layers: int, pairs: list[dict], opts: Any
    ) -> None:
        from transformers import AutoTokenizer

        from ray_trainer._demo.chat import make_tiny_chat_model

        folder = os.path.join(work, name)
        os.makedirs(folder)
        self.folder, self.threads = folder, opts.threads
        self.model = str(make_tiny_chat_model(os.path.join(folder, "model"), hidden_size=hidden,
                                              num_layers=layers))  # fmt: skip
        self.weights_bytes = os.path.getsize(os.path.join(self.model, "model.safetensors"))
        self.hidden, self.layers = hidden, layers
        self.data = write_pairs(pairs, folder)
        self.lengths = pair_lengths(AutoTokenizer.from_pretrained(self.model), pairs)
        longest = max(max(p) for p in self.lengths)
        if longest > MAX_LENGTH:
            raise ValueError(f"a sequence of {longest} tokens would be truncated ({MAX_LENGTH})")
        self.storage = os.path.join(folder, "storage")
        self.max_tokens: int | None = None

    def run(self, name: str, size: dict[str, int]) -> dict[str, Any]:
        if name.startswith("trl"):
            return trl_run(name, self.model, self.data, self.folder, size, self.threads)
        fields = dict(
            objective="dpo", model=self.model, data=self.data, max_length=MAX_LENGTH,
            batch_size=size["batch_size"], num_workers=1,
            resources_per_worker={"CPU": self.threads}, max_steps=size["steps"],
            log_every_steps=10, save_at_end=False, learning_rate=LR, weight_decay=0.01,
            lr_schedule="linear", warmup_steps=0, max_grad_norm=1.0, mixed_precision="no",
            dpo_beta=BETA, dpo_loss="sigmoid", seed=SEED, storage_path=self.storage,
        )  # fmt: skip
        if name == "packed":
            # As many positions per micro-batch as a padded one holds on average.
            mean = padded_positions(self.lengths, size["batch_size"])
            self.max_tokens = max(MAX_LENGTH, round(mean))
            fields.update(packing=True, max_tokens_per_batch=self.max_tokens)
        elif name == "in_step":
            fields.update(precompute_reference=False)
        return runner_run(name, fields, self.folder, size["skip"])


def _progress(when: str, name: str, run: dict[str, Any]) -> None:
    print(f"{when}, {name}: {run['tokens_per_s']:,.0f} tokens/s, step {run['step_s']:.3f} s, "
          f"peak RSS {run['peak_rss'] / MiB:,.0f} MiB", flush=True)  # fmt: skip


def _version(dist: str) -> str:
    from importlib import metadata

    return metadata.version(dist)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def summarise(
    rows: dict[str, list[dict]], meta: dict[str, Any] | None, phase: Any, opts: Any
) -> dict[str, Any]:
    """The throughput table (ratios to TRL's padded run with a precomputed reference), the
    reference pass's table and the targets."""
    base = median(rows["trl"], "tokens_per_s")
    ratios = {LABELS[k]: median(v, "tokens_per_s") / base for k, v in rows.items()}
    cpu_base = median(rows["trl"], "tokens_per_cpu_s")
    throughput = [
        {
            "configuration": LABELS[k],
            "tokens/s": f"{median(v, 'tokens_per_s'):,.0f}",
            "ratio (tokens/s)": f"{ratios[LABELS[k]]:.3f}",
            "tokens per CPU-s": f"{median(v, 'tokens_per_cpu_s'):,.0f}",
            "ratio (per CPU-s)": f"{median(v, 'tokens_per_cpu_s') / cpu_base:.3f}",
            "step (s)": f"{median(v, 'step_s'):.3f}",
            "tokens per step": f"{median(v, 'tokens_per_step'):,.0f}",
            "padding share": f"{median(v, 'padding_share'):.3f}",
            "torch threads": str(v[0]["torch_threads"]),
        }
        for k, v in rows.items()
    ]
    in_step = None  # --smoke runs neither reference-in-each-step configuration
    if "in_step" in rows and "trl_ref_model" in rows:
        in_step = median(rows["in_step"], "tokens_per_s") / median(
            rows["trl_ref_model"], "tokens_per_s"
        )
    pairs, batch = len(phase.lengths), opts.batch_size
    reference = [
        _reference_row("TRL, in its training process", "-", median(rows["trl"], "reference_s"),
                       pairs, median(rows["trl"], "train_wall_s"), rows["trl"][0]["steps"] * batch)
    ]  # fmt: skip
    if meta is not None:
        first = rows["padded"][0]  # the run that computed the pass
        reference.append(_reference_row(
            f"ray-trainer, {meta.get('tasks')} Ray task(s) of 1 CPU before the worker starts",
            f"{meta.get('task_s', 0):.1f}", meta["wall_s"], pairs, first["train_wall_s"],
            first["steps"] * batch,
        ))  # fmt: skip
    padded, packed = ratios[LABELS["padded"]], ratios[LABELS["packed"]]
    lens = sorted(x for p in phase.lengths for x in p)
    note = (
        f"{pairs} pairs; sequence tokens (prompt + answer) median {statistics.median(lens):.0f}, "
        f"p90 {lens[int(0.9 * len(lens))]}, longest {lens[-1]}; {batch} pairs per step, "
        f"{opts.steps} steps, the first {opts.skip} left out; max_tokens_per_batch="
        f"{phase.max_tokens} (a padded micro-batch's mean positions); model hidden "
        f"{phase.hidden}, {phase.layers} layers ({phase.weights_bytes / MiB:.1f} MiB fp32); "
        f"{opts.rounds} round(s), medians."
    )
    if in_step is not None:
        note += (
            f" Reference in each step on both sides: ray-trainer's frozen copy {in_step:.3f}x "
            "TRL's reference model."
        )
    targets = (
        f"Targets: ray-trainer padded / TRL padded {padded:.3f}x (>= 1.0: "
        f"{'met' if padded >= 1.0 else 'MISSED'}); ray-trainer packed / TRL padded {packed:.3f}x "
        f"(>= 1.5: {'met' if packed >= 1.5 else 'MISSED'})."
    )
    return {
        "table": "\n\n".join([table(throughput), note, targets, table(reference)]),
        "ratios": ratios,
        "baseline": LABELS["trl"],
        "higher_is_better": True,
        "in_step_ratio": in_step,
        "reference_meta": meta,
        "samples": rows,
        "target_met": padded >= 1.0 and packed >= 1.5,
    }


def _reference_row(
    side: str, task_s: str, ref_s: float, pairs: int, train_s: float, trained: int
) -> dict[str, str]:
    return {
        "reference pass": side,
        "pass wall (s)": f"{ref_s:.1f}",
        "task-seconds": task_s,
        "pairs scored": str(pairs),
        "training wall (s)": f"{train_s:.1f}",
        "pairs trained": str(trained),
        "pass / training": f"{ref_s / train_s:.3f}",
        "per pair: pass / training": f"{(ref_s / pairs) / (train_s / trained):.3f}",
    }


def memory_report(peaks: dict[str, dict], phase: Any) -> dict[str, Any]:
    """Each side's peak RSS with the reference precomputed and in each step, and the rise."""
    rows = []
    for name in MEMORY:
        base = peaks["trl" if name.startswith("trl") else "padded"]["peak_rss"]
        rows.append({
            "configuration": LABELS[name],
            "peak RSS before the first step (MiB)": f"{peaks[name]['peak_rss_begin'] / MiB:,.0f}",
            "peak RSS of the training process (MiB)": f"{peaks[name]['peak_rss'] / MiB:,.0f}",
            "vs precomputed (MiB)": f"{(peaks[name]['peak_rss'] - base) / MiB:+,.0f}",
        })  # fmt: skip
    rise = {side: peaks[b]["peak_rss"] - peaks[a]["peak_rss"]
            for side, a, b in (("trl", "trl", "trl_ref_model"),
                               ("ray-trainer", "padded", "in_step"))}  # fmt: skip
    note = (
        f"Memory phase: model hidden {phase.hidden}, {phase.layers} layers "
        f"({phase.weights_bytes / MiB:.1f} MiB of fp32 weights), {len(phase.lengths)} pairs, "
        f"2 pairs per step, {peaks['padded']['steps']} steps; peak RSS (VmHWM) of the one "
        "training process at the end of training."
    )
    return {"memory_table": table(rows) + "\n\n" + note, "memory_rise_bytes": rise,
            "memory_samples": peaks, "weights_bytes": phase.weights_bytes}  # fmt: skip


if __name__ == "__main__":
    main()
