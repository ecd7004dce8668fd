"""The GPT-2 shapes and random-token data of bench_gpu.py's tables (imported by its tables and
by the Ray workers that build the model, through PYTHONPATH)."""

from __future__ import annotations

FULL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 512, "batch": 16}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 256, "seq": 64, "batch": 4}


def _config(shape: dict):
    import transformers

    return transformers.GPT2Config(
        vocab_size=shape["vocab"],
        n_positions=shape["seq"],
        n_embd=shape["n_embd"],
        n_layer=shape["n_layer"],
        n_head=shape["n_head"],
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def make_model(shape: dict):
    """A fresh GPT-2 of that shape, seeded: every configuration starts from the same weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(_config(shape))


class TokenDataset:
    """Random token ids, labels = inputs (the model shifts them); no padding."""

    def __init__(self, shape: dict, n: int) -> None:
        import torch

        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, shape["vocab"], (n, shape["seq"]), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
