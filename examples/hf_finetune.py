"""Fine-tune a Hugging Face causal LM on a JSONL file of text (needs `pip install "ray-trainer[hf]"`).

With `--model` a local path or a model name already in your HF cache, e.g.

    python examples/hf_finetune.py --model gpt2 --data my_data.jsonl

Without arguments it builds a tiny randomly initialised GPT-2 and a small JSONL file in ./runs
(nothing is downloaded), so it runs on a laptop in a minute.
"""

from __future__ import annotations

import argparse
import json
import os

from ray_trainer import ProgressBar, run_training
from ray_trainer.demo import make_tiny_causal_lm


def make_data(path: str) -> str:
    lines = [
        {"text": "the cat sat on the mat"},
        {"text": "the dog ran home"},
        {"prompt": "the cat", "completion": "sat on the mat"},
    ]
    with open(path, "w") as f:
        for i in range(300):
            f.write(json.dumps(lines[i % len(lines)]) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="local path or cached HF model name")
    parser.add_argument("--data", default=None, help="JSONL file: {text} or {prompt, completion}")
    parser.add_argument("--max-steps", type=int, default=100)
    opts = parser.parse_args()
    os.makedirs("runs", exist_ok=True)
    model = opts.model or str(make_tiny_causal_lm(os.path.abspath("runs/tiny-gpt2")))
    data = opts.data or make_data(os.path.abspath("runs/tiny-data.jsonl"))
    result = run_training(
        model=model,
        data=data,
        max_length=32,
        batch_size=16,
        learning_rate=1e-3,
        max_steps=opts.max_steps,
        num_workers=2,
        eval_every_steps=50,  # holds out 5% of the data for validation
        log_every_steps=10,
        storage_path="./runs",
        callbacks=[ProgressBar()],
    )
    print(result.summary())


if __name__ == "__main__":
    main()
