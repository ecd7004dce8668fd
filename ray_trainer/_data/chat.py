"""Anywhere (driver, data-preparation tasks, workers): chat records and assistant spans.

What a valid conversation is (:func:`check_messages`, pure Python: the driver's validator calls
it for every record) and where each assistant turn lies in the rendering of a whole conversation
(:func:`assistant_spans`), as character spans that :mod:`ray_trainer._data.encode` turns into
labels. :mod:`ray_trainer._data.template` resolves, renders and probes the chat template.
Nothing here imports Ray or torch.

Spans are found in the FULL rendering, never by rendering a conversation turn by turn: templates
such as Qwen3's drop the reasoning of earlier assistant turns, so a prefix of the conversation
does not render as a prefix of the whole. A template that marks assistant text with
``{% generation %}`` is trusted as marked; otherwise each assistant message's content is located,
in order, in the rendered text, and its span runs from the end of the assistant header (the text
the generation prompt adds, e.g. ``<|im_start|>assistant\\n``) to the end of the first
end-of-turn token after the content (e.g. ``<|im_end|>``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("assistant", "last_assistant", "all")
#: The record formats, in the order `sources.detect_format` detects them from the columns.
FORMATS = ("messages", "conversational", "prompt_completion", "text")


class RecordError(ValueError):
    """A record that cannot be trained on. The message says what is wrong and the fix, without
    the location: the caller prefixes ``"<file>:<line>: "`` or ``"<file> row N: "``."""


class ChatTemplateError(ValueError):
    """No usable chat template; the message names ``TrainingArgs.chat_template`` and the fix."""


# -- records --------------------------------------------------------------------------------------


def check_messages(
    messages: Any, *, train_on: str = "assistant", field: str = "messages", tools: Any = None
) -> None:
    """Check one conversation; raise :class:`RecordError` naming the message and the fix.

    Pure Python, no tokenizer: the driver-side validator calls it for every record. Roles are
    ``system``, ``user``, ``assistant`` (and ``tool``, for tool results); ``content`` is a
    string (an assistant message with ``tool_calls`` may leave it out); a conversation trained
    with ``train_on="assistant"`` or ``"last_assistant"`` needs at least one assistant message.
    ``tools``, when given, must be a list of JSON objects (the tools' schemas).
    """
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if messages == [] else f"a JSON {json_type(messages)}"
        raise RecordError(
            f"{field!r} must be a non-empty list of messages like "
            f'{{"role": "user", "content": "..."}}, got {got}'
        )
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise RecordError(
                f"{where} must be a JSON object like "
                f'{{"role": "user", "content": "..."}}, got a JSON {json_type(m)}'
            )
        role = m.get("role")
        if role not in ROLES:
            raise RecordError(
                f"{where} has role {role!r}; the role must be one of {', '.join(ROLES)}"
                + ("" if "role" in m else f" (found keys: {', '.join(map(repr, m)) or 'none'})")
            )
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            continue
        if not isinstance(content, str):
            what = "no 'content'" if "content" not in m else f"a JSON {json_type(content)}"
            raise RecordError(
                f"{where} ({role}) has {what}; its content must be a string "
                "(only text is supported; join content parts into one string)"
            )
    if train_on != "all" and not any(m["role"] == "assistant" for m in messages):
        raise RecordError(
            f"{field!r} has no assistant message, so nothing to learn with "
            f"train_on={train_on!r}; add the assistant's reply, or set train_on='all'"
        )
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)
    ):
        raise RecordError(
            "'tools' must be a list of JSON objects (the tools' JSON schemas), "
            f"got a JSON {json_type(tools)}"
        )


def check_record(
    record: Any, fmt: str, *, train_on: str = "assistant", text_field: str = "text"
) -> None:
    """Check one record of format ``fmt`` (one of :data:`FORMATS`); raise :class:`RecordError`
    naming the field and the fix. Pure Python, no tokenizer: the driver-side validator calls it
    for every record, and :meth:`~.encode.Encoder.encode` before encoding one.

    ``"messages"``: ``{"messages": [...], "tools": [...] (optional)}``; ``"conversational"``:
    ``{"prompt": [messages], "completion": [messages]}``, the completion holding the assistant's
    turns; ``"prompt_completion"``: two strings; ``"text"``: a string under ``text_field``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown record format {fmt!r}; one of {', '.join(FORMATS)}")
    if not isinstance(record, dict):
        raise RecordError(f"a record must be a JSON object, got a JSON {json_type(record)}")
    if fmt == "messages":
        check_messages(record.get("messages"), train_on=train_on, tools=record.get("tools"))
    elif fmt == "conversational":
        check_messages(
            record.get("prompt"), train_on="all", field="prompt", tools=record.get("tools")
        )
        check_messages(record.get("completion"), train_on=train_on, field="completion")
    else:
        for name in ("prompt", "completion") if fmt == "prompt_completion" else (text_field,):
            string_field(record, name)


def string_field(record: dict, name: str, *, if_missing: str = "", if_not_str: str = "") -> str:
    """``record[name]``, a required string; else a :class:`RecordError` that names the field and
    what was found, followed by the fix (`if_missing` or `if_not_str`, e.g. ``"; write ..."``)."""
    if name not in record:
        found = ", ".join(map(repr, record)) or "none"
        raise RecordError(f"missing field {name!r} (found keys: {found}){if_missing}")
    value = record[name]
    if not isinstance(value, str):
        raise RecordError(
            f"field {name!r} must be a string, got a JSON {json_type(value)}{if_not_str}"
        )
    return value


def json_type(value: Any) -> str:
    """The JSON name of a parsed value's type, for error messages ("array", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    names = {dict: "object", list: "array", str: "string", int: "number", float: "number"}
    return names.get(type(value), type(value).__name__)


@dataclass(frozen=True)
class TemplateInfo:
    """What a chat template puts around an assistant turn, found once by rendering a probe.

    ``header`` is the text that opens an assistant turn (what the generation prompt adds, e.g.
    ``<|im_start|>assistant\\n``; empty if it cannot be told), ``end_of_turn`` the text of the
    token that ends it (``<|im_end|>``, ``<|eot_id|>``; empty if the template has none) and
    ``marks_generation`` whether it wraps assistant text in ``{% generation %}`` blocks.
    """

    text: str
    header: str
    end_of_turn: str
    marks_generation: bool


# -- assistant spans ------------------------------------------------------------------------------


def assistant_spans(
    text: str,
    messages: Sequence[dict],
    info: TemplateInfo,
    generation: list[tuple[int, int]],
    *,
    first: int = 0,
    last_only: bool = False,
) -> list[tuple[int, int]]:
    """Character spans of ``text`` (the rendering of ``messages``) that take the loss: the
    assistant turns at message index ``first`` or later (only the last one if ``last_only``).

    Each assistant turn is located in order; ``generation`` (the template's ``{% generation %}``
    spans), when the template has them, then decides the exact characters of each turn.

    Raises:
        RecordError: an assistant message whose content is not in the rendering, or a template
            whose ``{% generation %}`` blocks mark none of a conversation's assistant turns.
    """
    turns = _locate_turns(text, messages, info)
    if info.marks_generation:
        if turns and not generation:
            raise RecordError(
                "the chat template has {% generation %} blocks but they mark no text of this "
                "conversation's assistant messages; fix the template (TrainingArgs.chat_template) "
                "so that every assistant message is inside {% generation %} ... {% endgeneration %}"
            )
        owned = _assign(generation, turns)
    else:
        owned = [(index, (start, end)) for index, start, end in turns]
    wanted = [i for i, _, _ in turns if i >= first]
    if last_only:
        wanted = wanted[-1:]
    keep = set(wanted)
    return [span for index, span in owned if index in keep]


def _locate_turns(
    text: str, messages: Sequence[dict], info: TemplateInfo
) -> list[tuple[int, int, int]]:
    """(message index, start, end) of each assistant turn, in order.

    A turn starts at the end of the first assistant header after the previous message (or at
    its content when the template has no header there) and ends after the first end-of-turn
    token following its content (unless another assistant header comes first).
    """
    turns: list[tuple[int, int, int]] = []
    cursor = 0
    header, eot = info.header, info.end_of_turn
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m.get("role") != "assistant":
            needle = content.strip()
            at = text.find(needle, cursor) if needle else -1
            cursor = at + len(needle) if at >= 0 else cursor
            continue
        h = text.find(header, cursor) if header else -1
        start = h + len(header) if h >= 0 else cursor
        # After the header: an answer such as "assistant" must not be found inside it.
        at, needle = _find_content(text, content, start)
        if at < 0 and h >= 0:
            start = cursor
            at, needle = _find_content(text, content, start)
        if at < 0 or (not needle and h < 0):
            raise RecordError(
                f"the content of messages[{i}] (assistant, {_snippet(content)}) is not in the "
                "chat template's rendering of the conversation (the template changes or drops "
                "it), so its tokens cannot be found for the loss; use a chat template "
                "(TrainingArgs.chat_template) that renders every assistant message's content "
                "as given, or fix the record"
            )
        if start == cursor:  # no header before the content: the turn is its content
            start = at
        content_end = at + len(needle)
        end = content_end
        e = text.find(eot, content_end) if eot else -1
        if e >= 0 and not (header and text.find(header, content_end, e) >= 0):  # this turn's
            end = e + len(eot)
        turns.append((i, start, end))
        cursor = end
    return turns


def _find_content(text: str, content: str, begin: int) -> tuple[int, str]:
    """Where an assistant message's content starts in ``text`` (from ``begin``), and the text
    found there. A template may trim it, or drop a leading ``<think>...</think>`` block from it
    (reasoning templates do so on earlier turns); empty content (a turn of tool calls) is
    "found" at ``begin``."""
    needle = content.strip()
    if not needle:
        return begin, ""
    at = text.find(needle, begin)
    if at < 0 and "</think>" in needle:
        needle = needle.rsplit("</think>", 1)[1].strip()
        at = text.find(needle, begin) if needle else -1
    return at, needle


def _assign(
    generation: list[tuple[int, int]], turns: list[tuple[int, int, int]]
) -> list[tuple[int, tuple[int, int]]]:
    """Each ``{% generation %}`` span with the message index of the assistant turn it overlaps
    most (a span overlapping none goes to the next turn after it, or the last). Turns are in
    text order, so each span looks only at the turns around it (bisect), not at all of them."""
    from bisect import bisect_right

    ends = [t_end for _, _, t_end in turns]
    owned = []
    for start, end in generation:
        k = bisect_right(ends, start)  # the first turn that ends after the span starts
        best, best_overlap = None, 0
        for index, t_start, t_end in turns[k:]:
            if t_start >= end:
                break
            overlap = min(end, t_end) - max(start, t_start)
            if overlap > best_overlap:
                best, best_overlap = index, overlap
        if best is None:
            best = turns[min(k, len(turns) - 1)][0] if turns else -1
        owned.append((best, (start, end)))
    return owned


def _snippet(content: str) -> str:
    s = " ".join(content.split())
    return repr(s if len(s) <= 60 else s[:57] + "...")
