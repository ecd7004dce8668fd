"""GRPO against TRL 1.16's `GRPOTrainer`: steps/s, completion tokens/s and where a step goes.

Both sides train the same tiny chat model (a Qwen2 shape, `make_tiny_chat_model`, ChatML
template, fp32, randomly initialised: it seldom samples its end token, so nearly every completion
runs to `max_completion_length` and both sides sample the same number of tokens) on the same
conversational prompt-only records (`{"prompt": [{"role": "user", ...}]}`, the user questions of
`chat_conversations`), with the same prompts per step, `num_generations`,
`max_completion_length`, temperature 1.0, sampling seed, reward function (`letters_share`, a
cheap reward computed from the text) and optimizer (AdamW, same lr, constant, clip 1.0; the
defaults of both: `loss_type="dapo"`, `beta=0`, one optimizer step per batch of completions),
transformers' `generate` on both sides, one training process each with the same torch threads
(`--threads`):

* TRL (baseline): `GRPOTrainer.train()` in a subprocess of this script (`OMP_NUM_THREADS` and
  `torch.set_num_threads` = `--threads`), `use_vllm=False` (transformers generation in the
  training process), `per_device_train_batch_size` = prompts x `num_generations` (TRL counts
  completions), `use_cpu=True`, `bf16=False`, `gradient_checkpointing=False`;
* the runner: `run_training(objective="grpo", num_workers=1, rollout_backend="hf",
  rollout_workers=1)` in this process's embedded Ray: one training worker of `--threads` CPUs
  and one `hf` rollout engine actor of `--threads` CPUs (`rollout_resources`), the reward
  function a Ray task; weights synced to the engine after each optimizer step. Its Ray workers
  run at niceness 0, as TRL's process (Ray's default is 15: on a busy machine they would wait
  for the cores while TRL's side did not).

Steps/s: the steps from the begin of step `--skip` to the begin of the last step over their wall
time (each side's own step boundary, so a gap between two begins is one whole step: rollout,
reward, loss and optimizer step); completion tokens/s: the completion tokens those steps sampled
(TRL: the ids its `_generate` returned; the runner: `completions/mean_length` x completions)
over the same time. Where a step goes, as shares of the median step: TRL's time in `_generate`
(rollout), `_calculate_rewards` (reward) and the rest (training: the old and new log-probs,
loss, backward, optimizer); the runner's logged `rollout/seconds`, `reward/seconds`,
`sync/seconds` and the rest (training). Rounds alternate the order; medians. Target: the
runner's steps/s >= 0.9x TRL's.

``--agents``: multi-turn episodes on both sides, TRL's `environment_factory` and ours given the
same environment (`bench_agents.Product`: ``multiply``), the tiny chat model warmed up to call
it (`make_tool_model`, `--warmup-steps`), "a*b=" prompts, temperature 0.5, at most 2 tool
rounds, 4 generations of up to 100 tokens (tool results included), 8 steps, the reward
`tool_answer` (the episode's messages, TRL's shape, on both sides); TRL parses the tool calls
with the same ChatML response template. Target: the runner's steps/s >= 0.9x TRL's, as without.

Usage: python bench/baselines/bench_grpo.py [--prompts 64] [--steps 12] [--skip 2] [--rounds 1]
       [--batch-prompts 4] [--generations 8] [--completion-length 32] [--threads 1]
       [--agents [--warmup-steps 150]] [--quick | --smoke] [--json OUT]

``--smoke`` (`run_all.py --smoke`, in CI): a model of width 32, 2 prompts x 2 generations of 4
tokens, 3 steps, one round.
"""

from __future__ import annotations

import argparse
import json
import os
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

LR, SEED, MAX_LENGTH = 1e-5, 42, 512
#: The target: the runner's steps/s against TRL's.
TARGET = 0.9
#: Where a step goes: the runner's logged timings (seconds of the step) per share.
PHASES = {"rollout": "rollout/seconds", "reward": "reward/seconds", "sync": "sync/seconds"}


# ---- the data and the reward ------------------------------------------------------------------


