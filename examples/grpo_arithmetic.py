"""Teach a tiny chat model to add with GRPO: a short SFT warm-up, then online RL on sampled
answers scored by an exact-match reward, the reward rising as it trains.

Two runs, as an RL recipe goes:

1. SFT on worked answers (`{"messages": [...]}`, "3+4=" answered "7"), a short run: enough that
   the model answers in the right form and now and then the right number, so that the reward
   is not all zeros at the start (GRPO learns nothing from a group whose rewards are all equal);
2. GRPO from the SFT checkpoint's `hf/` (`objective="grpo"`) on prompt-only records
   (`{"prompt": [{"role": "user", "content": "3+4="}], "answer": "7"}`): each step samples
   `num_generations` answers per prompt from a rollout engine (transformers' `generate` in a
   Ray actor of its own, the weights synced after each optimizer step), scores them with
   `exact_match` (a Ray task; the `answer` column reaches it by name, as TRL passes it) and
   raises the probability of the answers that beat their group.

The mean reward of each step's sampled answers is the curve (`reward` in the run's
`metrics.jsonl`, written by `JsonlLogger`); its first and last steps are printed with their
difference. Before and after, the SFT model and the GRPO model each answer every prompt
`--samples` times at temperature 1.0 in the driver (transformers, nothing from the runs), and the
share of exact answers is printed: the measured rise. It exits with status 1 unless the GRPO model
answers right more often than the SFT model by at least `--min-rise`.

The task: the 25 sums "a+b=" of a, b in 0..4, every one in both runs (GRPO learns to answer
right more often, not to answer unseen prompts). Each GRPO step takes 8 prompts x 8 answers of at
most 4 tokens; 200 steps are 25 epochs of the prompts, each in a seeded shuffle. The learning
rate is constant and the weight decay 0, as in TRL's `GRPOConfig`.

Without arguments it builds a tiny chat model (a Qwen2 shape, a byte-level BPE tokenizer, a
ChatML template; nothing downloaded) and runs on a laptop's CPU in a few minutes (docs/rl.md has
the curve and the figures of a run; 4.5 to 6 minutes on a busy 2-core machine, most of it the
start of Ray and of the two runs):

    python examples/grpo_arithmetic.py

The reward function can also be named as `"module:function"` (a YAML config's form):
`reward_fns=["grpo_arithmetic:exact_match"]` with this folder on the workers' `PYTHONPATH`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

from ray_trainer import JsonlLogger, ProgressBar, run_training
from ray_trainer.demo import make_tiny_chat_model

MAX_DIGIT = 4  # prompts "a+b=" for a, b in 0..MAX_DIGIT: 25 prompts, sums 0..8


def arithmetic_records(seed: int = 0) -> list[dict]:
    """Every prompt "a+b=" (a user turn) with its `answer`, shuffled: GRPO's prompt-only
    records, the answer a column the reward function takes by name."""
    out = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a in range(MAX_DIGIT + 1)
        for b in range(MAX_DIGIT + 1)
    ]
    random.Random(seed).shuffle(out)
    return out


def sft_conversations(records: list[dict]) -> list[dict]:
    """The warm-up's conversations: each prompt answered right."""
    return [
        {"messages": [*r["prompt"], {"role": "assistant", "content": r["answer"]}]} for r in records
    ]


def answer_text(completion) -> str:
    """A completion's text: TRL passes a string for a text prompt and
    `[{"role": "assistant", "content": ...}]` for a conversation."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def exact_match(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """The reward (TRL's signature): 1.0 where the answer is exactly the sum, else 0.0. Runs in
    a Ray task, once per step on all of its completions."""
    return [
        1.0 if answer_text(c).strip() == a else 0.0
        for c, a in zip(completions, answer, strict=True)
    ]


def sampled_accuracy(model_path: str, records: list[dict], samples: int, seed: int = 0) -> float:
    """The share of exact answers when the Hugging Face model at `model_path` answers each
    record's prompt `samples` times at temperature 1.0 (as GRPO samples). Runs in the driver;
    transformers only."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    texts = [
        tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False)
        for r in records
    ]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            **batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=6,
            num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    answers = tokenizer.batch_decode(
        out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
    )
    right = [r["answer"] for r in records for _ in range(samples)]
    return sum(a.strip() == b for a, b in zip(answers, right, strict=True)) / len(right)


