"""Anywhere (examples, tests, benchmarks): a tiny random Hugging Face GPT-2, written on the spot.

Nothing is downloaded: the model is initialised from a seed and the tokenizer is word-level
over ``TINY_WORDS``. Needs ``ray-trainer[hf]`` (transformers).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The words of `make_tiny_causal_lm`'s tokenizer (after <pad>=0, <eos>=1, <unk>=2).
TINY_WORDS: tuple[str, ...] = (
    "the", "cat", "dog", "sat", "ran", "on", "mat", "home", "what", "did", "do", "?", "it",
)  # fmt: skip


def make_tiny_causal_lm(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_positions: int = 32,
    dropout: float = 0.0,
    seed: int = 0,
) -> Path:
    """Save a tiny randomly initialised GPT-2 and a word-level tokenizer to `path`, as
    ``save_pretrained`` writes them, and return `path`. Nothing is downloaded.

    Runs in the calling process (examples, tests). The tokenizer splits on whitespace and knows
    ``TINY_WORDS``; pad is 0, eos is 1, unknown words map to 2.

    Example:
        >>> run_training(model=str(make_tiny_causal_lm("runs/tiny-gpt2")), data="train.jsonl")
    """
    import torch
    import transformers  # ray-trainer[hf]
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *TINY_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = transformers.GPT2Config(
        vocab_size=len(vocab),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
