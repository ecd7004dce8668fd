"""Fine-tune a chat model on conversations: its own chat template, the loss on the assistant's
tokens, packed without padding; every checkpoint answers a held-out question in a Ray task.

The data is `{"messages": [...]}` JSONL, as most chat datasets come. Each conversation is
rendered whole with the model's chat template and the loss is taken on the assistant's turns
and the token that ends them (`train_on="assistant"`); `packing=True` packs the conversations
into micro-batches of at most `max_tokens_per_batch` tokens, each attending to itself alone. The
data is encoded once for the run (Ray tasks, cached under the storage path: a second run starts
without encoding again). Every checkpoint's `hf/` holds the model, the tokenizer with the
template and a generation config that stops at the end of an assistant turn. `GenerationEval`
grades each checkpoint in an `EvalOnSave` task: it asks held-out conversations (their last
assistant turn is the reference) with the checkpoint's template, scores the generated answers
(`heldout/exact_match`, `heldout/contains`), keeps them in `<checkpoint>/eval/heldout.jsonl`,
and the best checkpoint is kept by its score. With `--vllm-python` (the interpreter of the
environment `bash bench/eval/vllm_env.sh` builds) the answers come from vLLM, one engine kept warm
for the whole run (`keep_engine=True`).

Without `--model` it builds a tiny chat model (a Qwen2 shape, a byte-level BPE tokenizer, a
ChatML template; nothing downloaded) and conversations it can learn, and runs on a laptop's CPU
in a few minutes:

    python examples/sft_chat.py

With `--model` a local Hugging Face chat model and `--data` your messages JSONL; on a GPU
cluster add `--use-gpu` and `--storage` a path every node sees or a bucket.
"""

from __future__ import annotations

import argparse
import json
import os

from ray_trainer import EvalOnSave, GenerationEval, ProgressBar, run_training
from ray_trainer.demo import chat_conversations, make_tiny_chat_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None, help="a local Hugging Face chat model")
    parser.add_argument("--data", default=None, help='JSONL of {"messages": [...]} lines')
    parser.add_argument("--max-steps", type=int, default=500)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--use-gpu", action="store_true")
    parser.add_argument("--storage", default="./runs")
    parser.add_argument("--vllm-python", default=None, help="a vLLM env's python: vLLM, warm")
    parser.add_argument("--heldout", type=int, default=24, help="held-out conversations asked")
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
    # Held-out conversations (another seed): each asked without its last answer, its reference.
    heldout = GenerationEval(
        [{"messages": m} for m in chat_conversations(opts.heldout, seed=7)],
        name="heldout",
        metrics=["exact_match", "contains"],
        max_new_tokens=32,
        **(
            {"backend": "vllm", "python": opts.vllm_python, "keep_engine": True}
            if opts.vllm_python
            else {"backend": "hf"}
        ),
    )
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
        checkpoint_score_attribute="heldout/exact_match",
        callbacks=[ProgressBar(), EvalOnSave(heldout, num_gpus=1 if opts.use_gpu else 0)],
    )
    for e in result.evaluations:
        m = e.get("metrics") or {}
        print(f"step {e['step']}: exact match {m.get('heldout/exact_match', float('nan')):.3f}, "
              f"contains {m.get('heldout/contains', float('nan')):.3f}, "
              f"{e.get('seconds_after_save', float('nan')):.1f} s after its save"
              + (f"  ERROR {e['error']}" if e.get("error") else ""))  # fmt: skip
    print(f"answers of the best checkpoint: {result.best_checkpoint_path}/eval/heldout.jsonl")
    print(result.summary())


if __name__ == "__main__":
    main()
