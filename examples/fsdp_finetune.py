"""Fine-tune a Hugging Face causal LM sharded over 2 workers (FSDP), evaluate every checkpoint.

`strategy="fsdp"` shards the model, its gradients and its optimizer state over the workers.
Every checkpoint holds an ``hf/`` export of the model (config, safetensors, tokenizer); an
`EvalOnSave` task opens it with `AutoModelForCausalLM.from_pretrained`, as any Hugging Face tool
would, and reports the perplexity on held-out text; `EarlyStopping` stops the run when that
perplexity stops falling. Needs `pip install "ray-trainer[hf]"`.

Without `--model` it builds a tiny randomly initialised GPT-2 and its tokenizer in ./runs, and
train and held-out JSONL files of sentences made of its words (nothing is downloaded), and runs
on a laptop's CPU in a few minutes:

    python examples/fsdp_finetune.py               # stops early when perplexity stops falling

With `--model` a local path or a model already in your HF cache (e.g. `--model gpt2`); on a GPU
cluster add `--use-gpu` (one GPU per worker), `--eval-gpus 1` (a spare GPU per evaluation) and
`--storage` a path every node sees or a bucket (`s3://bucket/runs`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random

from ray_trainer import EarlyStopping, EvalOnSave, ProgressBar, run_training
from ray_trainer.demo import make_tiny_causal_lm

# Sentences of the tiny model's words. The held-out ones are combinations training never sees.
SUBJECTS = ("the cat", "the dog")
ACTIONS = ("sat on the mat", "ran home", "sat home", "ran on the mat")
HELD_OUT = {"what did the dog do ? it sat home", "the cat ran on the mat"}


def sentences() -> list[str]:
    """Every sentence of the small grammar: "the cat ran home", "what did the dog do ? it ..."."""
    return [
        form.format(s=s, a=a)
        for s, a in itertools.product(SUBJECTS, ACTIONS)
        for form in ("{s} {a}", "what did {s} do ? it {a}")
    ]


def make_data(folder: str, seed: int = 0) -> tuple[str, str]:
    """Write ``train.jsonl`` (pairs of training sentences) and ``heldout.jsonl`` (pairs with a
    held-out sentence in each) into `folder`; return their paths. Runs in the driver."""
    rng = random.Random(seed)
    train = [s for s in sentences() if s not in HELD_OUT]
    held = sorted(HELD_OUT)
    lines = {
        "train.jsonl": [f"{rng.choice(train)} {rng.choice(train)}" for _ in range(400)],
        "heldout.jsonl": [f"{rng.choice(train)} {rng.choice(held)}" for _ in range(40)],
    }
    paths = []
    for name, texts in lines.items():
        paths.append(os.path.join(folder, name))
        with open(paths[-1], "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return paths[0], paths[1]


def perplexity(checkpoint_path: str, step: int, texts: list[str]) -> dict:
    """Perplexity of the checkpoint's model on `texts`, read from its ``hf/`` export.

    Runs as a Ray task that `EvalOnSave` launches, on any node: `checkpoint_path` is a local
    folder there (a copy, when the run's storage is a bucket). Uses transformers only, as an
    evaluation tool that knows nothing of ray-trainer would. Each text ends with EOS, as the
    runner trains on JSONL text.
    """
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = os.path.join(checkpoint_path, "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
            ids = torch.tensor([ids])
            predicted = ids.shape[1] - 1  # the first token is never predicted
            nll += float(model(input_ids=ids, labels=ids).loss) * predicted
            tokens += predicted
    return {"perplexity": math.exp(nll / tokens), "tokens": tokens}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="local path or cached HF model name")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per training worker")
    parser.add_argument("--eval-gpus", type=float, default=0, help="GPUs per evaluation task")
    parser.add_argument("--storage", default="./runs", help="a shared path or a bucket URI")
    opts = parser.parse_args()
    folder = os.path.abspath("runs")
    os.makedirs(folder, exist_ok=True)
    model = opts.model or str(make_tiny_causal_lm(os.path.join(folder, "tiny-gpt2"), n_layer=4))
    train, heldout = make_data(folder)
    with open(heldout) as f:
        texts = [json.loads(line)["text"] for line in f]
    result = run_training(
        model=model,
        data=train,
        strategy="fsdp",  # model, gradients and AdamW state sharded over the workers
        num_workers=opts.workers,
        use_gpu=opts.use_gpu,
        max_length=32,
        batch_size=8,
        learning_rate=3e-3,
        warmup_steps=10,
        max_steps=opts.max_steps,
        save_every_steps=opts.save_every,
        log_every_steps=10,
        storage_path=opts.storage,
        callbacks=[
            ProgressBar(),
            # The held-out texts travel with the function: the task needs no shared disk.
            EvalOnSave(functools.partial(perplexity, texts=texts), num_gpus=opts.eval_gpus),
            EarlyStopping("perplexity", mode="min", patience=2, min_delta=0.01),
        ],
    )
    for e in result.evaluations:
        metrics = e.get("metrics")
        shown = f"perplexity {metrics['perplexity']:.3f}" if metrics else e.get("error")
        print(f"step {e['step']}: held-out {shown}")
    print(result.summary())
    print(f"last checkpoint: {result.checkpoint_path} (from_pretrained loads its hf/ folder)")


if __name__ == "__main__":
    main()
