"""Evaluation on save through `EvalOnSave` against the same evaluation run inside the loop.

Both configurations are a real 2-worker `run_training` of the demo model and data, saving every
`--save-every` steps (and at the end), and are timed end to end (the wall time of the call,
which includes waiting for the last evaluation):

* in-loop (baseline): a rank-0 worker-side callback (`runs_on="rank0"`) whose `on_save` runs
  the evaluation synchronously: the loop waits for it, as with Hugging Face Trainer's in-loop
  evaluation (rank 1 waits at the next step's all-reduce);
* EvalOnSave: `EvalOnSave(evaluate, num_gpus=0, num_cpus=1)` on the callback actor launches each
  evaluation as a Ray task and training goes on.

`evaluate(checkpoint_path, step)` is the same function in both: it loads the checkpoint's model,
computes the loss on a few validation batches, then sleeps until `--eval-seconds` have passed
since it started, to model a real evaluation of that length on a spare accelerator (a real one
would also compete with the training workers for this machine's 2 cores). Rounds alternate the
configurations (and their order); medians are reported with the ratio to in-loop.

With ``--generation --python PATH`` it measures instead `GenerationEval` on checkpoints of one
chat model: transformers, vLLM cold and vLLM warm (``keep_engine=True``), their wall time per
evaluation and whether their answers agree (`_eval_generation.py`; PATH is the interpreter of
the vLLM environment, ``bash bench/eval/vllm_env.sh`` prints it). Target: warm at least 3x faster
than cold.

Usage: python bench/eval/bench_eval.py [--max-steps 80] [--save-every 20] [--eval-seconds 2]
       [--rounds 2] [--workers 2] [--json OUT]
       python bench/eval/bench_eval.py --generation --python "$(bash bench/eval/vllm_env.sh)" [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

from callbacks import TrainerCallback  # noqa: E402


def make_evaluate(seconds: float, batches: int = 4):
    """`evaluate(checkpoint_path, step)`: the model's loss on a few val batches, padded to `seconds`.

    A plain function (a closure), since `EvalOnSave` makes a Ray task of it. Runs where it is
    called: in an evaluation Ray task (EvalOnSave) or in the rank-0 training process (in-loop).
    Touches only the checkpoint folder it is given.
    """

    def evaluate(checkpoint_path: str, step: int) -> dict:
        import torch

        from ray_trainer._demo import build_demo

        start = time.perf_counter()
        demo = build_demo(n_train=64, n_val=64 * batches)
        model = demo.model_factory()
        state = torch.load(os.path.join(checkpoint_path, "model.pt"), map_location="cpu")
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            losses = [
                float(model(**demo.val_dataset[i * 64 : (i + 1) * 64]).loss) for i in range(batches)
            ]
        computed = time.perf_counter() - start
        time.sleep(max(0.0, seconds - computed))
        return {"val_loss": sum(losses) / len(losses), "compute_s": computed}

    return evaluate


class InLoopEval(TrainerCallback):
    """Rank 0, in the training process: runs the evaluation synchronously at each save."""

    runs_on = "rank0"

    def __init__(self, evaluate, log_path: str) -> None:
        self.evaluate = evaluate
        self.log_path = log_path  # one line per evaluation done, read back by the driver

    def on_save(self, context, **kwargs):
        metrics = self.evaluate(context.checkpoint_path, context.global_step)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"step": context.global_step, **metrics}) + "\n")


def run(mode: str, opts: argparse.Namespace) -> tuple[float, int]:
    """One run; returns (wall seconds of `run_training`, evaluations completed)."""
    evaluate = make_evaluate(opts.eval_seconds)
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as storage:
        return _timed_run(mode, opts, evaluate, storage)


def _timed_run(mode: str, opts: argparse.Namespace, evaluate, storage: str) -> tuple[float, int]:
    from callbacks import EvalOnSave
    from ray_trainer import run_training

    log_path = os.path.join(storage, "in_loop_evals.jsonl")
    if mode == "in_loop":
        callbacks = [InLoopEval(evaluate, log_path)]
    else:
        callbacks = [EvalOnSave(evaluate, num_gpus=0, num_cpus=1)]
    start = time.perf_counter()
    result = run_training(
        max_steps=opts.max_steps,
        batch_size=64,
        learning_rate=2e-3,
        num_workers=opts.workers,
        log_every_steps=50,
        save_every_steps=opts.save_every,
        storage_path=storage,
        callbacks=callbacks,
    )
    wall = time.perf_counter() - start
    if mode == "in_loop":
        with open(log_path) as f:
            done = sum(1 for _ in f)
    else:
        failed = [e for e in result.evaluations if e.get("error")]
        if failed:
            raise RuntimeError(f"EvalOnSave evaluations failed: {failed}")
        done = len(result.evaluations)
    return wall, done


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--eval-seconds", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2, help="training workers of each run")
    parser.add_argument("--json", default=None)
    parser.add_argument("--generation", action="store_true", help="GenerationEval: hf, vLLM")
    parser.add_argument("--python", default=None, help="the vLLM environment's interpreter")
    opts = parser.parse_args()
    if opts.generation:
        return generation_report(opts)

    import ray

    # 2 CPUs for the training workers, 2 for evaluation tasks.
    init_ray(num_cpus=4)
    samples: dict[str, list[float]] = {"in_loop": [], "eval_on_save": []}
    evaluations: dict[str, list[int]] = {"in_loop": [], "eval_on_save": []}
    for r in range(opts.rounds):
        for mode in list(samples) if r % 2 == 0 else reversed(list(samples)):
            wall, done = run(mode, opts)
            samples[mode].append(wall)
            evaluations[mode].append(done)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in samples.items()))
    ray.shutdown()

    labels = {
        "in_loop": "evaluation in the loop, rank-0 `on_save` (baseline)",
        "eval_on_save": "`EvalOnSave`, Ray task per checkpoint",
    }
    base = statistics.median(samples["in_loop"])
    rows, ratios = [], {}
    for key, values in samples.items():
        med = statistics.median(values)
        ratios[labels[key]] = med / base
        rows.append(
            {
                "configuration": labels[key],
                "evaluations": evaluations[key][-1],
                "run wall (s)": f"{med:.1f}",
                "vs in-loop (s)": f"{med - base:+.1f}",
                "ratio": f"{med / base:.3f}",
            }
        )
    report = {
        "machine": machine(),
        "max_steps": opts.max_steps,
        "save_every_steps": opts.save_every,
        "eval_seconds": opts.eval_seconds,
        "rounds": opts.rounds,
        "samples_s": samples,
        "evaluations": evaluations,
        "baseline": labels["in_loop"],
        "ratios": ratios,
        "table": table(
            rows, ["configuration", "evaluations", "run wall (s)", "vs in-loop (s)", "ratio"]
        ),
    }
    return emit(report, opts.json)


def generation_report(opts: argparse.Namespace) -> dict:
    from _eval_generation import WARM_TARGET, generation_rows, run_generation

    if not opts.python:
        raise SystemExit("--generation needs --python: the vLLM env's interpreter")
    result = run_generation(opts.python)
    ratio = result["cold_over_warm"]
    verdict = "met" if ratio >= WARM_TARGET else "NOT met"
    return emit(
        {
            "machine": machine(),
            **result,
            "table": table(generation_rows(result)) + f"\n\nvLLM cold / warm: {ratio:.2f}x "
            f"(target at least {WARM_TARGET:g}x: {verdict})",
        },
        opts.json,
    )


if __name__ == "__main__":
    main()
