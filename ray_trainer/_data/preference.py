"""Anywhere (driver, data-preparation tasks, workers): preference pairs, checked and tokenized.

The data of DPO: records that each hold a prompt, a chosen answer and a rejected one, in TRL
1.16's three preference formats (:data:`PAIR_FORMATS`), so that users' files work as they are:

- ``"standard"``: ``{"prompt", "chosen", "rejected"}``, three strings. Each answer gets the
  tokenizer's EOS text when it does not end with it; the prompt and the prompt + answer are
  tokenized as text (the tokenizer's special tokens added, as ``tokenizer(text)`` does).
- ``"conversational"``: ``prompt`` a list of messages, ``chosen`` and ``rejected`` lists of
  assistant messages (``tools`` beside them, optional). The prompt is rendered with the chat
  template and the generation prompt; the prompt + answer is rendered whole.
- ``"implicit_prompt"``: ``chosen`` and ``rejected`` whole conversations that share their first
  messages: those are the prompt, the rest of each is its answer (a ``prompt`` string beside
  them, as some datasets have, is not used: TRL extracts the prompt then too).

A pair's answer is what follows the prompt's tokens in the prompt + answer's tokens, so the
prompt's tokens must be a prefix of them (TRL cuts at the common prefix with a warning; here the
pair is refused, with the fix). Truncation follows TRL's ``keep_start``: prompt + answer is cut
to ``max_length``, and a pair whose prompt alone fills ``max_length`` is left out and counted.

Pure Python checks (:func:`pair_format`, :func:`check_pair`, :func:`check_pairs`: the driver,
before Ray starts) come first; :class:`PairEncoder` tokenizes (preparation tasks), and
:func:`encode_pairs` runs it over a list of records. Nothing here imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ray_trainer._data.chat import (
    ChatTemplateError,
    RecordError,
    check_messages,
    json_type,
    string_field,
)
from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._data.sources import DataFileError
from ray_trainer._data.template import render, resolve_chat_template

#: TRL 1.16's preference formats, as :func:`pair_format` names them.
PAIR_FORMATS = ("standard", "conversational", "implicit_prompt")
_EXAMPLE = (
    '{"prompt": "...", "chosen": "...", "rejected": "..."} (strings), the same with lists of '
    'messages (the answers: assistant messages only), or {"chosen": [messages], "rejected": '
    "[messages]}: two whole conversations that share their first messages (the prompt)"
)


# -- one record, pure Python ----------------------------------------------------------------------


def pair_format(record: Any) -> str:
    """The preference format of one record (one of :data:`PAIR_FORMATS`), told from its
    fields as TRL tells it. Pure Python.

    Raises:
        RecordError: the record is not a preference pair (no ``chosen`` or ``rejected``, or
            answers that are neither strings nor lists of messages).
    """
    if not isinstance(record, dict):
        raise RecordError(
            f"a preference pair must be a JSON object, got a JSON {json_type(record)}; "
            f"write one per line, e.g. {_EXAMPLE}"
        )
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        found = ", ".join(map(repr, record)) or "none"
        raise RecordError(
            f"not a preference pair: no {' or '.join(map(repr, missing))} field (found keys: "
            f"{found}); DPO trains on pairs like {_EXAMPLE}"
        )
    chosen = record["chosen"]
    if isinstance(chosen, str):
        if "prompt" not in record:
            raise RecordError(
                "'chosen' and 'rejected' are strings but there is no 'prompt' field; give the "
                "prompt in a 'prompt' string (an implicit prompt is read from lists of "
                "messages only)"
            )
        return "standard"
    if isinstance(chosen, list):
        return "conversational" if isinstance(record.get("prompt"), list) else "implicit_prompt"
    raise RecordError(
        f"'chosen' must be a string or a list of messages, got a JSON {json_type(chosen)}; "
        f"DPO trains on pairs like {_EXAMPLE}"
    )


def check_pair(record: Any, fmt: str) -> None:
    """Check one pair of format ``fmt``; raise :class:`RecordError` naming the field and the
    fix (the caller prefixes where the record is). Pure Python, no tokenizer: the driver's
    checks call it for every record. Refused: a field of the wrong type, an empty prompt or
    answer, identical answers, an answer holding a message that is not the assistant's."""
    split_pair(record, fmt)


