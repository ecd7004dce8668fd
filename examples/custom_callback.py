"""A custom callback in each of the three places a callback can run.

Runs the built-in demo on an embedded local Ray (2 workers, CPU):

    python examples/custom_callback.py --max-steps 200
"""

from __future__ import annotations

import argparse
import time

from ray_trainer import TrainerCallback, TrainerControl, run_training


class LossAlarm(TrainerCallback):
    """On the callback actor (the default): never slows training; may ask to stop."""

    def __init__(self, limit: float, patience: int = 3) -> None:
        self.limit, self.patience, self.bad = limit, patience, 0

    def on_log(self, context, **kwargs):
        self.bad = self.bad + 1 if context.loss > self.limit else 0
        print(f"[alarm] step {context.global_step}: loss {context.loss:.3f} (bad logs: {self.bad})")
        if self.bad >= self.patience:
            return TrainerControl(should_training_stop=True, stop_reason="loss stayed high")
        return None

    # Stateful: saved in every checkpoint, restored on resume.
    def state_dict(self):
        return {"bad": self.bad}

    def load_state_dict(self, state):
        self.bad = state["bad"]


class WeightNorm(TrainerCallback):
    """On rank 0, inside the training process: sees the live model."""

    runs_on = "rank0"

    def on_evaluate(self, context, **kwargs):
        norm = sum(float(p.detach().norm()) ** 2 for p in context.model.parameters()) ** 0.5
        print(f"[rank0] step {context.global_step}: weight norm {norm:.2f}, {context.val_metrics}")


class StepClock(TrainerCallback):
    """On every rank: times its own steps (each rank has its own copy and its own state)."""

    runs_on = "all_ranks"

    def on_step_begin(self, context, **kwargs):
        self.t0 = time.perf_counter()

    def on_step_end(self, context, **kwargs):
        context.user_state["last_step_ms"] = (time.perf_counter() - self.t0) * 1e3

    def on_train_end(self, context, **kwargs):
        print(
            f"[rank {context.rank}] last step took {context.user_state.get('last_step_ms', 0):.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=200)
    opts = parser.parse_args()
    result = run_training(
        max_steps=opts.max_steps,
        num_workers=2,
        log_every_steps=50,
        eval_every_steps=100,
        storage_path="./runs",
        callbacks=[LossAlarm(limit=3.0), WeightNorm(), StepClock()],
        # A flat per-event field: a plain function (runs on the callback actor).
        on_save=lambda context: print(f"[save] {context.checkpoint_path}"),
    )
    print(result.summary())


if __name__ == "__main__":
    main()
