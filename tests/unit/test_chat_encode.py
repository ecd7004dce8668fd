"""The loss mask of chat records, token by token, for our ChatML and Llama-3 style templates.

Each check decodes the runs of tokens whose label is not -100 and compares them with the
assistant contents plus the end-of-turn token, so a mask that is off by one token, that trains on
a header, or that trains on nothing fails here.
"""

from __future__ import annotations

import random

import pytest

from ray_trainer._data.chat import ChatTemplateError, RecordError
from ray_trainer._data.encode import IGNORE_INDEX, Encoder
from ray_trainer._data.template import end_of_turn_ids, render
from ray_trainer._demo.chat import REASONING_TEMPLATE, make_tiny_chat_tokenizer

EOT = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}
STYLES = [(s, m) for s in ("chatml", "llama3") for m in (False, True)]
CONVERSATION = [
    {"role": "user", "content": "What color is the sky?"},
    {"role": "assistant", "content": "The sky is blue."},
    {"role": "user", "content": "And the grass?"},
    {"role": "assistant", "content": "The grass is green, mostly."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You are welcome."},
]
SYSTEM = {"role": "system", "content": "Answer briefly."}


@pytest.fixture(scope="module")
def tokenizers():
    return {(s, m): make_tiny_chat_tokenizer(s, m) for s, m in STYLES}


def trained_runs(tok, out) -> list[str]:
    """The decoded text of each run of consecutive tokens that take the loss."""
    runs, current = [], []
    for token, label in zip(out.input_ids, out.labels, strict=True):
        if label != IGNORE_INDEX:
            assert label == token  # labels are aligned with the inputs; the model shifts them
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


@pytest.mark.parametrize("system", [False, True], ids=["no-system", "system"])
@pytest.mark.parametrize(("style", "markers"), STYLES, ids=[f"{s}-{m}" for s, m in STYLES])
def test_assistant_turns_and_their_end_token_take_the_loss(tokenizers, style, markers, system):
    tok = tokenizers[style, markers]
    messages = [SYSTEM, *CONVERSATION] if system else CONVERSATION
    out = Encoder(tok, max_length=1024).encode({"messages": messages}, "messages")
    answers = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained_runs(tok, out) == [a + EOT[style] for a in answers]
    # The tokens are those transformers' apply_chat_template gives, so generation sees the same.
    assert out.input_ids == tok.apply_chat_template(messages, return_dict=True)["input_ids"]
    assert not out.truncated and out.num_labels == sum(x != IGNORE_INDEX for x in out.labels)


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_markers_agree_with_transformers_assistant_mask(tokenizers, style):
    tok = tokenizers[style, True]
    out = Encoder(tok).encode({"messages": [SYSTEM, *CONVERSATION]}, "messages")
    hf = tok.apply_chat_template(
        [SYSTEM, *CONVERSATION], return_dict=True, return_assistant_tokens_mask=True
    )
    assert [x != IGNORE_INDEX for x in out.labels] == [bool(m) for m in hf["assistant_masks"]]


@pytest.mark.parametrize(("style", "markers"), STYLES, ids=[f"{s}-{m}" for s, m in STYLES])
def test_last_assistant_and_all(tokenizers, style, markers):
    tok = tokenizers[style, markers]
    record = {"messages": CONVERSATION}
    last = Encoder(tok, train_on="last_assistant").encode(record, "messages")
    assert trained_runs(tok, last) == ["You are welcome." + EOT[style]]
    every = Encoder(tok, train_on="all").encode(record, "messages")
    assert every.labels == every.input_ids and every.labels is not every.input_ids
    assert every.input_ids == last.input_ids


def test_an_assistant_answer_also_said_by_the_user_is_found_in_its_own_turn(tokenizers):
    tok = tokenizers["chatml", False]
    messages = [
        {"role": "user", "content": "Say yes"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "yes or no?"},
        {"role": "assistant", "content": "no"},
    ]
    out = Encoder(tok).encode({"messages": messages}, "messages")
    assert trained_runs(tok, out) == ["yes<|im_end|>", "no<|im_end|>"]


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_answers_that_are_words_of_the_template(tokenizers, style):
    tok = tokenizers[style, False]
    messages = [
        {"role": "system", "content": "user"},
        {"role": "user", "content": "Who are you?"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "And me?"},
        {"role": "assistant", "content": "user"},
    ]
    out = Encoder(tok).encode({"messages": messages}, "messages")
    assert trained_runs(tok, out) == ["assistant" + EOT[style], "user" + EOT[style]]


def test_reasoning_of_earlier_turns_is_dropped_and_the_last_is_trained(tokenizers):
    tok = tokenizers["chatml", False]
    messages = [
        {"role": "user", "content": "Colour of snow?"},
        {"role": "assistant", "content": "<think>Snow is frozen water.</think>It is white."},
        {"role": "user", "content": "And coal?"},
        {"role": "assistant", "content": "It is black.", "reasoning_content": "Coal is carbon."},
    ]
    full, _ = render(tok, REASONING_TEMPLATE, messages)
    first, _ = render(tok, REASONING_TEMPLATE, messages[:2])
    assert not full.startswith(first)  # turn-by-turn prefixes would misplace the spans
    assert "frozen water" not in full and "Coal is carbon" in full
    out = Encoder(tok, chat_template=REASONING_TEMPLATE).encode({"messages": messages}, "messages")
    assert trained_runs(tok, out) == [
        "It is white.<|im_end|>",
        "<think>\nCoal is carbon.\n</think>\n\nIt is black.<|im_end|>",
    ]


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_tools_reach_the_template_and_take_no_loss(tokenizers, style):
    tok = tokenizers[style, False]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    out = Encoder(tok).encode({"messages": CONVERSATION[:2], "tools": tools}, "messages")
    assert "get_weather" in tok.decode(out.input_ids)
    assert trained_runs(tok, out) == ["The sky is blue." + EOT[style]]


def test_a_turn_of_tool_calls_is_trained_and_tool_results_are_not(tokenizers):
    tok = tokenizers["chatml", True]
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "Oslo"},  # also inside the call: must not end the turn early
        {"role": "assistant", "content": "It rains."},
    ]
    for markers in (False, True):
        out = Encoder(tokenizers["chatml", markers]).encode({"messages": messages}, "messages")
        runs = trained_runs(tok, out)
        assert len(runs) == 2 and "get_weather" in runs[0] and runs[0].endswith("<|im_end|>")
        assert runs[1] == "It rains.<|im_end|>"


