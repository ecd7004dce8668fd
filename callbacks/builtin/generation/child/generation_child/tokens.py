"""Runs in the generation subprocess (or the eval task): tokenizer, prompts, stops, answers.

The same for both backends: prompts go to the engine as token ids, and an answer is cut at
its first stop token or stop string and decoded here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .files import read_json
from .request import Refusal, prompt_kind


def load_tokenizer(req: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_source(req))


def tokenizer_source(req: dict[str, Any]) -> str:
    if req["tokenizer"]:
        return req["tokenizer"]
    adapter = req["adapter"]
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if adapter and any((Path(adapter) / f).is_file() for f in files):
        return adapter
    return req["model"]


def encode(tokenizer: Any, prompt: dict[str, Any]) -> list[int]:
    """A prompt's token ids: text as it is (with the tokenizer's own special tokens), chat
    messages through the chat template with the generation prompt (the template adds BOS)."""
    if prompt_kind(prompt) == "text":
        return list(tokenizer(prompt["text"])["input_ids"])
    if not getattr(tokenizer, "chat_template", None):
        raise Refusal("error", "a prompt has 'messages' but the tokenizer has no chat template")
    text = tokenizer.apply_chat_template(
        prompt["messages"], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def stop_token_ids(tokenizer: Any, model: str) -> list[int]:
    """EOS, the generation config's EOS ids and the chat template's end-of-turn token(s)."""
    ids = [tokenizer.eos_token_id]
    generation = read_json(Path(model) / "generation_config.json")
    eos = generation.get("eos_token_id")
    ids += eos if isinstance(eos, list) else [eos]
    ids += [tokenizer.convert_tokens_to_ids(t) for t in _end_of_turn_tokens(tokenizer)]
    return sorted({i for i in ids if isinstance(i, int) and i >= 0})


def _end_of_turn_tokens(tokenizer: Any) -> list[str]:
    """The special token(s) the chat template writes right after an assistant's message."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    marker = "ANSWERMARKER"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "q"}, {"role": "assistant", "content": marker}],
            tokenize=False,
        )
    except Exception:  # a template refusing this conversation: no extra stop
        return []
    after = text.split(marker, 1)[-1].lstrip() if marker in text else ""
    specials = sorted(tokenizer.all_special_tokens + list(tokenizer.get_added_vocab()), key=len)
    return [t for t in reversed(specials) if t and after.startswith(t)][:1]


def finish(
    tokenizer: Any, ids: list[int], reason: str, stop_ids: list[int], stop: list[str] | None
) -> dict[str, Any]:
    """The answer of one row: its ids up to (not with) a stop token, decoded without special
    tokens and cut at the first stop string; the same for both backends."""
    ids = list(ids)
    for k, token in enumerate(ids):
        if token in stop_ids:
            ids, reason = ids[:k], "stop"
            break
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for s in stop or ():
        if s and s in text:
            text, reason = text[: text.index(s)], "stop"
    return {"ids": ids, "text": text, "reason": reason}


# -- the hf backend -------------------------------------------------------------------------------
