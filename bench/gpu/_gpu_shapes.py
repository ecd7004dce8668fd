"""The GPT-2 (and GPT-2-sized Llama) shapes and random-token data of bench_gpu.py's tables
(imported by its tables and by the Ray workers that build the model, through PYTHONPATH)."""

from __future__ import annotations

FULL = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 512, "batch": 16}
TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab": 256, "seq": 64, "batch": 4}
#: The same sizes as a Llama (RMSNorm, RoPE, SwiGLU at 8/3 of the width, untied head): the
#: family liger-kernel patches, which GPT-2 is not.
LLAMA = {**FULL, "family": "llama", "ffn": 2048}
TINY_LLAMA = {**TINY, "family": "llama", "ffn": 176}


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
    """A fresh GPT-2 (or, with ``family="llama"``, Llama) of that shape, seeded: every
    configuration starts from the same weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    if shape.get("family") == "llama":
        config = transformers.LlamaConfig(
            vocab_size=shape["vocab"],
            hidden_size=shape["n_embd"],
            intermediate_size=shape["ffn"],
            num_hidden_layers=shape["n_layer"],
            num_attention_heads=shape["n_head"],
            max_position_embeddings=shape["seq"],
            tie_word_embeddings=False,
            attn_implementation="sdpa",
        )
        return transformers.LlamaForCausalLM(config)
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


def runner_fields(shape: dict, steps: int, cpu: bool, storage: str) -> dict:
    """`run_training`'s fields for `shape` on one worker: `steps` steps of random ids, bf16 on
    a GPU, a constant learning rate, no final save (the caller adds log and callback fields)."""
    return {
        "model": lambda: make_model(shape),
        "data": lambda: TokenDataset(shape, steps * shape["batch"]),
        "batch_size": shape["batch"],
        "max_steps": steps,
        "learning_rate": 3e-4,
        "lr_schedule": "constant",
        "num_workers": 1,
        "use_gpu": not cpu,
        "mixed_precision": "no" if cpu else "bf16",
        "save_at_end": False,
        "storage_path": storage,
    }
