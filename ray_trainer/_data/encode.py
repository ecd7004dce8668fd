"""Anywhere (data-preparation tasks, workers, the driver's checks): one record to tokens and labels.

An :class:`Encoder` is built once per process from a tokenizer and the run's settings; its
:meth:`Encoder.encode` turns one record of a known format into ``input_ids`` and ``labels``
(aligned with the inputs, ``-100`` where no loss is taken; the model shifts them). Formats:

- ``"messages"``: ``{"messages": [{"role", "content"}, ...], "tools": [...]}``, rendered whole
  with the chat template (``tools`` passed to it); the loss on the assistant turns that
  ``train_on`` selects, each with the token that ends the turn.
- ``"conversational"``: TRL's conversational prompt/completion, ``{"prompt": [messages],
  "completion": [messages]}``, rendered as one conversation; the loss on the completion's
  assistant turns.
- ``"prompt_completion"``: strings, concatenated; the loss on the completion and EOS.
- ``"text"``: the loss on every token and EOS.

``train_on="all"`` takes the loss on every token of every format. Truncation to ``max_length``
keeps the beginning. The :class:`Encoder` is also the one adapter over a run's tokenizer (a
Hugging Face one, or one with ``encode(text)``, ``eos_id`` and ``pad_id`` such as
:class:`ByteTokenizer`): its ``eos_id`` and ``pad_id`` are what the workers pad with. Nothing
here imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ray_trainer._data.chat import (
    TRAIN_ON,
    ChatTemplateError,
    TemplateInfo,
    assistant_spans,
    check_record,
)
from ray_trainer._data.template import probe_template, render, resolve_chat_template

#: The label of a position that takes no loss (PyTorch's ``cross_entropy`` ignores it).
IGNORE_INDEX = -100


class ByteTokenizer:
    """Byte-level tokenizer: the 256 UTF-8 byte values, then pad (256) and eos (257).

    The fallback for text data when no Hugging Face tokenizer is given; it needs no vocabulary
    file and can encode any text. Same interface as the demo's ``CharTokenizer``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("héllo", add_eos=True))
        'héllo'
    """

    pad_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, then ``eos_id`` if ``add_eos``."""
        ids = list(text.encode("utf-8"))
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced, pad and eos are dropped or shown."""
        out, raw = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            if not skip_special_tokens:
                out.append("<pad>" if i == self.pad_id else "<eos>" if i == self.eos_id else "<?>")
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)


@dataclass(frozen=True)
class Encoded:
    """One encoded record: ``input_ids`` and ``labels`` of equal length (``-100`` where no loss
    is taken), ``truncated`` when ``max_length`` cut it, and ``num_labels``, the labels the model
    scores (those not ``-100`` after the first position, which a causal LM never predicts)."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool
    num_labels: int

    @property
    def no_labels(self) -> bool:
        """No label survives (e.g. truncation removed every assistant token): the record takes
        no loss. The caller counts these and reports them."""
        return self.num_labels == 0