def reward_curve(metrics_file: str) -> list[tuple[int, float]]:
    """(step, mean reward of the step's sampled answers) from a run's `metrics.jsonl`."""
    curve = []
    with open(metrics_file) as f:
        for line in f:
            entry = json.loads(line)
            if entry.get("event") == "on_log" and isinstance(entry.get("reward"), (int, float)):
                curve.append((entry["step"], float(entry["reward"])))
    return curve


def print_curve(curve: list[tuple[int, float]], every: int) -> None:
    """The curve as a table: each block of `every` steps, its mean reward and a bar."""
    print("| steps | mean reward | |\n|---|---:|---|")
    for i in range(0, len(curve), every):
        block = curve[i : i + every]
        mean = sum(r for _, r in block) / len(block)
        print(f"| {block[0][0]}-{block[-1][0]} | {mean:.3f} | {'#' * round(40 * mean)} |")


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sft-steps", type=int, default=160, help="the warm-up's steps")
    parser.add_argument("--max-steps", type=int, default=200, help="GRPO steps")
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="GRPO's")
    parser.add_argument("--samples", type=int, default=8, help="answers per prompt, before/after")
    parser.add_argument("--min-rise", type=float, default=0.1,
                        help="exit 1 unless the sampled accuracy rises this much")  # fmt: skip
    parser.add_argument("--storage", default="./runs")
    opts = parser.parse_args()

    folder = os.path.abspath("runs")
    os.makedirs(folder, exist_ok=True)
    storage = os.path.abspath(opts.storage)
    model = str(make_tiny_chat_model(os.path.join(folder, "tiny-chat-arith")))
    records = arithmetic_records()

    # 1. SFT warm-up on right answers: the form, and some of the sums
    sft = run_training(
        model=model,
        data=write_jsonl(os.path.join(folder, "arith-sft.jsonl"), sft_conversations(records)),
        batch_size=16,
        learning_rate=3e-3,
        warmup_steps=5,
        max_steps=opts.sft_steps,
        max_length=32,
        num_workers=1,
        log_every_steps=10,
        storage_path=storage,
        run_name="grpo-arithmetic-sft",
        callbacks=[ProgressBar()],
    )
    sft_model = os.path.join(sft.checkpoint_path, "hf")
    before = sampled_accuracy(sft_model, records, opts.samples)
    print(f"SFT: {sft.global_step} steps; sampled accuracy {before:.3f}")

    # 2. GRPO from the SFT model on the prompts, rewarded by exact match
    result = run_training(
        model=sft_model,
        objective="grpo",
        data=write_jsonl(os.path.join(folder, "arith-prompts.jsonl"), records),
        reward_fns=[exact_match],
        grpo={
            "num_generations": opts.num_generations,
            "max_completion_length": 4,
            "temperature": 1.0,
            "beta": 0.0,
        },
        rollout_backend="hf",
        rollout_workers=1,
        batch_size=opts.prompts_per_step,
        learning_rate=opts.learning_rate,
        lr_schedule="constant",
        weight_decay=0.0,  # TRL's GRPOConfig default
        max_steps=opts.max_steps,
        max_length=32,
        num_workers=1,
        log_every_steps=1,
        storage_path=storage,
        run_name="grpo-arithmetic",
        callbacks=[ProgressBar(), JsonlLogger()],
    )
    curve = reward_curve(os.path.join(storage, "grpo-arithmetic", "metrics.jsonl"))
    after = sampled_accuracy(os.path.join(result.checkpoint_path, "hf"), records, opts.samples)

    print_curve(curve, every=max(1, len(curve) // 10))
    k = max(1, len(curve) // 10)
    first = sum(r for _, r in curve[:k]) / k
    last = sum(r for _, r in curve[-k:]) / k
    print(f"mean reward of the first {k} GRPO steps {first:.3f}, of the last {k} {last:.3f} "
          f"({last - first:+.3f})")  # fmt: skip
    print(f"sampled accuracy ({opts.samples} answers per prompt at temperature 1.0): SFT "
          f"{before:.3f} -> GRPO {after:.3f} ({after - before:+.3f})")  # fmt: skip
    if after - before < opts.min_rise:
        print(f"the sampled accuracy rose by {after - before:+.3f}, less than {opts.min_rise}")
        sys.exit(1)


if __name__ == "__main__":
    main()
