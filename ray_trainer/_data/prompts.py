"""Anywhere (driver, rollout side): prompt-only records, checked and rendered, for GRPO.

The data of online RL: records that hold a prompt and nothing the model is trained to say, in
TRL 1.16's two prompt-only formats (:data:`PROMPT_FORMATS`), so that users' files work as they
are:

- ``"standard"``: ``{"prompt": "..."}``, tokenized as text (the tokenizer's special tokens
  added, as ``tokenizer(text)`` does, and as TRL's ``GRPOTrainer`` tokenizes a string prompt);
- ``"conversational"``: ``{"prompt": [messages]}`` (``tools`` beside it, optional), rendered
  with the chat template and its generation prompt, so the completion is the assistant's turn.
  A conversation that ends on an assistant turn is refused: the completion would continue the
  assistant's message, not answer it.

Every other column of a record (``{"prompt": ..., "answer": "4"}``) is kept and reaches the
reward functions by name (:attr:`EncodedPrompt.columns`), as TRL passes them.

Pure Python checks first (:func:`prompt_format`, :func:`check_prompt`: the driver calls them for
every record, ``records.scan``); :class:`PromptEncoder` renders and tokenizes one prompt and
refuses one whose tokens leave no room for ``max_completion_length`` within ``max_length``;
:func:`check_prompts` runs both over the records of one file, naming the file, the row and the
fix. Nothing here imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ray_trainer._data.chat import ChatTemplateError, RecordError, check_messages, json_type
from ray_trainer._data.sources import DataFileError
from ray_trainer._data.template import render, resolve_chat_template

#: What TRL passes reward functions besides a record's fields: no field may take these names.
_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state")
#: TRL 1.16's prompt-only formats, as :func:`prompt_format` names them.
PROMPT_FORMATS = ("standard", "conversational")
_EXAMPLE = (
    '{"prompt": "What is 2 + 2?"} or {"prompt": [{"role": "user", "content": "What is 2 + 2?"}]}'
    ', other fields (e.g. "answer") beside it for the reward functions'
)


def prompt_format(record: Any) -> str:
    """The prompt-only format of one record (one of :data:`PROMPT_FORMATS`). Pure Python.

    Raises:
        RecordError: not a JSON object, no ``prompt`` field, or a prompt that is neither a
            string nor a list of messages.
    """
    if not isinstance(record, dict):
        raise RecordError(
            f"a prompt record must be a JSON object, got a JSON {json_type(record)}; write one "
            f"per line, e.g. {_EXAMPLE}"
        )
    if "prompt" not in record:
        found = ", ".join(map(repr, record)) or "none"
        raise RecordError(
            f"no 'prompt' field (found keys: {found}); GRPO samples completions of prompts "
            f"like {_EXAMPLE}"
        )
    prompt = record["prompt"]
    if isinstance(prompt, str):
        return "standard"
    if isinstance(prompt, list):
        return "conversational"
    raise RecordError(
        f"'prompt' must be a string or a list of messages, got a JSON {json_type(prompt)}; "
        f"e.g. {_EXAMPLE}"
    )


def check_prompt(record: Any, first: tuple[str, str] | None = None) -> str:
    """Check one prompt record (and that it shares the format of ``first``, the file's first
    good record: its format and where it is) and return its format; raise
    :class:`RecordError` naming the field and the fix (the caller prefixes where the record
    is). Pure Python, no tokenizer. Refused: no prompt, an empty one, messages
    :func:`~.chat.check_messages` refuses, a conversation ending on an assistant turn, a
    column named like the reward functions' own arguments, formats mixed in one file."""
    fmt = prompt_format(record)
    prompt = record["prompt"]
    if fmt == "standard":
        if not prompt.strip():
            raise RecordError(
                "'prompt' is empty: completions answer a prompt; fill it, or leave the record out"
            )
    else:
        check_messages(prompt, train_on="all", field="prompt", tools=record.get("tools"))
        last = prompt[-1].get("role")
        if last == "assistant":
            raise RecordError(
                f"'prompt' ends on an assistant turn (prompt[{len(prompt) - 1}]): a completion "
                "would continue the assistant's message instead of answering; end the prompt "
                "on the user's (or a tool's) turn, or drop the last message"
            )
    shadowed = [k for k in record if k in _REWARD_ARGUMENTS]
    if shadowed:
        raise RecordError(
            f"field {shadowed[0]!r} would shadow the reward functions' own argument of that "
            f"name (they take {', '.join(_REWARD_ARGUMENTS)} and the other fields by name); "
            "rename the field"
        )
    if first is not None and fmt != first[0]:
        raise RecordError(
            f"a {fmt!r} prompt, but {first[1]} is a {first[0]!r} one; the prompts of one source "
            "are all strings or all lists of messages (TRL, too, reads one format per dataset)"
        )
    return fmt


def columns_of(record: dict) -> dict[str, Any]:
    """A record's fields besides ``prompt`` (and ``tools``, which the template reads): what
    the reward functions get by name."""
    return {k: v for k, v in record.items() if k not in ("prompt", "tools")}


# -- tokens ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodedPrompt:
    """One prompt, ready to sample from: ``prompt_ids`` (the engines' input), ``prompt`` as
    the record holds it (what reward functions get), ``text`` (its rendering; the string
    itself for a standard prompt) and the record's other ``columns``."""

    prompt_ids: list[int]
    prompt: Any
    text: str
    columns: dict[str, Any] = field(default_factory=dict)


