"""Preference-tune a chat model with DPO, after a short SFT run; every checkpoint's held-out
preference accuracy is measured in a Ray task while training goes on.

Two runs, as a preference-tuning recipe goes:

1. SFT on the chosen conversations (`{"messages": [...]}` JSONL, the loss on the assistant's
   turns): here it learns the answers' form and most right answers already;
2. DPO from the SFT checkpoint's Hugging Face export (`model="<checkpoint>/hf"`) on the pairs
   (`{"prompt": [...], "chosen": [...], "rejected": [...]}` JSONL, TRL's conversational format,
   `objective="dpo"`). The reference is the SFT model: its log-probs of every answer are computed
   once, before training, by Ray tasks, and cached on the storage path.

Each DPO checkpoint's `hf/` is scored in an `EvalOnSave` task on pairs it never trained on: its
**reward accuracy** is the fraction of held-out pairs where the implicit reward of the chosen
answer, beta x (log pi(chosen) - log pi_sft(chosen)), is above the rejected one's (TRL's
`rewards/accuracies`; 0 for the SFT model itself, whose rewards are all 0). Its
`logp_accuracy`, the fraction where log pi(chosen) > log pi(rejected), is printed beside it
(the SFT model's too). The run's own validation on the same pairs logs `val_rewards/accuracies`
and `val_rewards/margins`, which the task's figures equal.

Without `--model` it builds a tiny chat model (a Qwen2 shape, a byte-level BPE tokenizer, a
ChatML template; nothing downloaded) and pairs whose chosen answer is right ("What is the
opposite of hot?" "The opposite of hot is cold." over "... is slow."), and runs on a laptop's CPU
in a few minutes; it exits with status 1 if the last checkpoint's held-out reward accuracy is not
above 0.9:

    python examples/dpo_chat.py

With `--model` a local Hugging Face chat model and `--data` your pairs JSONL (conversational
format; `--held-out` a second file, else the last eighth of `--data` is held out); `--sft-steps 0`
starts DPO from `--model` as it is. On a GPU cluster add `--use-gpu` and `--storage` a path every
node sees or a bucket.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys

from ray_trainer import EvalOnSave, ProgressBar, run_training
from ray_trainer.demo import make_tiny_chat_model

OPPOSITES = (
    ("big", "small"), ("hot", "cold"), ("up", "down"), ("fast", "slow"), ("old", "new"),
    ("early", "late"), ("happy", "sad"), ("light", "dark"), ("open", "closed"), ("full", "empty"),
)  # fmt: skip
HELD_OUT = 48
BETA = 0.1  # DPO's beta (TrainingArgs.dpo_beta's default), for the rewards the task reports


def opposite_pairs(seed: int = 0) -> list[dict]:
    """Every pair "What is the opposite of X?": chosen the right opposite, rejected each wrong
    word of the others (20 questions x 18 wrong words), shuffled."""
    words = [w for pair in OPPOSITES for w in pair]

    def says(word: str, answer: str) -> list[dict]:
        return [{"role": "assistant", "content": f"The opposite of {word} is {answer}."}]

    out = [
        {
            "prompt": [{"role": "user", "content": f"What is the opposite of {word}?"}],
            "chosen": says(word, right),
            "rejected": says(word, wrong),
        }
        for a, b in OPPOSITES
        for word, right in ((a, b), (b, a))
        for wrong in words
        if wrong not in (a, b)
    ]
    random.Random(seed).shuffle(out)
    return out


def answer_logps(model_path: str, pairs: list[dict]) -> list[tuple[float, float]]:
    """The summed log-probs of each pair's chosen and rejected answer under the Hugging Face
    model at `model_path`: the answer's tokens are those after the prompt rendered with the
    chat template and its generation prompt, as DPO scores them. Runs wherever it is called
    (the driver, for the SFT model; an eval task, for a checkpoint). Uses transformers only."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()

    def logp(prompt: list[dict], answer: list[dict]) -> float:
        head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        whole = tokenizer.apply_chat_template(prompt + answer, tokenize=False)
        n = len(tokenizer(head, add_special_tokens=False)["input_ids"])
        ids = torch.tensor([tokenizer(whole, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, n - 1 : -1].float()
        return logits.log_softmax(-1).gather(1, ids[0, n:, None]).sum().item()

    return [(logp(p["prompt"], p["chosen"]), logp(p["prompt"], p["rejected"])) for p in pairs]


def preference_accuracy(
    checkpoint_path: str, step: int, pairs: list[dict], reference: list[tuple[float, float]]
) -> dict:
    """Score a DPO checkpoint's `hf/` on held-out pairs against the SFT model's log-probs
    (`reference`, computed once in the driver). Runs as a Ray task that `EvalOnSave` launches,
    on any node (`checkpoint_path` is a local folder there)."""
    policy = answer_logps(os.path.join(checkpoint_path, "hf"), pairs)
    margins = [
        BETA * ((pc - rc) - (pr - rr)) for (pc, pr), (rc, rr) in zip(policy, reference, strict=True)
    ]
    return {
        "reward_accuracy": sum(m > 0 for m in margins) / len(pairs),
        "reward_margin": sum(margins) / len(pairs),
        "logp_accuracy": sum(pc > pr for pc, pr in policy) / len(pairs),
    }


def write_jsonl(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return path


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local Hugging Face chat model")
    parser.add_argument("--data", default=None, help="JSONL of conversational preference pairs")
    parser.add_argument("--held-out", default=None, help="JSONL of pairs to score checkpoints on")
    parser.add_argument("--sft-steps", type=int, default=400, help="0: DPO from --model as it is")
    parser.add_argument("--max-steps", type=int, default=150, help="DPO steps")
    parser.add_argument("--save-every", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--storage", default="./runs")
    opts = parser.parse_args()

    folder = os.path.abspath("runs")
    os.makedirs(folder, exist_ok=True)
    model = opts.model or str(make_tiny_chat_model(os.path.join(folder, "tiny-chat")))
    pairs = read_jsonl(opts.data) if opts.data else opposite_pairs()
    if opts.held_out:
        held_out = read_jsonl(opts.held_out)
    else:  # the built-in pairs: 48 of 360 held out (every question, other wrong words)
        cut = len(pairs) - (HELD_OUT if opts.data is None else max(1, len(pairs) // 8))
        pairs, held_out = pairs[:cut], pairs[cut:]
    train_file = write_jsonl(os.path.join(folder, "dpo-pairs.jsonl"), pairs)
    held_out_file = write_jsonl(os.path.join(folder, "dpo-held-out.jsonl"), held_out)
    common = dict(
        num_workers=opts.workers,
        use_gpu=opts.use_gpu,
        max_length=128,
        storage_path=opts.storage,
    )
    if opts.sft_steps:  # 1. SFT on the chosen conversations
        chosen = [{"messages": p["prompt"] + p["chosen"]} for p in pairs]
        sft = run_training(
            model=model,
            data=write_jsonl(os.path.join(folder, "dpo-sft.jsonl"), chosen),
            packing=True,
            batch_size=16,
            learning_rate=5e-3,
            warmup_steps=10,
            max_steps=opts.sft_steps,
            log_every_steps=25,
            callbacks=[ProgressBar()],
            **common,
        )
        model = os.path.join(sft.checkpoint_path, "hf")  # the full SFT model, for from_pretrained
        print(f"SFT: {sft.global_step} steps, loss {sft.metrics.get('loss', float('nan')):.3f}")

    # 2. DPO from the SFT model; it is also the reference, so score the held-out pairs under it
    reference = answer_logps(model, held_out)
    score = functools.partial(preference_accuracy, pairs=held_out, reference=reference)
    result = run_training(
        model=model,
        objective="dpo",
        dpo_beta=BETA,
        data=train_file,
        val_data=held_out_file,  # the run's own val_rewards/accuracies, on the same pairs
        batch_size=8,  # pairs per micro-batch: 16 pairs a step on 2 workers
        learning_rate=1e-3,
        warmup_steps=10,
        max_steps=opts.max_steps,
        save_every_steps=opts.save_every,
        eval_every_steps=opts.save_every,
        log_every_steps=5,
        checkpoint_score_attribute="val_rewards/accuracies",  # the best checkpoint by it
        callbacks=[ProgressBar(), EvalOnSave(score, num_gpus=1 if opts.use_gpu else 0)],
        **common,
    )

    sft_logp_accuracy = sum(c > r for c, r in reference) / len(held_out)
    print(
        f"held-out pairs: {len(held_out)} (not trained on); the SFT model: reward accuracy 0 "
        f"(its rewards are 0), logp accuracy {sft_logp_accuracy:.3f}"
    )
    final = None
    for e in sorted(result.evaluations, key=lambda e: e["step"]):
        m = e.get("metrics")
        if not m:
            print(f"step {e['step']}: {e.get('error')}")
            continue
        final = m["reward_accuracy"]
        print(
            f"step {e['step']:>3}: reward accuracy {m['reward_accuracy']:.3f}, "
            f"reward margin {m['reward_margin']:.3f}, logp accuracy {m['logp_accuracy']:.3f}"
        )
    print(result.summary())
    if final is None or final <= 0.9:
        print(f"the last checkpoint's held-out reward accuracy is {final}, not above 0.9")
        sys.exit(1)


if __name__ == "__main__":
    main()