def prompt_records(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """`n` conversational prompt-only records: the first user question (and the system message
    before it, where there is one) of each of `n` generated conversations."""
    from ray_trainer._demo.chat import chat_conversations

    out = []
    for conversation in chat_conversations(n, seed=seed, max_exchanges=1):
        first_user = next(i for i, m in enumerate(conversation) if m["role"] == "user")
        out.append({"prompt": conversation[: first_user + 1]})
    return out


def write_inputs(work: str, opts: Any) -> tuple[str, str]:
    """The tiny chat model (`opts.hidden_size`, `opts.layers`) and `opts.prompts` prompt-only
    records, written into `work`: their paths."""
    from ray_trainer._demo.chat import make_tiny_chat_model

    model = str(make_tiny_chat_model(os.path.join(work, "model"), hidden_size=opts.hidden_size,
                                     num_layers=opts.layers))  # fmt: skip
    data = os.path.join(work, "prompts.jsonl")
    with open(data, "w") as f:
        for record in prompt_records(opts.prompts):
            f.write(json.dumps(record) + "\n")
    return model, data


def write_agent_inputs(work: str, opts: Any) -> tuple[str, str]:
    """``--agents``: the tiny chat model warmed up to call ``multiply`` (`make_tool_model`) and
    `opts.prompts` "a*b=" records with their ``answer``, written into `work`: their paths."""
    from ray_trainer.demo import make_tool_model, product_prompts

    model = make_tool_model(os.path.join(work, "model"), steps=opts.warmup_steps)
    data = os.path.join(work, "prompts.jsonl")
    with open(data, "w") as f:
        for record in product_prompts(opts.prompts):
            f.write(json.dumps({k: v for k, v in record.items() if k != "id"}) + "\n")
    return model, data


def tool_answer(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """``--agents``: the reward of both sides (TRL's signature; a completion is the episode's
    messages): 1.0 where the last message's text is the product, else the share of its
    characters that are digits (so a group's rewards differ)."""
    out = []
    for messages, want in zip(completions, answer, strict=True):
        text = (messages[-1].get("content") or "").strip()
        out.append(1.0 if text == want else sum(c.isdigit() for c in text) / max(len(text), 1) / 2)
    return out


def letters_share(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """The reward of both sides (TRL's signature): the share of a completion's characters that
    are letters or spaces, so that the rewards of a group differ (never all equal)."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[0]["content"]
        out.append(sum(c.isalpha() or c == " " for c in text) / max(len(text), 1))
    return out


# ---- measuring a run ---------------------------------------------------------------------------


def step_figures(clock: dict[str, Any], skip: int) -> dict[str, Any]:
    """Steps/s and completion tokens/s from step `skip` to the begin of the last step, the same
    tokens per CPU-second of the training process, the median step and the median share of a
    step in each phase of `clock["phases"]` (seconds per step; the rest is "training"); and the
    CPU-seconds per step of all the side's processes (`cpu_per_step`): the training process's
    where the clock has no `tree` (TRL: one process), else the Ray processes' (`tree_cpu`), with
    their parts (`cpu_parts`)."""
    begins, tokens = clock["begins"], clock["tokens"]
    last = len(begins) - 1
    if last - skip < 1:
        raise ValueError(f"{len(begins)} steps leave none to time after skipping {skip}")
    if len(tokens) < last:
        raise ValueError(f"completion tokens of {len(tokens)} steps for {last} timed steps")
    steps = range(skip, last)
    seconds = begins[last] - begins[skip]
    gaps = [begins[i + 1] - begins[i] for i in steps]
    tok = sum(tokens[i] for i in steps)
    cpu = clock["cpu"][last] - clock["cpu"][skip]
    shares: dict[str, float] = {}
    for phase, per_step in clock["phases"].items():
        shares[phase] = statistics.median(per_step[i] / gaps[k] for k, i in enumerate(steps))
    shares["training"] = 1.0 - sum(shares.values())
    parts = {"training process": cpu}
    tree = clock.get("tree") or {}
    if str(skip) in tree and str(last) in tree:
        parts = tree_cpu(tree[str(skip)], tree[str(last)])
    return {
        "steps_per_s": len(steps) / seconds,
        "tokens_per_s": tok / seconds,
        "tokens_per_cpu_s": tok / cpu if cpu > 0 else float("nan"),
        "step_s": statistics.median(gaps),
        "tokens_per_step": tok / len(steps),
        "steps_timed": len(steps),
        "shares": shares,
        "cpu_per_step": sum(parts.values()) / len(steps),
        "cpu_parts": {k: v / len(steps) for k, v in parts.items()},
    }


#: The runner's Ray processes by their title: the part of a step's CPU each is counted in.
CPU_PARTS = {"ray::RayTrainWorker": "training worker", "ray::RolloutActor": "rollout engine"}


def ray_processes() -> dict[str, list]:
    """In a Ray worker: ``{pid: [title, CPU-seconds]}`` of its raylet and every process under it
    (the training worker, the engines, the reward tasks' workers, the callback actor ...)."""
    import psutil

    raylet = psutil.Process(os.getppid())
    out: dict[str, list] = {}
    for proc in [raylet, *raylet.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            out[str(proc.pid)] = [proc.cmdline()[0] if proc.cmdline() else proc.name(),
                                  times.user + times.system]  # fmt: skip
        except psutil.Error:  # ended meanwhile
            continue
    return out


def tree_cpu(before: dict[str, list], after: dict[str, list]) -> dict[str, float]:
    """The CPU-seconds the processes of `after` spent since `before` (a process new in `after`:
    all of its own), by part (`CPU_PARTS`, else "other Ray processes"); a process gone by
    `after` is not counted."""
    parts: dict[str, float] = {}
    for pid, (title, seconds) in after.items():
        spent = seconds - (before[pid][1] if pid in before else 0.0)
        part = next((v for k, v in CPU_PARTS.items() if title.startswith(k)), None)
        part = part or "other Ray processes"
        parts[part] = parts.get(part, 0.0) + spent
    return parts


class GrpoClock(TrainerCallback):
    """Every rank, in the training worker: each step's begin time and CPU time, at the begin of
    the steps `tree_at` the CPU-seconds of every Ray process (`ray_processes`), and from its
    log (`log_every_steps=1`) the step's completion tokens and rollout, reward and sync seconds,
    and every number it logged (`logged`); written to `path` (one file per rank) at the end."""

    runs_on = "all_ranks"

    def __init__(self, path: str, completions_per_step: int, tree_at: tuple[int, ...] = ()) -> None:
        self.path = path
        self.completions = completions_per_step
        self.tree_at = tuple(tree_at)
        self.tree: dict[str, dict[str, list]] = {}
        self.begins: list[float] = []
        self.cpu: list[float] = []
        self.tokens: list[float] = []
        self.phases: dict[str, list[float]] = {phase: [] for phase in PHASES}
        self.logged: list[dict[str, float]] = []

    def on_step_begin(self, context, **kwargs):
        if len(self.begins) in self.tree_at:  # before this step's clock: not counted in it
            self.tree[str(len(self.begins))] = ray_processes()
        self.begins.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def on_log(self, context, **kwargs):
        metrics = context.batch_metrics
        self.tokens.append(metrics["completions/mean_length"] * self.completions)
        for phase, name in PHASES.items():
            self.phases[phase].append(float(metrics.get(name) or 0.0))
        self.logged.append({k: v for k, v in metrics.items() if isinstance(v, (int, float))})

    def on_train_end(self, context, **kwargs):
        import torch

        with open(f"{self.path}.{context.rank}", "w") as f:
            json.dump(
                {
                    "begins": self.begins,
                    "cpu": self.cpu,
                    "tokens": self.tokens,
                    "phases": self.phases,
                    "tree": self.tree,
                    "rewards": [m.get("reward") for m in self.logged],
                    "logged": self.logged,
                    "torch_threads": torch.get_num_threads(),
                },
                f,
            )


# ---- the runner's side -------------------------------------------------------------------------


def runner_fields(
    model: str, data: str, size: dict[str, int], threads: int, storage: str, agents: bool = False
) -> dict:
    """The `run_training` fields of the runner's side: the same work as TRL's (`agents`: with
    the ``multiply`` environment, its episodes in an environment actor)."""
    fields = dict(
        objective="grpo", model=model, data=data, max_length=MAX_LENGTH,
        batch_size=size["batch_prompts"], num_workers=1, resources_per_worker={"CPU": threads},
        max_steps=size["steps"], log_every_steps=1, save_at_end=False, learning_rate=LR,
        lr_schedule="constant", warmup_steps=0, max_grad_norm=1.0, mixed_precision="no",
        seed=SEED, storage_path=storage, reward_fns=[letters_share], rollout_backend="hf",
        rollout_workers=1, rollout_resources={"CPU": threads},
        grpo={"num_generations": size["generations"],
              "max_completion_length": size["completion_length"], "temperature": 1.0},
    )  # fmt: skip
    if agents:
        from bench_agents import Product

        fields.update(environment_factory=Product, reward_fns=[tool_answer],
                      environment_resources={"CPU": 0.1}, max_length=AGENT_MAX_LENGTH)  # fmt: skip
        fields["grpo"] = {**fields["grpo"], **AGENT_GRPO}
    return fields


#: ``--agents``: the sampling and turns of both sides (the warmed-up model at temperature 0.5
#: calls the tool in nearly every episode), and the longest prompt + episode.
AGENT_GRPO = {"temperature": 0.5, "max_tool_calling_iterations": 2}
AGENT_MAX_LENGTH = 640


def runner_run(fields: dict[str, Any], folder: str, size: dict[str, int]) -> dict[str, Any]:
    """One `run_training` in this process's Ray; its figures from rank 0's clock."""
    from ray_trainer import run_training

    out = os.path.join(folder, f"runner-{time.time_ns()}.json")
    completions = size["batch_prompts"] * size["generations"]
    tree_at = (size["skip"], size["steps"] - 1)  # the timed steps' first and last begins
    run_training(**fields, callbacks=[GrpoClock(out, completions, tree_at)])
    with open(f"{out}.0") as f:
        clock = json.load(f)
    return {**step_figures(clock, size["skip"]), "rewards": clock["rewards"],
            "torch_threads": clock["torch_threads"]}  # fmt: skip


# ---- TRL's side (a subprocess) -----------------------------------------------------------------


def trl_side(opts: argparse.Namespace) -> None:
    """In the subprocess: one `GRPOTrainer.train()`; its clock written to `opts.out`."""
    import torch

    torch.set_num_threads(opts.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    clock: dict[str, Any] = {"begins": [], "cpu": [], "tokens": [], "rewards": [],
                             "phases": {"rollout": [], "reward": []}}  # fmt: skip

    class Timed(GRPOTrainer):
        def _generate(self, prompts):
            started = time.perf_counter()
            out = super()._generate(prompts)
            clock["phases"]["rollout"].append(time.perf_counter() - started)
            clock["tokens"].append(sum(len(ids) for ids in out[1]))  # the completion ids
            return out

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            started = time.perf_counter()
            out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            clock["phases"]["reward"].append(time.perf_counter() - started)
            clock["rewards"].append(float(out.nansum(dim=1).mean()))
            return out

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock["begins"].append(time.perf_counter())
            clock["cpu"].append(time.process_time())

    with open(opts.data) as f:
        records = [json.loads(line) for line in f]
    tokenizer = AutoTokenizer.from_pretrained(opts.model)
    extra: dict[str, Any] = {}
    sampling: dict[str, Any] = {"temperature": 1.0}
    reward = letters_share
    if opts.agents:  # the same environment; TRL parses the ChatML tool calls as we do
        from bench_agents import Product

        from ray_trainer._agents.tools import CHATML_TOOL_CALLS

        tokenizer.response_template = CHATML_TOOL_CALLS
        extra, reward = {"environment_factory": Product}, tool_answer
        sampling = dict(AGENT_GRPO)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_trl_") as out:
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=opts.batch_prompts * opts.generations,
            gradient_accumulation_steps=1, num_generations=opts.generations,
            max_completion_length=opts.completion_length, **sampling,
            max_steps=opts.steps, learning_rate=LR, lr_scheduler_type="constant",
            warmup_steps=0, max_grad_norm=1.0, optim="adamw_torch", use_vllm=False,
            use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
            logging_steps=1, save_strategy="no", seed=SEED, dataloader_num_workers=0,
        )  # fmt: skip
        trainer = Timed(
            model=AutoModelForCausalLM.from_pretrained(opts.model),
            reward_funcs=[reward],
            args=config,
            train_dataset=Dataset.from_list(records),
            processing_class=tokenizer,
            callbacks=[Steps()],
            **extra,
        )
        trainer.train()
    clock["torch_threads"] = torch.get_num_threads()
    with open(opts.out, "w") as f:
        json.dump(clock, f)


def trl_run(
    model: str, data: str, folder: str, size: dict[str, int], threads: int, agents: bool = False
) -> dict:
    """TRL's side in a fresh subprocess with `threads` compute threads."""
    out = os.path.join(folder, f"trl-{time.time_ns()}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--side", "trl", "--model", model]
    cmd += ["--agents"] if agents else []
    cmd += ["--data", data, "--out", out, "--steps", str(size["steps"])]
    cmd += ["--batch-prompts", str(size["batch_prompts"]), "--generations",
            str(size["generations"]), "--completion-length", str(size["completion_length"]),
            "--threads", str(threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trl failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"\n{proc.stderr[-4000:]}")  # fmt: skip
    with open(out) as f:
        clock = json.load(f)
    return {**step_figures(clock, size["skip"]), "rewards": clock["rewards"],
            "torch_threads": clock["torch_threads"]}  # fmt: skip


# ---- the benchmark -----------------------------------------------------------------------------

LABELS = {
    "trl": "TRL GRPOTrainer, transformers generation in the training process (baseline)",
    "runner": "ray-trainer, objective='grpo', an `hf` rollout engine actor",
}
SIDES = ("trl", "runner")


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=64, help="prompt-only records")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out (start-up)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--batch-prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="num_generations")
    parser.add_argument("--completion-length", type=int, default=32,
                        help="max_completion_length")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--agents", action="store_true",
                        help="multi-turn: the multiply environment and its warmed-up model")  # fmt: skip
    parser.add_argument("--warmup-steps", type=int, default=150,
                        help="--agents: the tool model's warm-up steps")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smaller sizes, 1 round")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest sizes, 3 steps (run_all.py --smoke)")  # fmt: skip
    parser.add_argument("--json", default=None)
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.side:
        trl_side(opts)
        return {}
    if opts.agents:  # an episode: a tool call (~70 tokens), its result, the answer
        opts.generations, opts.completion_length, opts.steps = 4, 100, 8
    if opts.quick:
        opts.steps, opts.skip, opts.rounds, opts.hidden_size, opts.layers = 8, 2, 1, 128, 2
    if opts.smoke:
        opts.prompts, opts.steps, opts.skip, opts.rounds = 8, 3, 1, 1
        opts.batch_prompts, opts.generations, opts.completion_length = 2, 2, 4
        opts.hidden_size, opts.layers, opts.warmup_steps = 32, 1, 10

    started = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_grpo_")
    size = {"steps": opts.steps, "skip": opts.skip, "batch_prompts": opts.batch_prompts,
            "generations": opts.generations, "completion_length": opts.completion_length}  # fmt: skip
    # Ray starts its workers at niceness 15; TRL's side runs at 0. On a machine with other work
    # the runner's worker and engine would wait for the cores: the same priority on both sides
    # (the smoke run's shared Ray sets it too, `run_all.SMOKE_RAY_ENV`).
    os.environ.setdefault("RAY_worker_niceness", "0")
    # The training worker and the rollout engine, a CPU or `threads` each, and the reward task.
    init_ray(num_cpus=max(3, 2 * opts.threads + 1) + int(opts.agents))  # agents: environments
    try:  # the model, data and storage: removed at the end (the figures are in the report)
        model, data = (write_agent_inputs if opts.agents else write_inputs)(work, opts)
        storage = os.path.join(work, "storage")
        rows: dict[str, list[dict]] = {side: [] for side in SIDES}
        for r in range(opts.rounds):
            for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                if side == "trl":
                    run = trl_run(model, data, work, size, opts.threads, opts.agents)
                else:
                    fields = runner_fields(model, data, size, opts.threads, storage, opts.agents)
                    run = runner_run(fields, work, size)
                rows[side].append(run)
                print(f"round {r}, {side}: {run['steps_per_s']:.3f} steps/s, "
                      f"{run['tokens_per_s']:,.0f} completion tokens/s, shares "
                      f"{_shares_text(run['shares'])}; CPU-s per step "
                      f"{run['cpu_per_step']:.3f} ({_shares_text(run['cpu_parts'])})",
                      flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = summarise(rows, opts)
    report["seconds"] = time.perf_counter() - started
    report["machine"] = (
        machine() + f", trl {_version('trl')}, transformers {_version('transformers')}"
    )
    return emit(report, opts.json)


def _shares_text(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in shares.items())


def _version(dist: str) -> str:
    from importlib import metadata

    return metadata.version(dist)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def median_shares(runs: list[dict]) -> dict[str, float]:
    """Each phase's median share over the runs (a phase a side does not have: absent)."""
    phases = {k for r in runs for k in r["shares"]}
    return {k: statistics.median(r["shares"].get(k, 0.0) for r in runs) for k in phases}


def summarise(rows: dict[str, list[dict]], opts: Any) -> dict[str, Any]:
    """The throughput table (ratios of steps/s to TRL's), the step shares and the target."""
    base = median(rows["trl"], "steps_per_s")
    ratios = {LABELS[k]: median(v, "steps_per_s") / base for k, v in rows.items()}
    tok_base = median(rows["trl"], "tokens_per_s")
    cpu_base = median(rows["trl"], "tokens_per_cpu_s")
    step_cpu_base = median(rows["trl"], "cpu_per_step")
    throughput = [
        {
            "configuration": LABELS[k],
            "steps/s": f"{median(v, 'steps_per_s'):.3f}",
            "ratio (steps/s)": f"{ratios[LABELS[k]]:.3f}",
            "completion tokens/s": f"{median(v, 'tokens_per_s'):,.0f}",
            "ratio (tokens/s)": f"{median(v, 'tokens_per_s') / tok_base:.3f}",
            "ratio (tokens per CPU-s of the training process)": (
                f"{median(v, 'tokens_per_cpu_s') / cpu_base:.3f}"
            ),
            "step (s)": f"{median(v, 'step_s'):.3f}",
            "CPU-s per step (all its processes)": f"{median(v, 'cpu_per_step'):.3f}",
            "ratio (TRL's CPU-s per step / this)": (
                f"{step_cpu_base / median(v, 'cpu_per_step'):.3f}"
            ),
            "completion tokens per step": f"{median(v, 'tokens_per_step'):,.0f}",
            "torch threads": str(v[0]["torch_threads"]),
        }
        for k, v in rows.items()
    ]
    part_names = sorted({p for v in rows.values() for r in v for p in r["cpu_parts"]})
    cpu_parts = [
        {
            "configuration": LABELS[k],
            **{
                f"{p} (CPU-s per step)": (
                    f"{statistics.median(r['cpu_parts'].get(p, 0.0) for r in v):.3f}"
                )
                for p in part_names
            },
        }
        for k, v in rows.items()
    ]
    phases = ("rollout", "reward", "sync", "training")
    shares = {k: median_shares(v) for k, v in rows.items()}
    where = [
        {
            "configuration": LABELS[k],
            **{
                f"{p} share": f"{shares[k][p]:.3f}" if p in shares[k] else "-"
                for p in phases
            },
            "step (s)": f"{median(rows[k], 'step_s'):.3f}",
            **{
                f"{p} (s)": f"{shares[k][p] * median(rows[k], 'step_s'):.3f}"
                if p in shares[k] else "-"
                for p in phases
            },
        }
        for k in rows
    ]  # fmt: skip
    ratio = ratios[LABELS["runner"]]
    completions = opts.batch_prompts * opts.generations
    model = (
        "the tiny chat model warmed up to call `multiply` (hidden 64, 2 layers), episodes of at "
        "most 2 tool rounds at temperature 0.5, the environment in an actor on the runner's side"
        if getattr(opts, "agents", False)
        else f"model hidden {opts.hidden_size}, {opts.layers} layers"
    )
    note = (
        f"{opts.prompts} prompts; {opts.batch_prompts} prompts x {opts.generations} generations "
        f"= {completions} completions of at most {opts.completion_length} tokens a step; "
        f"{opts.steps} steps, the first {opts.skip} left out; {model}, "
        f"fp32; {opts.threads} torch thread(s) a side; {opts.rounds} "
        "round(s), medians. Shares: of the median step; TRL's rollout is its `_generate`, its "
        "reward `_calculate_rewards`, in its one process (no sync); the runner's are its logged "
        "`rollout/seconds` (the engine's sampling and log-probs, in its actor), "
        "`reward/seconds` (the Ray task) and `sync/seconds`; training is the rest of the step. "
        "Tokens per CPU-s count the training process's CPU time only: TRL's includes its "
        "generation, the runner's not (its engine is another process), so that ratio flatters "
        "the runner. CPU-s per step count every process of a side over the timed steps: TRL's "
        "one process; the runner's Ray processes (its raylet and everything under it: the "
        "training worker, the engine, the reward tasks' workers, the callback actor, Ray "
        "Train's controller), the figure that a loaded machine disturbs least. Steps/s (on an "
        "idle machine) is the figure held against the target."
    )
    target = (
        f"Target: ray-trainer steps/s / TRL's {ratio:.3f}x (>= {TARGET}: "
        f"{'met' if ratio >= TARGET else 'MISSED'})."
    )
    return {
        "table": "\n\n".join([table(throughput), table(where), table(cpu_parts), note, target]),
        "ratios": ratios,
        "baseline": LABELS["trl"],
        "higher_is_better": True,
        "shares": shares,
        "samples": rows,
        "target_met": ratio >= TARGET,
    }


if __name__ == "__main__":
    main()
