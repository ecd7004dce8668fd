"""Prompt-only records, GRPO's data (issue 50, point 1): TRL 1.16's two formats detected from the
columns and rendered as TRL renders them (the chat template's generation prompt), the other
columns kept for the reward functions, and every refusal naming the file, the row and the fix,
before Ray starts. A tiny real tokenizer with a chat template is built on the spot."""

from __future__ import annotations

import json

import pytest

from ray_trainer._data.chat import RecordError
from ray_trainer._data.prompts import (
    PromptEncoder,
    check_prompt,
    check_prompts,
    prompt_format,
)
from ray_trainer._data.records import scan
from ray_trainer._data.sources import DataFileError, resolve
from ray_trainer._demo.chat import make_tiny_chat_tokenizer

USER = {"role": "user", "content": "What is 2 + 2?"}
SYSTEM = {"role": "system", "content": "Answer with a number."}


@pytest.fixture(scope="module")
def tok():
    return make_tiny_chat_tokenizer("chatml")


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_formats_are_trls_and_other_columns_reach_the_rewards(tok):
    assert prompt_format({"prompt": "2+2="}) == "standard"
    assert prompt_format({"prompt": [USER]}) == "conversational"
    enc = PromptEncoder(tok, max_length=64, max_completion_length=16)
    text = enc.encode({"prompt": "2+2=", "answer": "4", "level": 1})
    assert text.prompt_ids == tok("2+2=")["input_ids"]  # as TRL: tokenizer(text)
    assert text.columns == {"answer": "4", "level": 1} and text.prompt == "2+2="
    chat = enc.encode({"prompt": [SYSTEM, USER], "answer": "4"})
    # As TRL: apply_chat_template(..., add_generation_prompt=True, tokenize=True).
    want = tok.apply_chat_template([SYSTEM, USER], add_generation_prompt=True, tokenize=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert chat.prompt_ids == list(want)
    assert chat.text.endswith("<|im_start|>assistant\n")  # the completion is the assistant's turn
    assert chat.columns == {"answer": "4"} and chat.prompt == [SYSTEM, USER]


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ({"question": "2+2="}, "no 'prompt' field (found keys: 'question')"),
        ({"prompt": 4}, "'prompt' must be a string or a list of messages, got a JSON number"),
        ({"prompt": "  "}, "'prompt' is empty"),
        ({"prompt": []}, "'prompt' must be a non-empty list of messages"),
        ({"prompt": [{"role": "robot", "content": "x"}]}, "prompt[0] has role 'robot'"),
        (
            {"prompt": [USER, {"role": "assistant", "content": "4"}]},
            "'prompt' ends on an assistant turn (prompt[1]): a completion would continue",
        ),
        ({"prompt": "2+2=", "completions": "x"}, "field 'completions' would shadow"),
    ],
)
def test_bad_prompts_are_refused_with_the_fix(record, needle):
    with pytest.raises(RecordError) as info:
        check_prompt(record)
    assert needle in str(info.value)


def test_a_prompt_that_leaves_no_room_for_its_completion_is_refused(tok):
    enc = PromptEncoder(tok, max_length=12, max_completion_length=8)
    assert enc.max_prompt_tokens == 4
    with pytest.raises(RecordError) as info:
        enc.encode({"prompt": "What is the colour of the sky at noon?"})
    msg = str(info.value)
    assert "leaves" in msg and "grpo.max_completion_length=8" in msg
    assert "raise max_length to at least" in msg and "shorten the prompt" in msg
    with pytest.raises(ValueError, match="leaves no room for a prompt within max_length=8"):
        PromptEncoder(tok, max_length=8, max_completion_length=8)


def test_a_file_of_prompts_is_detected_and_scanned_naming_file_row_and_fix(tok, tmp_path):
    good = [{"prompt": [USER], "answer": str(i)} for i in range(3)]
    path = jsonl(tmp_path / "p.jsonl", good)
    source = resolve(path, "data")
    assert source.fmt == "prompts" and source.columns == ["prompt", "answer"]
    scanned = scan(
        source, prompt_encoder=PromptEncoder(tok, max_length=64, max_completion_length=8)
    )
    assert scanned.records == 3 and scanned.pair_format == "conversational"

    bad = [*good, {"answer": "5"}, {"prompt": [USER, {"role": "assistant", "content": "4"}]}]
    path = jsonl(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataFileError) as info:
        scan(resolve(path, "data"))
    msg = str(info.value)
    assert msg.startswith(f"data: {path}:4: no 'prompt' field")
    assert f"(1 more bad record, e.g. {path}:5: 'prompt' ends on an assistant turn" in msg

    mixed = jsonl(tmp_path / "mixed.jsonl", [{"prompt": "2+2="}, {"prompt": [USER]}])
    with pytest.raises(DataFileError, match=r"mixed.jsonl:2: a 'conversational' prompt, but"):
        scan(resolve(mixed, "data"))

    long = jsonl(tmp_path / "long.jsonl", [{"prompt": "2+2="}, {"prompt": "why? " * 40}])
    tight = PromptEncoder(tok, max_length=48, max_completion_length=16)
    with pytest.raises(DataFileError) as info:
        scan(resolve(long, "data"), prompt_encoder=tight)
    assert f"data: {long}:2: the prompt has" in str(info.value)
    assert "raise max_length to at least" in str(info.value)


def test_records_in_memory_are_checked_by_row(tok):
    enc = PromptEncoder(tok, max_length=64, max_completion_length=8)
    encoded = check_prompts([{"prompt": "a"}, {"prompt": "b", "x": 1}], enc, file="mem")
    assert [e.columns for e in encoded] == [{}, {"x": 1}]
    with pytest.raises(DataFileError, match=r"^val_data: mem row 1: 'prompt' is empty"):
        check_prompts([{"prompt": "a"}, {"prompt": ""}], file="mem", field="val_data")
    with pytest.raises(DataFileError, match="holds no prompts"):
        check_prompts([])


def test_sft_refuses_prompt_only_records_naming_them(tmp_path):
    from ray_trainer import TrainingArgs
    from ray_trainer._driver.data import check_objective
    from ray_trainer._errors import TrainingArgsError

    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "answer": "4"}])
    args = TrainingArgs(data=path)
    with pytest.raises(TrainingArgsError) as info:
        check_objective("data", path, resolve(path, "data"), args)
    assert "holds prompt-only records (no completion); objective='sft' trains on" in str(info.value)