class PromptEncoder:
    """Renders and tokenizes prompt-only records, as TRL 1.16's ``GRPOTrainer`` does.

    Built once per process (the driver, to check every prompt before Ray starts; whoever feeds
    the engines) from the run's tokenizer; the chat template is resolved on the first
    conversational prompt, so a file of string prompts needs none.

    Args:
        tokenizer: a Hugging Face fast tokenizer (one with a ``backend_tokenizer``).
        chat_template: a Jinja string, the path of a file holding one, or the name of one of the
            tokenizer's templates; overrides the tokenizer's own (``TrainingArgs.chat_template``).
        max_length: the longest prompt + completion, in tokens (``TrainingArgs.max_length``).
        max_completion_length: the longest completion (``grpo.max_completion_length``): a
            prompt may have at most ``max_length - max_completion_length`` tokens.
        tools: a multi-turn run's tool schemas by environment name (``_agents.tools``): its
            prompts are conversations rendered with them; `environments` (several
            environments): the names a record's ``environment`` field picks from.

    Example:
        >>> enc = PromptEncoder(tokenizer, max_length=512, max_completion_length=256)  # doctest: +SKIP
        >>> enc.encode({"prompt": "2+2=", "answer": "4"}).columns  # doctest: +SKIP
        {'answer': '4'}
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        max_length: int,
        max_completion_length: int,
        chat_template: str | None = None,
        tools: dict[str | None, list[dict]] | None = None,
        environments: tuple[str, ...] = (),
    ) -> None:
        if max_completion_length >= max_length:
            raise ValueError(
                f"grpo.max_completion_length={max_completion_length} leaves no room for a "
                f"prompt within max_length={max_length}; raise max_length (prompt + "
                "completion), or lower grpo.max_completion_length"
            )
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ChatTemplateError(
                f"prompt records need a Hugging Face fast tokenizer (one with a "
                f"backend_tokenizer), got {type(tokenizer).__name__}; name a Hugging Face model "
                "(or set TrainingArgs.tokenizer) whose tokenizer has a tokenizer.json"
            )
        self.tokenizer = tokenizer
        self.chat_template_arg = chat_template
        self.max_length = max_length
        self.max_completion_length = max_completion_length
        self.tools = tools
        self.environments = environments
        self._backend = backend

    @property
    def max_prompt_tokens(self) -> int:
        """The most tokens a prompt may have."""
        return self.max_length - self.max_completion_length

    @cached_property
    def chat_template(self) -> str:
        """The Jinja text conversational prompts are rendered with."""
        return resolve_chat_template(self.tokenizer, self.chat_template_arg)

    def encode(self, record: dict) -> EncodedPrompt:
        """The tokens of one prompt record.

        Raises:
            RecordError: the record fails :func:`check_prompt`, the chat template refuses
                it, or its tokens leave no room for ``max_completion_length`` within
                ``max_length``. The message has no location; prefix it.
        """
        fmt = check_prompt(record)
        prompt = record["prompt"]
        tools = record.get("tools")
        if self.tools is not None:
            tools = self._run_tools(record, fmt)
        if fmt == "standard":
            text = prompt
            ids = self._backend.encode(text, add_special_tokens=True).ids
        else:
            text, _ = render(
                self.tokenizer,
                self.chat_template,
                prompt,
                tools,
                add_generation_prompt=True,
            )
            # As `apply_chat_template(..., tokenize=True)`: the template wrote the special tokens.
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if len(ids) > self.max_prompt_tokens:
            raise RecordError(
                f"the prompt has {len(ids)} tokens, which leaves {self.max_length - len(ids)} "
                f"of max_length={self.max_length} for a completion of up to "
                f"grpo.max_completion_length={self.max_completion_length}; shorten the prompt, "
                f"raise max_length to at least {len(ids) + self.max_completion_length}, or "
                "lower grpo.max_completion_length"
            )
        return EncodedPrompt(ids, prompt, text, columns_of(record))

    def _run_tools(self, record: dict, fmt: str) -> list[dict] | None:
        """The tool schemas a multi-turn run renders `record`'s prompt with."""
        if fmt == "standard":
            raise RecordError(
                "a string prompt, but tools need a conversation: write the prompt as "
                '[{"role": "user", "content": "..."}] so the chat template shows the tools'
            )
        name = None
        if self.environments:
            name = record.get("environment")
            if name not in self.environments:
                raise RecordError(
                    f"its 'environment' field is {name!r}, which names no environment of "
                    f"environment_factory (it has {', '.join(map(repr, self.environments))}); "
                    "set the field to one of them"
                )
        return self.tools.get(name) or None


def where(index: int, file: str | None = None) -> str:
    """How an error names a record: ``"<file> row <index>"`` (``index`` counts from 0)."""
    return f"{file} row {index}" if file else f"row {index}"


def check_prompts(
    records: Iterable[Any],
    encoder: PromptEncoder | None = None,
    *,
    file: str | None = None,
    field: str = "data",
) -> list[EncodedPrompt]:
    """Check every prompt record of one file (or dataset), with ``encoder`` tokenize each too,
    and return them encoded (empty without an encoder). Runs in the driver before Ray starts.

    Raises:
        DataFileError: naming the first bad record (``<field>: <file> row N``), the fix, and
            how many other records are bad; or no record at all.
    """
    errors: list[str] = []
    first: tuple[str, str] | None = None
    encoded: list[EncodedPrompt] = []
    for index, record in enumerate(records):
        at = where(index, file)
        try:
            fmt = check_prompt(record, first)
            if encoder is not None:
                encoded.append(encoder.encode(record))
        except RecordError as e:
            errors.append(f"{at}: {e}")
            continue
        first = first or (fmt, at)
    if errors:
        more = len(errors) - 1
        tail = (
            f" ({more} more bad record{'s' if more > 1 else ''}, e.g. {errors[1]})" if more else ""
        )
        raise DataFileError(f"{field}: {errors[0]}{tail}")
    if first is None:
        raise DataFileError(f"{field}: {file or 'the records'} holds no prompts; {_EXAMPLE}")
    return encoded
