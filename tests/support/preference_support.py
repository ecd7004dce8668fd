"""Preference pairs for the DPO tests: one record maker per TRL 1.16 format (a question about a
thing's color, the chosen answer "blue", the rejected one "green"), and pairs with rejected
answers of uneven lengths."""

from __future__ import annotations

SYSTEM = {"role": "system", "content": "Answer briefly."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def standard(thing: str) -> dict:
    return {
        "prompt": f"What color is the {thing}?\n",
        "chosen": f"The {thing} is blue.",
        "rejected": f"The {thing} is green, {thing}.",
    }


def conversational(thing: str) -> dict:
    return {
        "prompt": [SYSTEM, user(f"What color is the {thing}?")],
        "chosen": [assistant(f"The {thing} is blue.")],
        "rejected": [assistant(f"The {thing} is green, {thing}.")],
    }


def implicit(thing: str) -> dict:
    record = conversational(thing)
    prompt = record.pop("prompt")
    return {"chosen": prompt + record["chosen"], "rejected": prompt + record["rejected"]}


#: The record maker of each format.
MAKE = {"standard": standard, "conversational": conversational, "implicit_prompt": implicit}


def uneven_pairs(things: tuple[str, ...]) -> list[dict]:
    """Conversational pairs whose rejected answers grow longer, one "!" per pair."""
    return [
        {
            "prompt": [user(f"What color is the {t}?")],
            "chosen": [assistant(f"The {t} is blue.")],
            "rejected": [assistant(f"The {t} is green, {t}" + "!" * i)],
        }
        for i, t in enumerate(things)
    ]
