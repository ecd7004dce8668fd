"""A tiny randomly initialised Hugging Face causal LM and tokenizer, made offline on the spot."""

from __future__ import annotations

from pathlib import Path

WORDS = ["the", "cat", "sat", "on", "mat", "what", "did", "do", "?", "it"]


def make_tiny_hf(path: Path) -> Path:
    """Save a 1-layer GPT-2 and a word-level tokenizer to `path`, as save_pretrained writes them."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = transformers.GPT2Config(
        vocab_size=len(vocab),
        n_positions=32,
        n_embd=32,
        n_layer=1,
        n_head=2,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
