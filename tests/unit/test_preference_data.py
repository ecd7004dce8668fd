"""Preference pairs (issue 35, point 1): TRL 1.16's three formats tokenize to the very ids TRL's
``DPOTrainer`` makes (its own dataset preparation and collator, called on the same records), with
its truncation rules; and every refusal names the row, the file and the fix.

A tiny real tokenizer with a chat template is built on the spot (no download).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from preference_support import MAKE, assistant, conversational, implicit, standard, user

from ray_trainer._data.chat import ChatTemplateError
from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._data.preference import (
    EncodedPair,
    PairEncoder,
    check_pairs,
    check_val_pairs,
    encode_pairs,
    pair_format,
)
from ray_trainer._data.sources import DataFileError
from ray_trainer._demo.chat import chat_template, make_tiny_chat_tokenizer

THINGS = ("sky", "grass", "sea", "sun")


@pytest.fixture(scope="module")
def tokenizers():
    return {style: make_tiny_chat_tokenizer(style) for style in ("chatml", "llama3")}


@pytest.fixture(scope="module")
def tok(tokenizers):
    return tokenizers["chatml"]


def trl_prepared(tokenizer, records, max_length=None):
    """TRL 1.16's own preparation of a preference dataset (prompt extraction, EOS, chat
    template, tokenization, the filter of pairs whose prompt fills max_length)."""
    datasets = pytest.importorskip("datasets")
    dpo_trainer = pytest.importorskip("trl.trainer.dpo_trainer")
    args = SimpleNamespace(
        dataset_num_proc=None, max_length=max_length, truncation_mode="keep_start"
    )
    owner = SimpleNamespace(_tokenizer=tokenizer)  # all _prepare_dataset reads of the trainer
    prepare = dpo_trainer.DPOTrainer._prepare_dataset
    return prepare(owner, datasets.Dataset.from_list(records), tokenizer, args, "train")


# -- formats --------------------------------------------------------------------------------------


def test_formats_are_told_apart_as_trl_tells_them():
    assert pair_format(standard("sky")) == "standard"
    assert pair_format(conversational("sky")) == "conversational"
    assert pair_format(implicit("sky")) == "implicit_prompt"
    # A prompt string beside whole conversations (as some datasets have): TRL extracts anyway.
    assert pair_format({"prompt": "What color?", **implicit("sky")}) == "implicit_prompt"


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("fmt", sorted(MAKE))
def test_each_format_tokenizes_to_trls_ids(tokenizers, fmt, style):
    tokenizer = tokenizers[style]
    records = [MAKE[fmt](t) for t in THINGS]
    ours = encode_pairs(records, PairEncoder(tokenizer))
    theirs = trl_prepared(tokenizer, records)
    assert ours.fmt == fmt and ours.dropped == 0 and ours.truncated == 0
    for pair, row in zip(ours.pairs, theirs, strict=True):
        assert pair.prompt_ids == row["prompt_ids"]
        assert pair.chosen_ids == row["chosen_ids"]
        assert pair.rejected_ids == row["rejected_ids"]


def test_what_each_part_holds(tok):
    conv = PairEncoder(tok).encode(conversational("sky"), "conversational")
    assert tok.decode(conv.prompt_ids).endswith(
        "What color is the sky?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(conv.chosen_ids) == "The sky is blue.<|im_end|>\n"
    std = PairEncoder(tok).encode(standard("sky"), "standard")
    assert tok.decode(std.prompt_ids) == "What color is the sky?\n"
    assert tok.decode(std.chosen_ids) == "The sky is blue.<|im_end|>"  # TRL adds the EOS text
    again = PairEncoder(tok).encode(
        {**standard("sky"), "chosen": "The sky is blue.<|im_end|>"}, "standard"
    )
    assert again.chosen_ids == std.chosen_ids  # ... once


def test_implicit_prompt_is_the_shared_messages(tok):
    encoder = PairEncoder(tok)
    assert encoder.encode(implicit("sea"), "implicit_prompt") == encoder.encode(
        conversational("sea"), "conversational"
    )
    # Multi-turn: the prompt runs up to the first message that differs.
    turns = [user("Hi"), assistant("Hello."), user("What color is the sky?")]
    pair = {"chosen": [*turns, assistant("Blue.")], "rejected": [*turns, assistant("Green.")]}
    got = encoder.encode(pair, "implicit_prompt")
    want = encoder.encode(
        {"prompt": turns, "chosen": [assistant("Blue.")], "rejected": [assistant("Green.")]},
        "conversational",
    )
    assert got == want


def test_sequences_mask_the_prompt_with_the_ignore_index():
    pair = EncodedPair([1, 2, 3], [4, 5], [6])
    (c_ids, c_labels), (r_ids, r_labels) = pair.sequences()
    assert c_ids == [1, 2, 3, 4, 5] and c_labels == [IGNORE_INDEX] * 3 + [4, 5]
    assert r_ids == [1, 2, 3, 6] and r_labels == [IGNORE_INDEX] * 3 + [6]
    assert (pair.chosen_tokens, pair.rejected_tokens) == (2, 1)


# -- truncation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["standard", "conversational"])
def test_truncation_keeps_the_start_and_drops_pairs_whose_prompt_fills_max_length(tok, fmt):
    records = [MAKE[fmt](t) for t in THINGS]
    long_prompt = MAKE[fmt]("sky")
    if fmt == "standard":
        long_prompt["prompt"] = "Tell me about the weather today. " * 8 + "\n"
    else:
        long_prompt["prompt"][-1] = user("Tell me about the weather today. " * 8)
    records.insert(2, long_prompt)
    encoder = PairEncoder(tok)
    prompt_len = len(encoder.encode(records[0], fmt).prompt_ids)
    max_length = prompt_len + 3  # every answer cut to 3 tokens
    ours = encode_pairs(records, PairEncoder(tok, max_length=max_length))
    assert ours.dropped == 1 and ours.truncated == len(THINGS) and len(ours.pairs) == len(THINGS)

    # TRL: its dataset filter, then its collator's per-sequence keep_start truncation.
    collator = pytest.importorskip("trl.trainer.dpo_trainer").DataCollatorForPreference
    theirs = trl_prepared(tok, records, max_length)
    batch = collator(pad_token_id=tok.pad_token_id, max_length=max_length)(list(theirs))
    n = len(ours.pairs)
    assert len(theirs) == n
    rows = [s for pair in ours.pairs for s in pair.sequences()]
    ordered = rows[0::2] + rows[1::2]  # TRL's batch: every chosen, then every rejected
    for (ids, labels), got, mask in zip(
        ordered, batch["input_ids"], batch["completion_mask"], strict=True
    ):
        assert len(ids) <= max_length
        assert got[: len(ids)].tolist() == ids
        assert [i for i, m in zip(ids, mask.tolist(), strict=False) if m] == [
            x for x in labels if x != IGNORE_INDEX
        ]


def test_no_max_length_keeps_everything(tok):
    records = [conversational(t) for t in THINGS]
    assert encode_pairs(records, PairEncoder(tok, max_length=None)).truncated == 0
    with pytest.raises(ValueError, match="max_length must be at least 2"):
        PairEncoder(tok, max_length=1)


# -- refusals -------------------------------------------------------------------------------------

# The REASONING-like case: a generation prompt that opens an empty thought block which the whole
# conversation does not have, so the prompt alone is not a prefix of the prompt + answer.
THINKING_PROMPT = chat_template("chatml").replace(
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}",
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
)

REFUSED = {
    # name: (bad record, words the message must hold)
    "empty chosen string": ({**standard("sky"), "chosen": "  "}, "'chosen' is empty"),
    "empty prompt string": ({**standard("sky"), "prompt": ""}, "'prompt' is empty"),
    "empty rejected list": (
        {**conversational("sky"), "rejected": []},
        "'rejected' is an empty list",
    ),
    "empty assistant message": (
        {**conversational("sky"), "chosen": [assistant("")]},
        "'chosen' is empty",
    ),
    "implicit side with nothing after the prompt": (
        {"chosen": implicit("sky")["chosen"], "rejected": implicit("sky")["chosen"][:2]},
        "the rejected side is empty",
    ),
    "identical strings": ({**standard("sky"), "rejected": "The sky is blue."}, "same text"),
    "identical messages": (
        {**conversational("sky"), "rejected": [assistant("The sky is blue.")]},
        "same answer",
    ),
    "identical once tokenized": (
        {**standard("sky"), "rejected": "The sky is blue.<|im_end|>"},
        "tokenize to the same tokens",
    ),
    "a user message in chosen": (
        {**conversational("sky"), "chosen": [user("What color is the sky?"), assistant("Blue.")]},
        "chosen[0] has role 'user'",
    ),
    "a user turn after the implicit prompt": (
        {
            "chosen": [user("Hi"), assistant("Hello."), user("Bye")],
            "rejected": [user("Hi"), assistant("Go away.")],
        },
        "message 1 of chosen's answer has role 'user'",
    ),
    "no shared prompt": (
        {"chosen": [user("A"), assistant("B")], "rejected": [user("C"), assistant("D")]},
        "share no prompt",
    ),
    "string answers without a prompt": (
        {"chosen": "Blue.", "rejected": "Green."},
        "no 'prompt' field",
    ),
    "mixed field types": ({**standard("sky"), "rejected": [assistant("x")]}, "must be a string"),
    "not a pair": ({"messages": [user("Hi"), assistant("Hello.")]}, "not a preference pair"),
    "prompt merges with the answer": (
        {"prompt": "The sky is ", "chosen": "blue.", "rejected": "green."},
        "not a prefix of the tokenized prompt + chosen",
    ),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_bad_pair_is_refused_by_row_and_file_with_the_fix(tok, name):
    bad, words = REFUSED[name]
    fmt = "standard" if isinstance(bad.get("chosen"), str) else "conversational"
    records = [MAKE[fmt](t) for t in THINGS]
    records.insert(3, bad)
    with pytest.raises(DataFileError) as info:
        encode_pairs(records, PairEncoder(tok), file="prefs.jsonl")
    message = str(info.value)
    assert message.startswith("data: prefs.jsonl row 3: "), message
    assert words in message, message
    assert ";" in message  # ... and the fix after it
    assert "more bad record" not in message


def test_a_template_that_renders_the_prompt_otherwise_is_refused(tok):
    encoder = PairEncoder(tok, chat_template=THINKING_PROMPT)
    with pytest.raises(DataFileError, match=r"row 0: the tokenized prompt is not a prefix") as info:
        encode_pairs([conversational("sky")], encoder)
    assert "TrainingArgs.chat_template" in str(info.value)
    assert "<think>" in str(info.value)  # shows where they part


def test_mixed_formats_in_one_file_are_refused():
    records = [conversational("sky"), conversational("sea"), implicit("sun"), standard("grass")]
    with pytest.raises(DataFileError) as info:
        check_pairs(records, file="mixed.jsonl")
    message = str(info.value)
    assert message.startswith("data: mixed.jsonl row 2: a pair in the 'implicit_prompt' format")
    assert "but mixed.jsonl row 0 is in the 'conversational' one" in message
    assert "(1 more bad record, e.g. mixed.jsonl row 3: a pair in the 'standard' format" in message


def test_val_data_that_is_not_pairs_is_refused():
    chat = [{"messages": [user("Hi"), assistant("Hello.")]} for _ in range(3)]
    with pytest.raises(DataFileError) as info:
        check_val_pairs(chat, file="val.jsonl")
    message = str(info.value)
    assert message.startswith("val_data: val.jsonl row 0: not a preference pair")
    assert "2 more bad records" in message
    assert check_val_pairs([standard("sky")]) == "standard"
    with pytest.raises(DataFileError, match="holds no preference pairs"):
        check_val_pairs([], file="val.jsonl")


def test_every_bad_row_is_counted_and_the_first_named(tok):
    records = [standard("sky"), {**standard("sea"), "chosen": ""}, standard("sun")]
    records += [{**standard("grass"), "rejected": standard("grass")["chosen"]}]
    with pytest.raises(DataFileError, match=r"^data: row 1: .*\(1 more bad record, e\.g\. row 3: "):
        encode_pairs(records, PairEncoder(tok))


def test_conversational_pairs_need_a_chat_template(tok):
    bare = make_tiny_chat_tokenizer("chatml")
    bare.chat_template = None
    assert PairEncoder(bare).encode(standard("sky"), "standard") is not None  # text needs none
    with pytest.raises(ChatTemplateError, match=r"TrainingArgs\.chat_template"):
        PairEncoder(bare).encode(conversational("sky"), "conversational")
    with pytest.raises(ChatTemplateError, match="fast tokenizer"):
        PairEncoder(object())