class Encoder:
    """Turns records into token ids and labels, the same way in every process.

    Built once per process (a data-preparation task, a worker) from the run's tokenizer and
    settings. The chat template is resolved and probed on first use by a chat format, so an
    encoder of plain text needs no template.

    Args:
        tokenizer: a Hugging Face fast tokenizer (required for chat formats), or for text
            formats any object with ``encode(text)``, ``eos_id`` and ``pad_id`` (the byte
            tokenizer of the built-in model).
        chat_template: a Jinja string or the path of a file holding one; overrides the
            tokenizer's own (``TrainingArgs.chat_template``).
        train_on: ``"assistant"``, ``"last_assistant"`` or ``"all"`` (``TrainingArgs.train_on``).
        max_length: the longest encoded record, in tokens; longer ones keep their beginning.
        text_field: the key of the text in ``"text"`` records.

    Example:
        >>> enc = Encoder(tokenizer, train_on="assistant", max_length=1024)  # doctest: +SKIP
        >>> out = enc.encode({"messages": [{"role": "user", "content": "Hi"},
        ...                                {"role": "assistant", "content": "Hello!"}]},
        ...                  "messages")  # doctest: +SKIP
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        train_on: str = "assistant",
        max_length: int = 512,
        text_field: str = "text",
    ) -> None:
        if train_on not in TRAIN_ON:
            raise ValueError(f"train_on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        self.tokenizer = tokenizer
        self.chat_template_arg = chat_template
        self.train_on = train_on
        self.max_length = max_length
        self.text_field = text_field
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.is_hf = hasattr(tokenizer, "eos_token_id") and not hasattr(tokenizer, "eos_id")
        self.eos_id: int | None = tokenizer.eos_token_id if self.is_hf else tokenizer.eos_id

    @property
    def pad_id(self) -> int:
        """What padding is: the tokenizer's pad token, else (Hugging Face) its EOS, else 0."""
        if not self.is_hf:
            return self.tokenizer.pad_id
        pad = self.tokenizer.pad_token_id
        return pad if pad is not None else (self.eos_id or 0)

    @cached_property
    def chat_template(self) -> str:
        """The Jinja text conversations are rendered with (see ``resolve_chat_template``)."""
        if self._backend is None:
            raise ChatTemplateError(
                f"chat data needs a Hugging Face fast tokenizer (one with a backend_tokenizer), "
                f"got {type(self.tokenizer).__name__}; name a Hugging Face model (or set "
                "TrainingArgs.tokenizer) whose tokenizer has a tokenizer.json"
            )
        return resolve_chat_template(self.tokenizer, self.chat_template_arg)

    @cached_property
    def template_info(self) -> TemplateInfo:
        """The template's assistant header and end-of-turn text, probed once."""
        return probe_template(self.tokenizer, self.chat_template)

    def check_template(self) -> None:
        """Resolve the chat template now, and probe it unless ``train_on="all"`` (which needs
        no assistant spans). Call it where a bad template must fail before training (the
        driver); :meth:`encode` does it on its first chat record anyway.

        Raises:
            ChatTemplateError: no template, invalid Jinja, a slow tokenizer, or a template that
                does not render a plain user/assistant conversation's contents in order.
        """
        _ = self.chat_template if self.train_on == "all" else self.template_info

    def encode(self, record: dict, fmt: str) -> Encoded:
        """The tokens and labels of one record of format ``fmt`` (one of :data:`FORMATS`).

        Raises:
            RecordError: the record does not fit its format, the chat template refuses it, or an
                assistant message's content is not in the template's rendering. The message has
                no location; prefix the file and line (or row).
        """
        check_record(record, fmt, train_on=self.train_on, text_field=self.text_field)
        if fmt == "messages":
            return self._encode_chat(record["messages"], record.get("tools"), first=0)
        if fmt == "conversational":
            prompt = record["prompt"]
            messages = prompt + record["completion"]
            return self._encode_chat(messages, record.get("tools"), first=len(prompt))
        if fmt == "prompt_completion":
            head = self._tokens(record["prompt"], first=True)
            tail = [*self._tokens(record["completion"], first=not head), *self._eos()]
            ids = head + tail
            if self.train_on == "all":
                return self._finish(ids, ids)
            return self._finish(ids, [IGNORE_INDEX] * len(head) + tail)
        ids = [*self._tokens(record[self.text_field], first=True), *self._eos()]
        return self._finish(ids, ids)

    # -- chat -------------------------------------------------------------------------------------

    def _encode_chat(self, messages: list[dict], tools: Any, first: int) -> Encoded:
        if self.train_on == "all":
            text, _ = render(self.tokenizer, self.chat_template, messages, tools)
            ids = self._backend.encode(text, add_special_tokens=False).ids
            return self._finish(ids, ids)
        info = self.template_info
        text, generation = render(
            self.tokenizer, info.text, messages, tools, track=info.marks_generation
        )
        enc = self._backend.encode(text, add_special_tokens=False)
        ids = enc.ids
        spans = assistant_spans(
            text,
            messages,
            info,
            generation,
            first=first,
            last_only=self.train_on == "last_assistant",
        )
        labels = [IGNORE_INDEX] * len(ids)
        for a, b in _token_ranges(enc, spans):
            labels[a:b] = ids[a:b]
        return self._finish(ids, labels)

    # -- tokens -----------------------------------------------------------------------------------

    def _tokens(self, text: str, first: bool) -> list[int]:
        if not self.is_hf:
            return list(self.tokenizer.encode(text))
        if self._backend is not None:  # the Rust tokenizer itself: no Python wrapper per call
            return self._backend.encode(text, add_special_tokens=first).ids
        # Special tokens (e.g. a BOS) only at the start of the sequence.
        return list(self.tokenizer(text, add_special_tokens=first)["input_ids"])

    def _eos(self) -> list[int]:
        return [] if self.eos_id is None else [self.eos_id]

    def _finish(self, ids: list[int], labels: list[int]) -> Encoded:
        truncated = len(ids) > self.max_length
        if truncated:
            ids, labels = ids[: self.max_length], labels[: self.max_length]
        elif labels is ids:  # never two names for one list: a caller may edit the labels
            labels = ids.copy()
        scored = max(len(labels) - 1, 0) - labels[1:].count(IGNORE_INDEX)
        return Encoded(ids, labels, truncated, scored)


def _token_ranges(encoding: Any, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The token index range ``[a, b)`` of each character span: the tokens that hold any of its
    characters, found from the span's two ends with the fast tokenizer's character-to-token map
    (two lookups per span, no Python loop over tokens)."""
    ranges = []
    for start, end in spans:
        a = next(
            (t for c in range(start, end) if (t := encoding.char_to_token(c)) is not None), None
        )
        if a is None:  # no token holds any character of the span (e.g. an empty span)
            continue
        b = next(
            t for c in range(end - 1, start - 1, -1) if (t := encoding.char_to_token(c)) is not None
        )
        ranges.append((a, b + 1))
    return ranges
