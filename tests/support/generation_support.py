"""Test support for the evaluations (any test process): tiny models vLLM's CPU build can run,
and lm-eval's offline multiple-choice task.

`tiny_llama` saves a Llama-3-style model with the given tokenizer: width 64 over 2 heads
(vLLM's CPU attention takes head sizes of 32 and up), weights wide enough (initializer range
0.2) that greedy answers vary between seeds, an untied head. `TINY_CHOICE_TASK` is a task YAML
whose data file is ``data/tiny.jsonl`` beside it, rows ``{"query", "choices", "gold"}``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_CHOICE_TASK = """\
task: tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: data/tiny.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{query}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{gold}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def tiny_llama(
    path: Path, tokenizer: Any, seed: int, hidden: int = 64, max_positions: int = 256
) -> Path:
    """Save a tiny Llama (2 layers, `hidden` wide, heads of 32) and `tokenizer` to `path`."""
    import torch
    import transformers

    names = {
        "bos": "<|begin_of_text|>",
        "eos": "<|end_of_text|>",
        "pad": "<|finetune_right_pad_id|>",
    }
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=hidden // 32,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=0.2,
        **{f"{k}_token_id": tokenizer.convert_tokens_to_ids(v) for k, v in names.items()},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
