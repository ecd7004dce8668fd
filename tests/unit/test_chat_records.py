"""Chat templates resolved and refused, messages validated, and the plain text formats encoded."""

from __future__ import annotations

import pytest

from ray_trainer._data.chat import (
    ChatTemplateError,
    RecordError,
    check_messages,
    check_record,
    string_field,
)
from ray_trainer._data.encode import IGNORE_INDEX, ByteTokenizer, Encoder
from ray_trainer._data.template import resolve_chat_template
from ray_trainer._demo.chat import chat_template, make_tiny_chat_tokenizer

TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_chat_tokenizer("chatml")


# -- the template ---------------------------------------------------------------------------------


def test_a_tokenizer_without_template_is_refused_naming_chat_template(tok):
    bare = make_tiny_chat_tokenizer("chatml")
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match=r"TrainingArgs\.chat_template is not set"):
        resolve_chat_template(bare)
    with pytest.raises(ChatTemplateError, match=r"chat_template"):
        Encoder(bare).encode({"messages": TURN}, "messages")
    # Plain text needs no template.
    assert Encoder(bare).encode({"text": "the cat"}, "text").num_labels > 0
    assert resolve_chat_template(bare, tok.chat_template) == tok.chat_template


def test_check_template_fails_early_and_all_needs_no_probe(tok):
    bare = make_tiny_chat_tokenizer("chatml")
    bare.chat_template = None
    with pytest.raises(ChatTemplateError, match="chat_template"):
        Encoder(bare).check_template()
    counting = "{{ messages | length }} messages"  # renders no content: no span can be found
    with pytest.raises(ChatTemplateError, match="in order"):
        Encoder(tok, chat_template=counting).check_template()
    every = Encoder(tok, chat_template=counting, train_on="all")
    every.check_template()
    out = every.encode({"messages": TURN}, "messages")
    assert tok.decode(out.input_ids) == "2 messages" and out.labels == out.input_ids


def test_a_template_is_read_from_a_file(tok, tmp_path):
    path = tmp_path / "chat_template.jinja"
    path.write_text(chat_template("llama3"))
    assert resolve_chat_template(tok, str(path)) == chat_template("llama3")
    out = Encoder(tok, chat_template=str(path)).encode({"messages": TURN}, "messages")
    assert "<|eot_id|>" in tok.decode(out.input_ids)  # a plain string for this tokenizer


def test_a_missing_file_or_bad_jinja_is_refused(tok, tmp_path):
    with pytest.raises(ChatTemplateError, match="is not an existing file"):
        resolve_chat_template(tok, str(tmp_path / "nope.jinja"))
    with pytest.raises(ChatTemplateError, match=r"not valid Jinja \(line 1"):
        resolve_chat_template(tok, "{% for m in messages %}{{ m.content }}")
    # {% generation %} is part of the language a chat template is written in.
    assert resolve_chat_template(tok, chat_template("chatml", generation_markers=True))


def test_named_templates(tok):
    named = make_tiny_chat_tokenizer("chatml")
    named.chat_template = {"default": chat_template("chatml"), "tool_use": chat_template("llama3")}
    assert resolve_chat_template(named) == chat_template("chatml")
    assert resolve_chat_template(named, "tool_use") == chat_template("llama3")


def test_chat_data_needs_a_hugging_face_tokenizer():
    with pytest.raises(ChatTemplateError, match="fast tokenizer"):
        Encoder(ByteTokenizer(), chat_template=chat_template()).encode(
            {"messages": TURN}, "messages"
        )


# -- messages -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "needle"),
    [
        ([], "non-empty list"),
        ("hi", "got a JSON string"),
        ([["user", "hi"]], r"messages\[0\] must be a JSON object"),
        ([{"role": "human", "content": "hi"}], "role 'human'"),
        ([{"content": "hi"}], r"found keys: 'content'"),
        ([{"role": "user", "content": ["hi"]}], "must be a string"),
        ([{"role": "user"}], "no 'content'"),
        ([{"role": "user", "content": "hi"}], "no assistant message"),
    ],
)
def test_bad_messages_are_refused_with_the_fix(messages, needle):
    with pytest.raises(RecordError, match=needle):
        check_messages(messages)


