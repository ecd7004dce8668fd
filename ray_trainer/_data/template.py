"""Anywhere (driver, data-preparation tasks, workers): the chat template of a run.

Which template a run uses (:func:`resolve_chat_template`: ``TrainingArgs.chat_template`` or the
tokenizer's own), how a conversation renders (:func:`render`, exactly as
``tokenizer.apply_chat_template`` renders it) and what the template puts around an assistant
turn (:func:`probe_template`, :func:`end_of_turn_ids`), found once by rendering a probe
conversation. Nothing here imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ray_trainer._data.chat import ChatTemplateError, RecordError, TemplateInfo

_FIX_TEMPLATE = (
    "set TrainingArgs.chat_template to a Jinja template string or the path of a .jinja file "
    "(e.g. the chat_template.jinja of a chat model of the same family)"
)
# Probe contents: words no template rewrites, and that no template text contains.
_PROBE = ("Qzu1 probe", "Qza1 probe", "Qzu2 probe", "Qza2 probe")


# -- the template ---------------------------------------------------------------------------------


def resolve_chat_template(tokenizer: Any, chat_template: str | None = None) -> str:
    """The Jinja text a run renders conversations with.

    ``chat_template`` (a Jinja string, the path of a file holding one, or the name of one of the
    tokenizer's named templates) overrides the tokenizer's own. Runs in the driver (to refuse a
    run before training) and in every process that builds an :class:`~.encode.Encoder`.

    Raises:
        ChatTemplateError: no template at all, a path that does not exist, or a template that
            is not valid Jinja.
    """
    own = getattr(tokenizer, "chat_template", None)
    if chat_template is not None:
        text, where = _read_template(chat_template, own), "TrainingArgs.chat_template"
    else:
        where = f"the chat template of tokenizer {_tokenizer_name(tokenizer)}"
        if isinstance(own, dict):
            if "default" not in own:
                raise ChatTemplateError(
                    f"{where[4:]}s are named {sorted(own)} and none is 'default'; "
                    "set TrainingArgs.chat_template to one of those names"
                )
            own = own["default"]
        if not own:
            raise ChatTemplateError(
                f"tokenizer {_tokenizer_name(tokenizer)} has no chat template, and "
                f"TrainingArgs.chat_template is not set; {_FIX_TEMPLATE}"
            )
        text = own
    _check_syntax(text, where)
    return text


def _read_template(value: str, own: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ChatTemplateError(
            f"TrainingArgs.chat_template must be a non-empty string, got {value!r}; {_FIX_TEMPLATE}"
        )
    if "{{" in value or "{%" in value:
        return value
    if isinstance(own, dict) and value in own:
        return own[value]
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(
                f"TrainingArgs.chat_template: cannot read {path} ({e}); give a readable UTF-8 file"
            ) from None
    raise ChatTemplateError(
        f"TrainingArgs.chat_template={value!r} is not an existing file (resolved to "
        f"{path.resolve()}), nor a Jinja template (it has no '{{{{' or '{{%'); {_FIX_TEMPLATE}"
    )


def _check_syntax(text: str, where: str) -> None:
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):  # parses {% generation %} ... {% endgeneration %} only
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(extensions=[_Generation, "jinja2.ext.loopcontrols"])
    try:
        env.parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{where} is not valid Jinja (line {e.lineno}: {e.message}); fix it, or "
            "set TrainingArgs.chat_template to a valid template"
        ) from None


def _tokenizer_name(tokenizer: Any) -> str:
    name = getattr(tokenizer, "name_or_path", None)
    return repr(name) if name else type(tokenizer).__name__


# -- rendering ------------------------------------------------------------------------------------


def render(
    tokenizer: Any,
    template: str,
    messages: Sequence[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = False,
    track: bool = False,
) -> tuple[str, list[tuple[int, int]]]:
    """The text of a whole conversation, and the ``{% generation %}`` spans when ``track``.

    Renders exactly as ``tokenizer.apply_chat_template`` does (transformers' renderer, the
    tokenizer's special tokens as template variables, keys whose value is None dropped), so that
    training and generation see the same text. A template's ``raise_exception`` becomes a
    :class:`RecordError`.
    """
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    chat = [
        m if None not in m.values() else {k: v for k, v in m.items() if v is not None}
        for m in messages
    ]
    try:
        texts, spans = render_jinja_template(
            conversations=[chat],
            tools=tools,
            chat_template=template,
            return_assistant_tokens_mask=track,
            add_generation_prompt=add_generation_prompt,
            **getattr(tokenizer, "special_tokens_map", {}),
        )
    except jinja2.TemplateError as e:
        raise RecordError(
            f"the chat template refused this conversation ({type(e).__name__}: {e}); fix the "
            "record to fit the template, or set TrainingArgs.chat_template to one that fits it"
        ) from None
    return texts[0], list(spans[0]) if track else []


def probe_template(tokenizer: Any, template: str) -> TemplateInfo:
    """Find a template's assistant header and end-of-turn text by rendering a probe
    conversation (two user/assistant exchanges). Runs once per :class:`~.encode.Encoder`."""
    u1, a1, u2, a2 = _PROBE
    probe = [
        {"role": "user", "content": u1},
        {"role": "assistant", "content": a1},
        {"role": "user", "content": u2},
        {"role": "assistant", "content": a2},
    ]
    try:
        text, _ = render(tokenizer, template, probe)
        first, _ = render(tokenizer, template, probe[:1])
        prompt, _ = render(tokenizer, template, probe[:1], add_generation_prompt=True)
    except RecordError as e:
        raise ChatTemplateError(
            f"the chat template cannot render a plain user/assistant conversation ({e}); "
            f"{_FIX_TEMPLATE}"
        ) from None
    at_u1, at_a1, at_u2 = text.find(u1), text.find(a1), text.find(u2)
    if min(at_u1, at_a1, at_u2) < 0 or not at_u1 < at_a1 < at_u2:
        raise ChatTemplateError(
            "the chat template does not render the messages' content in order (a probe "
            f"conversation rendered as {text[:300]!r}); {_FIX_TEMPLATE}"
        )
    generation_prompt = prompt[len(first) :] if prompt.startswith(first) else ""
    before = text[at_u1 + len(u1) : at_a1]  # the user's end of turn, then the assistant header
    header = next(
        (
            before[-k:]
            for k in range(len(before), 0, -1)
            if generation_prompt.startswith(before[-k:])
        ),
        "",
    )
    if not header.strip():  # whitespace alone would match anywhere: no header, content spans
        header = ""
    after = text[at_a1 + len(a1) : at_u2]
    last_after = text[text.find(a2) + len(a2) :]
    end = _first_special(tokenizer, after) or _first_special(tokenizer, last_after)
    return TemplateInfo(template, header, end, _marks_generation(template))


def end_of_turn_ids(tokenizer: Any, template: str) -> list[int]:
    """The token id(s) that end an assistant turn under ``template`` (e.g. ``<|im_end|>``,
    ``<|eot_id|>``), found by rendering a probe conversation; empty if the template ends turns
    with no special token. Put them in a checkpoint's ``generation_config.eos_token_id`` (with
    the tokenizer's own EOS) so that generation stops where a trained turn stops."""
    end = probe_template(tokenizer, template).end_of_turn
    return tokenizer.backend_tokenizer.encode(end, add_special_tokens=False).ids if end else []


def _first_special(tokenizer: Any, text: str) -> str:
    """The text of the first special or added token in ``text``, or ""."""
    special = set(getattr(tokenizer, "all_special_ids", ())) | set(
        getattr(tokenizer, "added_tokens_decoder", {})
    )
    enc = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    for token_id, (start, end) in zip(enc.ids, enc.offsets, strict=True):
        if token_id in special:
            return text[start:end]
    return ""


def _marks_generation(template: str) -> bool:
    import re

    return re.search(r"\{%-?\s*generation\s*-?%\}", template) is not None
