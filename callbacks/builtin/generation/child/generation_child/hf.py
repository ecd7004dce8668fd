"""Runs in the generation subprocess (or the eval task): the ``hf`` backend, transformers' ``generate``."""

from __future__ import annotations

from typing import Any


def load_hf_model(req: dict[str, Any]) -> Any:
    """The model (with its adapter unmerged) on the request's device, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = req["engine"]["dtype"]
    model = AutoModelForCausalLM.from_pretrained(
        req["model"], dtype=dtype if dtype == "auto" else getattr(torch, dtype)
    )
    if req["adapter"]:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, req["adapter"])
    return model.to(req["engine"]["device"]).eval()


def hf_generate(
    model: Any, tokenizer: Any, req: dict[str, Any], rows: list[list[int]], stop_ids: list[int]
) -> list[tuple[list[int], str]]:
    """(new token ids, "length") per row: batched, left-padded ``generate``; greedy at
    temperature 0, else sampling seeded by ``seed``."""
    import torch
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id
    if pad is None:  # padded positions are masked out: any id will do
        pad = stop_ids[0] if stop_ids else 0
    greedy = req["temperature"] == 0
    config = GenerationConfig(
        max_new_tokens=req["max_new_tokens"],
        do_sample=not greedy,
        temperature=None if greedy else req["temperature"],
        top_p=None if greedy else req["top_p"],
        top_k=None if greedy else 0,
        eos_token_id=stop_ids or None,
        pad_token_id=pad,
    )
    extra = {"stop_strings": req["stop"], "tokenizer": tokenizer} if req["stop"] else {}
    device = req["engine"]["device"]
    size = int(req["engine"]["batch_size"])
    outputs: list[tuple[list[int], str]] = []
    with torch.random.fork_rng(devices=[]), torch.inference_mode():
        torch.manual_seed(req["seed"])
        for start in range(0, len(rows), size):
            batch = rows[start : start + size]
            width = max(len(r) for r in batch)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in batch], device=device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in batch])
            out = model.generate(
                input_ids=ids, attention_mask=mask.to(device), generation_config=config, **extra
            )
            outputs += [(row[width:].tolist(), "length") for row in out]
    return outputs


# -- the vllm backend -----------------------------------------------------------------------------