def split_pair(record: Any, fmt: str) -> tuple[Any, Any, Any]:
    """``(prompt, chosen, rejected)`` of a checked pair: strings (``"standard"``) or lists of
    messages, the implicit prompt taken out of the two conversations. Raises
    :class:`RecordError` as :func:`check_pair` does."""
    if fmt not in PAIR_FORMATS:
        raise ValueError(f"unknown preference format {fmt!r}; one of {', '.join(PAIR_FORMATS)}")
    if not isinstance(record, dict):
        raise RecordError(
            f"a preference pair must be a JSON object, got a JSON {json_type(record)}"
        )
    if fmt == "standard":
        return _split_standard(record)
    tools = record.get("tools")
    names = ("prompt", "chosen", "rejected") if fmt == "conversational" else ("chosen", "rejected")
    for name in names:
        _check_list(record, name)
        check_messages(record[name], train_on="all", field=name, tools=tools)
    if fmt == "conversational":
        prompt, chosen, rejected = record["prompt"], record["chosen"], record["rejected"]
    else:
        prompt, chosen, rejected = _extract_prompt(record["chosen"], record["rejected"])
    for name, answer in (("chosen", chosen), ("rejected", rejected)):
        _check_answer(name, answer, fmt)
    if chosen == rejected:
        raise RecordError(
            "'chosen' and 'rejected' are the same answer, so the pair prefers nothing; "
            "fix the pair, or leave it out"
        )
    return prompt, chosen, rejected


def _split_standard(record: dict) -> tuple[str, str, str]:
    for name in ("prompt", "chosen", "rejected"):
        value = string_field(
            record,
            name,
            if_missing=f"; {_EXAMPLE}",
            if_not_str="; write a pair's fields all as strings, or all as lists of messages",
        )
        if not value.strip():
            why = (
                "a pair's answers reply to a prompt"
                if name == "prompt"
                else "an empty side of a pair has nothing to compare"
            )
            raise RecordError(f"{name!r} is empty: {why}; fill it, or leave the pair out")
    if record["chosen"] == record["rejected"]:
        raise RecordError(
            "'chosen' and 'rejected' are the same text, so the pair prefers nothing; fix the "
            "pair, or leave it out"
        )
    return record["prompt"], record["chosen"], record["rejected"]


def _check_list(record: dict, name: str) -> None:
    value = record.get(name)
    if value == [] and name != "prompt":
        raise RecordError(
            f"{name!r} is an empty list: an empty side of a pair has nothing to compare; give "
            "the assistant's answer, or leave the pair out"
        )
    if not isinstance(value, list):
        got = "no such field" if name not in record else f"a JSON {json_type(value)}"
        raise RecordError(
            f"{name!r} must be a list of messages like the other fields of the pair, got {got}; "
            "write a pair's fields all as strings, or all as lists of messages"
        )


def _extract_prompt(chosen: list[dict], rejected: list[dict]) -> tuple[list, list, list]:
    """The shared first messages of two conversations (the prompt), and the rest of each."""
    shared = 0
    for a, b in zip(chosen, rejected, strict=False):
        if a != b:
            break
        shared += 1
    if shared == 0:
        raise RecordError(
            "'chosen' and 'rejected' differ from their first message, so they share no prompt; "
            "as whole conversations (no 'prompt' list) they must start with the same messages "
            "(the prompt) and differ in the assistant's answer; or give the prompt as a "
            "'prompt' list of messages and the answers alone"
        )
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _check_answer(name: str, answer: list[dict], fmt: str) -> None:
    if not answer:
        raise RecordError(
            f"{name!r} has no message after the prompt the two conversations share, so the "
            f"{name} side is empty; end it with the assistant's answer"
        )
    for i, m in enumerate(answer):
        if m.get("role") != "assistant":
            at = f"{name}[{i}]" if fmt == "conversational" else f"message {i} of {name}'s answer"
            hint = (
                "; if it holds the whole conversation, drop the 'prompt' field (the prompt is then "
                "the messages 'chosen' and 'rejected' share)"
                if fmt == "conversational"
                else "; the answer is what follows the messages the two conversations share"
            )
            raise RecordError(
                f"{at} has role {m.get('role')!r}: a side of a pair holds the assistant's "
                f"messages only{hint}"
            )
    if all(not (m.get("content") or "").strip() and not m.get("tool_calls") for m in answer):
        raise RecordError(
            f"{name!r} is empty (its assistant messages have no content): an empty side of a "
            "pair has nothing to compare; fill it, or leave the pair out"
        )


