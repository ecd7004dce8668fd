"""Fine-tune a chat model on conversations: its own chat template, the loss on the assistant's
tokens, packed without padding; every checkpoint answers a held-out question in a Ray task.

The data is `{"messages": [...]}` JSONL, as most chat datasets come. Each conversation is
rendered whole with the model's chat template and the loss is taken on the assistant's turns
and the token that ends them (`train_on="assistant"`); `packing=True` packs the conversations
into micro-batches of at most `max_tokens_per_batch` tokens, each attending to itself alone. The
data is encoded once for the run (Ray tasks, cached under the storage path: a second run starts
without encoding again). Every checkpoint's `hf/` holds the model, the tokenizer with the
template and a generation config that stops at the end of an assistant turn; an `EvalOnSave`
task loads it with transformers, as any tool would, and generates a reply with the template.

Without `--model` it builds a tiny chat model (a Qwen2 shape, a byte-level BPE tokenizer, a
ChatML template; nothing downloaded) and conversations it can learn, and runs on a laptop's CPU
in a few minutes:

    python examples/sft_chat.py

With `--model` a local Hugging Face chat model and `--data` your messages JSONL; on a GPU
cluster add `--use-gpu` and `--storage` a path every node sees or a bucket.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

from ray_trainer import EvalOnSave, ProgressBar, run_training
from ray_trainer.demo import chat_conversations, make_tiny_chat_model

QUESTION = [{"role": "user", "content": "What is the opposite of hot?"}]


def reply(checkpoint_path: str, step: int, messages: list[dict]) -> dict:
    """Generate the checkpoint's reply to `messages`, from its ``hf/`` export, with its chat
    template. Runs as a Ray task that `EvalOnSave` launches, on any node (`checkpoint_path` is a
    local folder there). Uses transformers only."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    hf = os.path.join(checkpoint_path, "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf).eval()
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=24, do_sample=False)  # stops at the turn's end
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    return {"reply": text.strip(), "correct": float("cold" in text.lower())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local Hugging Face chat model")
    parser.add_argument("--data", default=None, help='JSONL of {"messages": [...]} lines')
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--storage", default="./runs")
    opts = parser.parse_args()

    folder = os.path.abspath("runs")
    os.makedirs(folder, exist_ok=True)
    model = opts.model or str(make_tiny_chat_model(os.path.join(folder, "tiny-chat")))
    data = opts.data
    if data is None:
        data = os.path.join(folder, "chat.jsonl")
        with open(data, "w") as f:
            for messages in chat_conversations(3000, seed=1):
                f.write(json.dumps({"messages": messages}) + "\n")
    result = run_training(
        model=model,
        data=data,
        packing=True,  # no padding: conversations packed into rows of max_tokens_per_batch
        max_length=512,
        max_tokens_per_batch=1024,
        batch_size=16,
        num_workers=opts.workers,
        use_gpu=opts.use_gpu,
        learning_rate=5e-3,
        warmup_steps=20,
        max_steps=opts.max_steps,
        save_every_steps=opts.save_every,
        log_every_steps=25,
        storage_path=opts.storage,
        callbacks=[
            ProgressBar(),
            EvalOnSave(functools.partial(reply, messages=QUESTION), num_gpus=0),
        ],
    )
    for e in result.evaluations:
        print(f"step {e['step']}: {QUESTION[0]['content']} -> {e['metrics']['reply']!r}")
    print(result.summary())


if __name__ == "__main__":
    main()
