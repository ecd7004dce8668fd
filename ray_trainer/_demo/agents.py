"""Anywhere (examples, tests, benchmarks): a tiny chat model that calls a ``multiply`` tool.

:func:`make_tool_model` saves the tiny ChatML model of :func:`~ray_trainer.demo.make_tiny_chat_model`
after a short warm-up in the calling process (plain torch, no Ray; about 20 s on 2 cores) on
conversations where the assistant calls ``multiply`` for "a*b=", reads the result and answers
with it: sampled at temperature 0.5 it calls the tool in nearly every episode, so a multi-turn
GRPO run or benchmark has turns, tool results and masks from its first step, with nothing
downloaded. :func:`product_prompts` are GRPO's prompt records for it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path


def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first number.
        b: The second number.

    Returns:
        Their product.
    """
    return a * b


def tool_conversation(a: int, b: int) -> list[dict]:
    """The warm-up's conversation for "a*b=": a call, its result, the answer."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": f"{a}*{b}="},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def product_prompts(n: int, seed: int = 0) -> list[dict]:
    """GRPO's prompt records "a*b=" with their ``answer``."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append(
            {"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b), "id": i}
        )
    return out


def make_tool_model(path: str | os.PathLike, steps: int = 150, seed: int = 0) -> str:
    """The tiny ChatML model warmed up to call ``multiply`` (see the module docstring),
    saved with its tokenizer to `path`; returns `path`."""
    import torch
    import transformers

    from ray_trainer._demo.chat import make_tiny_chat_model

    path = Path(path)
    make_tiny_chat_model(path, style="chatml", seed=seed)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    rng = random.Random(seed)
    rows = []
    for _ in range(64):
        convo = tool_conversation(rng.randint(10, 99), rng.randint(10, 99))
        ids = tok.apply_chat_template(convo, tools=[multiply], tokenize=True, return_dict=False)
        head = tok.apply_chat_template(
            convo[:1], tools=[multiply], tokenize=True, add_generation_prompt=True,
            return_dict=False,
        )  # fmt: skip
        labels = [-100] * len(head) + list(ids[len(head) :])
        rows.append((list(ids), labels))
    width = max(len(ids) for ids, _ in rows)
    pad = tok.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(r) for r, _ in rows])[:, None]).long()
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        pick = torch.randint(0, len(rows), (16,))
        loss = model(input_ids=ids[pick], attention_mask=mask[pick], labels=labels[pick]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(path)
    return str(path)