# -- many records, pure Python --------------------------------------------------------------------


def where(index: int, file: str | None = None) -> str:
    """How an error names a record: ``"<file> row <index>"`` (``index`` counts from 0)."""
    return f"{file} row {index}" if file else f"row {index}"


def check_pairs(records: Iterable[Any], *, file: str | None = None, field: str = "data") -> str:
    """Check every record of one file (or dataset) and return its preference format. Runs in
    the driver before Ray starts; pure Python.

    ``field`` is the ``TrainingArgs`` field the records come from (``"data"`` or
    ``"val_data"``), named in the errors.

    Raises:
        DataFileError: naming the first bad record (``file row N``), the fix, and how many other
            records are bad. Bad are: a record that is not a pair (for ``val_data`` too: under
            DPO its loss is the DPO loss), a pair :func:`check_pair` refuses, and a record in
            another format than the file's first one (formats do not mix in one file).
    """
    errors: list[str] = []
    first: tuple[str, str] | None = None  # (format, where)
    for index, record in enumerate(records):
        at = where(index, file)
        try:
            fmt = check_in_file(record, first)
        except RecordError as e:
            errors.append(f"{at}: {e}")
            continue
        first = first or (fmt, at)
    if errors:
        raise DataFileError(_first_of(errors, field))
    if first is None:
        name = file or "the records"
        raise DataFileError(f"{field}: {name} holds no preference pairs; {_EXAMPLE}")
    return first[0]


def check_in_file(record: Any, first: tuple[str, str] | None) -> str:
    """Check one record of a file whose first good pair is ``first`` (its format and where it
    is; None before it) and return the record's format. Pure Python; the driver's checks of a
    source's files (``records.scan``) and :func:`check_pairs` call it for every record.

    Raises:
        RecordError: not a pair, a pair :func:`check_pair` refuses, or a pair in another format
            than ``first``'s (formats do not mix in one file). No location; prefix it.
    """
    fmt = pair_format(record)
    check_pair(record, fmt)
    if first is not None and fmt != first[0]:
        raise RecordError(
            f"a pair in the {fmt!r} format, but {first[1]} is in the {first[0]!r} one; the "
            f"pairs of one file share one format ({', '.join(PAIR_FORMATS)}): write them all "
            "alike (TRL, too, reads one format per dataset)"
        )
    return fmt


def check_val_pairs(records: Iterable[Any], *, file: str | None = None) -> str:
    """:func:`check_pairs` for ``val_data``: under ``objective="dpo"`` the validation loss is
    the DPO loss, so validation records must be pairs too (a chat file is refused, by row)."""
    return check_pairs(records, file=file, field="val_data")


def _first_of(errors: list[str], field: str) -> str:
    more = len(errors) - 1
    tail = f" ({more} more bad record{'s' if more > 1 else ''}, e.g. {errors[1]})" if more else ""
    return f"{field}: {errors[0]}{tail}"