def test_content_the_template_changes_is_refused_with_the_fix(tokenizers):
    tok = tokenizers["chatml", False]
    rewrite = "(message.content or '') | replace('sky', 'heaven')"
    template = tok.chat_template.replace("message.content or ''", rewrite)
    assert template != tok.chat_template
    with pytest.raises(RecordError) as err:
        Encoder(tok, chat_template=template).encode({"messages": CONVERSATION}, "messages")
    text = str(err.value)
    assert "messages[1]" in text and "The sky is blue." in text and "chat_template" in text
    assert not text.startswith(("/", "line", "row"))  # the caller adds the file and line


def test_a_template_that_changes_every_answer_is_refused_before_any_record(tokenizers):
    tok = tokenizers["chatml", False]
    template = tok.chat_template.replace("message.content or ''", "(message.content or '') | upper")
    with pytest.raises(ChatTemplateError, match="chat_template"):
        _ = Encoder(tok, chat_template=template).template_info


def test_markers_that_mark_nothing_are_refused(tokenizers):
    tok = tokenizers["chatml", False]
    # {% generation %} present, but only around text that is never rendered.
    template = tok.chat_template + "{% if false %}{% generation %}x{% endgeneration %}{% endif %}"
    with pytest.raises(RecordError, match="generation"):
        Encoder(tok, chat_template=template).encode({"messages": CONVERSATION}, "messages")


