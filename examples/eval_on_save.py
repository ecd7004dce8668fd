"""Evaluate every checkpoint as a separate Ray task while training goes on; stop early on it.

On a GPU cluster give the evaluation `num_gpus=1` and it lands on a spare GPU; here it runs on
CPU. Runs on an embedded local Ray:

    python examples/eval_on_save.py --max-steps 600
"""

from __future__ import annotations

import argparse

from ray_trainer import (
    EarlyStopping,
    EvalOnSave,
    JsonlLogger,
    ProgressBar,
    load_model_state,
    run_training,
)
from ray_trainer.demo import build_demo, exact_match


def evaluate(checkpoint_path: str, step: int) -> dict:
    """Runs as a Ray task, wherever there is room: reads the persisted checkpoint."""
    demo = build_demo()
    model = demo.model_factory()
    model.load_state_dict(load_model_state(checkpoint_path))
    return {"exact_match": exact_match(model, demo.val_dataset, n=300)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--num-gpus", type=float, default=0)
    opts = parser.parse_args()
    result = run_training(
        max_steps=opts.max_steps,
        num_workers=2,
        batch_size=64,
        learning_rate=2e-3,
        warmup_steps=50,
        save_every_steps=100,
        log_every_steps=50,
        storage_path="./runs",
        callbacks=[
            ProgressBar(),
            JsonlLogger(),
            EvalOnSave(evaluate, num_gpus=opts.num_gpus, num_cpus=1, max_in_flight=2),
            EarlyStopping("exact_match", mode="max", patience=3, min_delta=0.01),
        ],
    )
    for e in result.evaluations:
        print(f"step {e['step']}: {e.get('metrics') or e.get('error')}")
    print(result.summary())


if __name__ == "__main__":
    main()