# -- tokens ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedPair:
    """One tokenized pair: the prompt's tokens, then each answer's tokens after the prompt (cut
    so that prompt + answer fits ``max_length``; ``truncated`` when one was). Each answer holds
    at least one token. The model is trained on ``prompt_ids + chosen_ids`` and
    ``prompt_ids + rejected_ids`` (:meth:`sequences`), the loss on the answer's tokens."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False

    @property
    def chosen_tokens(self) -> int:
        """The chosen answer's tokens: those its summed log-probability covers (IPO averages
        over them)."""
        return len(self.chosen_ids)

    @property
    def rejected_tokens(self) -> int:
        """The rejected answer's tokens."""
        return len(self.rejected_ids)

    def sequences(self) -> tuple[tuple[list[int], list[int]], tuple[list[int], list[int]]]:
        """``((input_ids, labels), (input_ids, labels))`` of the chosen then the rejected
        sequence, labels ``-100`` on the prompt (aligned with the inputs; the model shifts
        them), as the token cache stores a sample."""
        masked = [IGNORE_INDEX] * len(self.prompt_ids)
        return (
            (self.prompt_ids + self.chosen_ids, masked + self.chosen_ids),
            (self.prompt_ids + self.rejected_ids, masked + self.rejected_ids),
        )


class PairEncoder:
    """Turns preference pairs into tokens, as TRL 1.16's ``DPOTrainer`` does, in every process.

    Built once per process (a data-preparation task, a worker) from the run's tokenizer. The
    chat template is resolved on the first conversational pair, so a file of standard pairs
    needs none.

    Args:
        tokenizer: a Hugging Face fast tokenizer (one with a ``backend_tokenizer``).
        chat_template: a Jinja string, the path of a file holding one, or the name of one of the
            tokenizer's templates; overrides the tokenizer's own (``TrainingArgs.chat_template``).
        max_length: the longest prompt + answer, in tokens (None: no truncation); longer ones
            keep their start, and a pair whose prompt alone has ``max_length`` tokens is left
            out (:meth:`encode` returns None).

    Example:
        >>> enc = PairEncoder(tokenizer, max_length=1024)  # doctest: +SKIP
        >>> enc.encode({"prompt": "2+2=", "chosen": "4", "rejected": "5"}, "standard")  # doctest: +SKIP
    """

    def __init__(
        self, tokenizer: Any, *, chat_template: str | None = None, max_length: int | None = None
    ) -> None:
        if max_length is not None and max_length < 2:
            raise ValueError(f"max_length must be at least 2 (or None), got {max_length}")
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ChatTemplateError(
                f"preference pairs need a Hugging Face fast tokenizer (one with a "
                f"backend_tokenizer), got {type(tokenizer).__name__}; name a Hugging Face model "
                "(or set TrainingArgs.tokenizer) whose tokenizer has a tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.chat_template_arg = chat_template
        self.max_length = max_length
        self._backend = backend

    @cached_property
    def chat_template(self) -> str:
        """The Jinja text conversations are rendered with (see ``resolve_chat_template``)."""
        return resolve_chat_template(self.tokenizer, self.chat_template_arg)

    def encode(self, record: dict, fmt: str) -> EncodedPair | None:
        """The tokens of one pair of format ``fmt``; None when its prompt alone fills
        ``max_length`` (the caller counts those).

        Raises:
            RecordError: the pair fails :func:`check_pair`, the chat template refuses it, the
                tokenized prompt is not a prefix of the tokenized prompt + answer, or the two
                answers tokenize alike. The message has no location; prefix it.
        """
        prompt, chosen, rejected = split_pair(record, fmt)
        if fmt == "standard":
            prompt_ids = self._text_ids(prompt)
            eos = self.tokenizer.eos_token or ""
            answers = [(a if a.endswith(eos) else a + eos) for a in (chosen, rejected)]
            fulls = [self._text_ids(prompt + a) for a in answers]
        else:
            tools = record.get("tools")
            text, _ = render(
                self.tokenizer, self.chat_template, prompt, tools, add_generation_prompt=True
            )
            prompt_ids = self._chat_ids(text)
            fulls = [
                self._chat_ids(render(self.tokenizer, self.chat_template, prompt + a, tools)[0])
                for a in (chosen, rejected)
            ]
        chosen_ids, rejected_ids = (
            self._answer(prompt_ids, full, name, fmt)
            for full, name in zip(fulls, ("chosen", "rejected"), strict=True)
        )
        if chosen_ids == rejected_ids:
            raise RecordError(
                "'chosen' and 'rejected' tokenize to the same tokens (the template or the EOS "
                "added to each makes them alike), so the pair prefers nothing; fix the pair, "
                "or leave it out"
            )
        return self._truncate(prompt_ids, chosen_ids, rejected_ids)

    def _text_ids(self, text: str) -> list[int]:
        # As `tokenizer(text)`: the tokenizer's special tokens (a BOS) added.
        return self._backend.encode(text, add_special_tokens=True).ids

    def _chat_ids(self, text: str) -> list[int]:
        # As `apply_chat_template(..., tokenize=True)`: the template wrote the special tokens.
        return self._backend.encode(text, add_special_tokens=False).ids

    def _answer(self, prompt_ids: list[int], full: list[int], name: str, fmt: str) -> list[int]:
        n = len(prompt_ids)
        if full[:n] != prompt_ids:
            pairs = enumerate(zip(prompt_ids, full, strict=False))
            at = next((i for i, (a, b) in pairs if a != b), min(n, len(full)))
            alone = self.tokenizer.decode(prompt_ids[at : at + 8])
            followed = self.tokenizer.decode(full[at : at + 8])
            fix = (
                "the prompt's end and the answer's start merge into other tokens; end the "
                "prompt at a token boundary (e.g. with a newline), or move a trailing space of "
                "the prompt to the start of each answer"
                if fmt == "standard"
                else "the chat template renders the prompt alone (with its generation prompt) "
                "otherwise than followed by the answer (e.g. it drops reasoning, or opens a "
                "block the whole conversation does not have); set TrainingArgs.chat_template to "
                "a template that renders the prompt the same in both"
            )
            raise RecordError(
                f"the tokenized prompt is not a prefix of the tokenized prompt + {name} (from "
                f"token {at}: {alone!r} alone, {followed!r} followed by the answer), so the "
                f"answer's tokens cannot be told from the prompt's; {fix}"
            )
        if len(full) == n:
            raise RecordError(
                f"{name!r} renders to no tokens after the prompt (the chat template drops it); "
                "fix the pair, or set TrainingArgs.chat_template to a template that renders it"
            )
        return full[n:]

    def _truncate(
        self, prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int]
    ) -> EncodedPair | None:
        limit = self.max_length
        if limit is None:
            return EncodedPair(prompt_ids, chosen_ids, rejected_ids)
        room = limit - len(prompt_ids)
        if room <= 0:  # keep_start would cut every answer token: no learning signal
            return None
        truncated = len(chosen_ids) > room or len(rejected_ids) > room
        return EncodedPair(prompt_ids, chosen_ids[:room], rejected_ids[:room], truncated)


