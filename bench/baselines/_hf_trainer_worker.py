"""The Hugging Face Trainer side of bench_hf_trainer.py: one process per rank, under torchrun.

Launched by `bench_hf_trainer.py` as
``python -m torch.distributed.run --nproc_per_node 2 bench/baselines/_hf_trainer_worker.py --steps N --out F``.
Each rank trains the demo's `TinyCausalLM` on its `AdditionDataset` with `transformers.Trainer`
(gloo DDP on CPU), with the runner's settings: per-device batch 64, AdamW (weight decay 0.01 on
matrices), linear warm-up then linear decay, grad clip 1.0, seed 42, no evaluation or saving,
logging every 50 steps. Rank 0 writes the step-begin timestamps and its settings to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from ray_trainer._demo import build_demo


class LossFirst(nn.Module):
    """The demo model, returning a dict with the loss first (what Trainer expects)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels=None, attention_mask=None):
        out = self.model(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        return {"loss": out.loss, "logits": out.logits}


class StepTimes(TrainerCallback):
    """In every rank's process, inside the loop: step-begin times (the runner's StepTimer)."""

    def __init__(self) -> None:
        self.perf: list[float] = []
        self.first_wall: float | None = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_wall is None:
            self.first_wall = time.time()
        self.perf.append(time.perf_counter())


class LossKeeper(TrainerCallback):
    """In every rank's process, at each log: keeps the last logged loss (the runner's LossKeeper)."""

    def __init__(self) -> None:
        self.last = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.last = logs["loss"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch-size", type=int, default=64)
    opts = parser.parse_args()

    demo = build_demo()
    torch.manual_seed(42)  # the same initial weights as the runner (set_seed(42) then build)
    model = LossFirst(demo.model_factory())
    with tempfile.TemporaryDirectory(prefix="hf_bench_") as out_dir:
        args = TrainingArguments(
            output_dir=out_dir,
            max_steps=opts.steps,
            per_device_train_batch_size=opts.batch_size,
            learning_rate=2e-3,
            weight_decay=0.01,
            warmup_steps=50,
            lr_scheduler_type="linear",
            max_grad_norm=1.0,
            optim="adamw_torch",
            seed=42,
            use_cpu=True,
            ddp_backend="gloo",
            # accelerate's default, as in the runner (HF turns it on for a non-PreTrainedModel).
            ddp_find_unused_parameters=False,
            dataloader_drop_last=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            eval_strategy="no",
            save_strategy="no",
            logging_steps=50,
            report_to=[],
            disable_tqdm=True,  # PrinterCallback prints each log, like the runner's ProgressBar
        )
        timer, keeper = StepTimes(), LossKeeper()
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=demo.train_dataset,
            callbacks=[timer, keeper],
        )
        trainer.train()
    if args.process_index == 0:
        with open(opts.out, "w") as f:
            json.dump(
                {
                    "times": timer.perf,
                    "first_step_wall": timer.first_wall,
                    "last_loss": keeper.last,
                    "world_size": args.world_size,
                    "torch_threads": torch.get_num_threads(),
                    "interop_threads": torch.get_num_interop_threads(),
                    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                },
                f,
            )


if __name__ == "__main__":
    main()