def test_a_template_that_refuses_a_conversation_gives_a_record_error(tokenizers):
    tok = tokenizers["chatml", False]
    alternate = (
        "{% for m in messages %}{% if not loop.first and m.role == loop.previtem.role %}"
        "{{ raise_exception('roles must alternate') }}{% endif %}{% endfor %}"
    )
    enc = Encoder(tok, chat_template=alternate + tok.chat_template)
    assert enc.encode({"messages": CONVERSATION}, "messages").num_labels > 0
    twice = [CONVERSATION[0], CONVERSATION[0], CONVERSATION[1]]
    with pytest.raises(RecordError, match="roles must alternate"):
        enc.encode({"messages": twice}, "messages")
    with pytest.raises(ChatTemplateError, match="plain user/assistant"):
        _ = Encoder(tok, chat_template="{{ raise_exception('no') }}").template_info


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_truncation_keeps_the_beginning_and_can_remove_every_label(tokenizers, style):
    tok = tokenizers[style, False]
    full = Encoder(tok).encode({"messages": CONVERSATION}, "messages")
    first_label = next(i for i, x in enumerate(full.labels) if x != IGNORE_INDEX)
    cut = Encoder(tok, max_length=first_label).encode({"messages": CONVERSATION}, "messages")
    assert cut.truncated and cut.input_ids == full.input_ids[:first_label]
    assert cut.no_labels and set(cut.labels) == {IGNORE_INDEX}
    some = Encoder(tok, max_length=first_label + 3).encode({"messages": CONVERSATION}, "messages")
    assert some.labels == full.labels[: first_label + 3] and some.num_labels == 3


def test_end_of_turn_ids(tokenizers):
    for (style, _), tok in tokenizers.items():
        assert end_of_turn_ids(tok, tok.chat_template) == [tok.convert_tokens_to_ids(EOT[style])]
    llama = tokenizers["llama3", False]
    assert llama.eos_token_id not in end_of_turn_ids(llama, llama.chat_template)


@pytest.mark.parametrize("markers", [False, True])
@pytest.mark.parametrize("train_on", ["assistant", "all"])
def test_conversational_prompt_completion(tokenizers, train_on, markers):
    tok = tokenizers["llama3", markers]
    prompt = [SYSTEM, *CONVERSATION[:3]]  # a few-shot assistant turn inside the prompt
    completion = [CONVERSATION[3]]
    record = {"prompt": prompt, "completion": completion}
    out = Encoder(tok, train_on=train_on).encode(record, "conversational")
    whole = Encoder(tok, train_on=train_on).encode({"messages": prompt + completion}, "messages")
    assert out.input_ids == whole.input_ids
    if train_on == "all":
        assert out.labels == out.input_ids
    else:
        assert trained_runs(tok, out) == ["The grass is green, mostly.<|eot_id|>"]


@pytest.mark.parametrize(("style", "markers"), STYLES, ids=[f"{s}-{m}" for s, m in STYLES])
def test_random_conversations(tokenizers, style, markers):
    # Answers that repeat, that repeat the user, that are words of the template, with spaces
    # around them and non-ASCII text: every assistant turn, and only them, take the loss.
    rng = random.Random(f"{style}{markers}")
    words = ["yes", "no", "assistant", "user", "system", "OK.", "ça va", "naïve", "42", "the sky"]
    tok = tokenizers[style, markers]
    enc = Encoder(tok, max_length=4096)
    for _ in range(100):
        messages = [SYSTEM] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            for role in ("user", "assistant"):
                text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))
                pad = rng.choice(["", " ", "  "])
                messages.append({"role": role, "content": pad + text + rng.choice(["", " "])})
        out = enc.encode({"messages": messages}, "messages")
        shown = (lambda c: c) if style == "chatml" else str.strip  # Llama 3 trims contents
        expected = [shown(m["content"]) + EOT[style] for m in messages if m["role"] == "assistant"]
        assert trained_runs(tok, out) == expected, messages