def test_good_messages_pass():
    check_messages(TURN)
    check_messages([{"role": "user", "content": "hi"}], train_on="all")  # nothing to mask
    call = {"function": {"name": "f", "arguments": {}}}
    check_messages([*TURN, {"role": "assistant", "content": None, "tool_calls": [call]}])
    with pytest.raises(RecordError, match="'tools' must be a list"):
        check_messages(TURN, tools={"name": "f"})


# -- plain text formats ---------------------------------------------------------------------------


@pytest.mark.parametrize("hf", [True, False], ids=["hf", "bytes"])
def test_prompt_completion_and_text_as_the_tokenizer_encodes_them(tok, hf):
    tokenizer = tok if hf else ByteTokenizer()
    eos = tokenizer.eos_token_id if hf else tokenizer.eos_id

    def ids(text, first):  # special tokens (e.g. a BOS) only at the start of the sequence
        if hf:
            return tokenizer(text, add_special_tokens=first)["input_ids"]
        return tokenizer.encode(text)

    enc = Encoder(tokenizer, max_length=64)
    records = [{"prompt": "What is the sky?", "completion": " Blue."}, {"text": "The cat sat."}]
    pc = enc.encode(records[0], "prompt_completion")
    head, tail = ids("What is the sky?", True), [*ids(" Blue.", False), eos]
    assert pc.input_ids == head + tail and pc.labels == [IGNORE_INDEX] * len(head) + tail
    text = enc.encode(records[1], "text")
    assert text.input_ids == text.labels == [*ids("The cat sat.", True), eos]
    every = Encoder(tokenizer, train_on="all").encode(records[0], "prompt_completion")
    assert every.labels == every.input_ids


def test_record_errors_of_plain_formats(tok):
    enc = Encoder(tok, text_field="body")
    assert enc.encode({"body": "the dog"}, "text").num_labels > 0
    with pytest.raises(RecordError, match=r"missing field 'body' \(found keys: 'text'\)"):
        enc.encode({"text": "the dog"}, "text")
    with pytest.raises(RecordError, match="'completion' must be a string, got a JSON number"):
        enc.encode({"prompt": "a", "completion": 3}, "prompt_completion")
    with pytest.raises(RecordError, match="'completion' has no assistant message"):
        enc.encode({"prompt": TURN, "completion": [TURN[0]]}, "conversational")
    with pytest.raises(RecordError, match=r"missing field 'completion' \(found keys: 'prompt'\)"):
        check_record({"prompt": "a"}, "prompt_completion")
    with pytest.raises(RecordError, match="must be a JSON object, got a JSON array"):
        check_record([], "text")
    with pytest.raises(ValueError, match="unknown record format"):
        enc.encode({"text": "x"}, "markdown")
    with pytest.raises(ValueError, match="train_on"):
        Encoder(tok, train_on="assistants")


def test_a_required_string_field_is_returned_or_refused_with_the_callers_fix():
    # One check of a required string field, for the plain formats and for preference pairs.
    assert string_field({"prompt": "a"}, "prompt") == "a"
    fixes = {"if_missing": "; add it", "if_not_str": "; quote it"}
    with pytest.raises(RecordError, match=r"^missing field 'x' \(found keys: 'y'\); add it$"):
        string_field({"y": 1}, "x", **fixes)
    with pytest.raises(RecordError, match=r"^missing field 'x' \(found keys: none\)$"):
        string_field({}, "x")
    with pytest.raises(RecordError, match=r"^field 'x' must be a string, got a JSON null; quote"):
        string_field({"x": None}, "x", **fixes)