@dataclass
class EncodedPairs:
    """The pairs of one file, tokenized: ``pairs`` in order, the file's ``fmt``, how many pairs
    were ``dropped`` (their prompt alone filled ``max_length``) and how many ``truncated``."""

    fmt: str
    pairs: list[EncodedPair]
    dropped: int = 0
    truncated: int = 0


def encode_pairs(
    records: Sequence[Any],
    encoder: PairEncoder,
    *,
    file: str | None = None,
    field: str = "data",
) -> EncodedPairs:
    """Check and tokenize the pairs of one file (or dataset). Runs where the records are
    encoded (a preparation task, or a test); :func:`check_pairs` first, then each pair.

    Raises:
        DataFileError: naming the first bad record (``file row N``) and the fix, and how many
            other records are bad.
    """
    fmt = check_pairs(records, file=file, field=field)
    out = EncodedPairs(fmt, [])
    errors: list[str] = []
    for index, record in enumerate(records):
        try:
            pair = encoder.encode(record, fmt)
        except RecordError as e:
            errors.append(f"{where(index, file)}: {e}")
            continue
        if pair is None:
            out.dropped += 1
            continue
        out.truncated += pair.truncated
        out.pairs.append(pair)
    if errors:
        raise DataFileError(_first_of(errors, field))
    return out
