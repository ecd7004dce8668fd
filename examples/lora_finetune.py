"""LoRA fine-tuning of a Hugging Face model under FSDP on 2 workers; each checkpoint is evaluated
from its adapter in a Ray task while training goes on.

A tiny GPT-2 is built here and saved with ``save_pretrained`` (nothing downloaded), so the
adapter's ``base_model_name_or_path`` (the run's ``model``) resolves wherever the task runs.
Every checkpoint holds the adapters alone (and their optimizer state), a few hundred KiB, and
``hf/`` the PEFT adapter folder. Runs on an embedded local Ray:

    python examples/lora_finetune.py --max-steps 40

``--qlora`` trains the adapters on a 4-bit base (``quantize_base="nf4"``, needs
``pip install "ray-trainer[qlora]"``): the base is a tiny Llama-style chat model instead, whose
linear layers torchao can quantize (GPT-2's ``Conv1D`` it cannot); the adapter is still
evaluated on the original, full-precision base it names.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile

from ray_trainer import EvalOnSave, run_training
from ray_trainer.demo import make_tiny_causal_lm, make_tiny_chat_model

TEXTS = [
    "the cat sat on the mat",
    "what did the dog do ? it ran home",
    "the dog sat on the mat and the cat ran home",
]


def evaluate(checkpoint_path: str, step: int) -> dict:
    """Runs as a Ray task: the base the adapter names, the adapter on it (PEFT), and the
    perplexity of the training sentences. Imports nothing of ray-trainer."""
    import torch
    import transformers
    from peft import PeftModel

    adapter = os.path.join(checkpoint_path, "hf")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = PeftModel.from_pretrained(model, adapter).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(adapter)
    losses = []
    with torch.no_grad():
        for text in TEXTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    size = sum(
        os.path.getsize(os.path.join(root, n))
        for root, _, names in os.walk(checkpoint_path)
        for n in names
        if not os.path.relpath(root, checkpoint_path).startswith("hf")
    )
    return {"perplexity": math.exp(sum(losses) / len(losses)), "resumable_bytes": float(size)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--storage-path", default="./runs")
    parser.add_argument("--num-gpus", type=float, default=0, help="per evaluation task")
    parser.add_argument("--qlora", action="store_true", help="a 4-bit NF4 base (QLoRA)")
    opts = parser.parse_args()
    work = tempfile.mkdtemp(prefix="lora_example_")
    if opts.qlora:  # a Llama-style model: nn.Linear layers, which NF4 can hold
        base = str(make_tiny_chat_model(os.path.join(work, "tiny-llama"), style="llama3"))
    else:
        base = str(make_tiny_causal_lm(os.path.join(work, "tiny-gpt2"), n_layer=4, n_embd=64))
    lora = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}  # every linear layer of the blocks
    if opts.qlora:
        lora["quantize_base"] = "nf4"
    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"text": TEXTS[i % 3]}) + "\n" for i in range(300))
    result = run_training(
        model=base,
        data=data,
        lora=lora,
        strategy="fsdp",
        num_workers=2,
        max_steps=opts.max_steps,
        batch_size=8,
        max_length=16,
        learning_rate=1e-2,
        save_every_steps=max(1, opts.max_steps // 4),
        log_every_steps=10,
        storage_path=opts.storage_path,
        callbacks=[EvalOnSave(evaluate, num_gpus=opts.num_gpus, num_cpus=1)],
    )
    for e in result.evaluations:
        print(f"step {e['step']}: {e.get('metrics') or e.get('error')}")
    print(result.summary())


if __name__ == "__main__":
    main()
