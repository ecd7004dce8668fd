"""JSONL data: validation errors, tokenization, label masking and batching."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DataLoader

from ray_trainer._data import (
    ByteTokenizer,
    DataFileError,
    JsonlTextDataset,
    collate_batch,
    validate_jsonl,
)
from ray_trainer._demo.model import TinyCausalLM, TinyLMConfig


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture
def text_file(tmp_path):
    return write_lines(
        tmp_path / "data.jsonl",
        [json.dumps({"text": "hello world"}), "", json.dumps({"text": "héllo ☃"})],
    )


# ---- ByteTokenizer -------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_and_has_distinct_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ☃", add_eos=True)
    assert ids[-1] == tok.eos_id == 257 and tok.pad_id == 256 and tok.vocab_size == 258
    assert max(ids[:-1]) < 256
    assert tok.decode(ids) == "héllo ☃"
    assert tok.decode([104, 105, tok.pad_id], skip_special_tokens=False) == "hi<pad>"


# ---- validation errors -----------------------------------------------------------------------


def test_validate_counts_records_and_skips_blank_lines(text_file):
    assert validate_jsonl(text_file) == 2
    assert validate_jsonl(str(text_file)) == 2


def test_bad_json_names_file_line_and_fix(tmp_path):
    path = write_lines(
        tmp_path / "data.jsonl",
        [json.dumps({"text": "a"}), json.dumps({"text": "b"}), '{"text": "c" "oops": 1}'],
    )
    with pytest.raises(DataFileError) as err:
        validate_jsonl(path)
    msg = str(err.value)
    assert f"{path}:3: invalid JSON (Expecting ',' delimiter: line 1 column 14)" in msg
    assert 'each line must be one JSON object like {"text": "..."}' in msg
    assert isinstance(err.value, ValueError)


def test_missing_field_names_the_field_and_the_keys_found(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl", [json.dumps({"text": "ok"}), json.dumps({"body": "x"})]
    )
    with pytest.raises(
        DataFileError, match=r"d\.jsonl:2: missing field 'text' \(found keys: 'body'\)"
    ):
        validate_jsonl(path)
    # The same file is fine when told which field holds the text... except line 1.
    with pytest.raises(DataFileError, match=r":1: missing field 'body' \(found keys: 'text'\)"):
        validate_jsonl(path, text_field="body")


def test_prompt_without_completion_names_completion(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "q"})])
    with pytest.raises(
        DataFileError, match=r":1: missing field 'completion' \(found keys: 'prompt'\)"
    ):
        validate_jsonl(path)


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("[1, 2]", "expected a JSON object, got a JSON array"),
        ('"just text"', "expected a JSON object, got a JSON string"),
        ('{"text": 3}', "field 'text' must be a string, got a JSON number"),
        ('{"prompt": "q", "completion": null}', "'completion' must be a string, got a JSON null"),
    ],
)
def test_wrong_types_are_reported(tmp_path, line, expected):
    path = write_lines(tmp_path / "d.jsonl", [line])
    with pytest.raises(DataFileError, match=expected):
        validate_jsonl(path)


def test_invalid_utf8_is_reported_with_its_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "\xff"}\n')
    with pytest.raises(DataFileError, match=r"d\.jsonl:2: not valid UTF-8"):
        validate_jsonl(path)


def test_every_line_is_checked_and_other_bad_lines_are_counted(tmp_path):
    good = json.dumps({"text": "ok"})
    path = write_lines(tmp_path / "d.jsonl", [good] * 5 + ["nope", good, "{", "[]"])
    with pytest.raises(DataFileError, match=r":6: invalid JSON .*2 more bad lines, e\.g\. .*:8:"):
        validate_jsonl(path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DataFileError, match=r"empty\.jsonl: the file is empty"):
        validate_jsonl(path)


def test_missing_file_names_the_path(tmp_path):
    path = tmp_path / "nope" / "train.jsonl"
    with pytest.raises(DataFileError, match=r"train\.jsonl: data file does not exist"):
        validate_jsonl(path)
    with pytest.raises(DataFileError, match="does not exist"):
        JsonlTextDataset(path, None, max_length=16)
    with pytest.raises(DataFileError, match="is not a file"):
        validate_jsonl(tmp_path)


def test_dataset_validates_at_construction(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"text": "a"})] * 3 + ["{bad"])
    with pytest.raises(DataFileError, match=":4: invalid JSON"):
        JsonlTextDataset(path, None, max_length=16)


# ---- dataset -------------------------------------------------------------------------------


def test_text_records_take_loss_on_every_token_and_end_with_eos(text_file):
    ds = JsonlTextDataset(text_file, tokenizer=None, max_length=64)
    tok = ByteTokenizer()
    assert len(ds) == 2 and ds.pad_id == tok.pad_id
    item = ds[0]
    assert item["input_ids"].tolist() == tok.encode("hello world", add_eos=True)
    assert torch.equal(item["labels"], item["input_ids"])
    assert tok.decode(ds[1]["input_ids"]) == "héllo ☃"


def test_prompt_completion_takes_loss_on_completion_only(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl", [json.dumps({"prompt": "Q: 2+2?", "completion": " 4"})]
    )
    item = JsonlTextDataset(path, None, max_length=64)[0]
    tok = ByteTokenizer()
    n_prompt = len("Q: 2+2?")
    assert item["input_ids"].tolist() == tok.encode("Q: 2+2? 4", add_eos=True)
    assert (item["labels"][:n_prompt] == -100).all()
    assert item["labels"][n_prompt:].tolist() == tok.encode(" 4", add_eos=True)


def test_custom_text_field_and_truncation(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"body": "x" * 100})])
    ds = JsonlTextDataset(path, None, max_length=10, text_field="body")
    assert len(ds[0]["input_ids"]) == len(ds[0]["labels"]) == 10
    assert ByteTokenizer().eos_id not in ds[0]["input_ids"].tolist()


def test_prompts_that_fill_max_length_warn_or_fail(tmp_path):
    long = json.dumps({"prompt": "p" * 50, "completion": "c"})
    short = json.dumps({"prompt": "p", "completion": "c"})
    path = write_lines(tmp_path / "d.jsonl", [short, long])
    with pytest.warns(UserWarning, match=r"1 record\(s\) \(lines 2\) have no completion token"):
        assert len(JsonlTextDataset(path, None, max_length=20)) == 2
    only_long = write_lines(tmp_path / "e.jsonl", [long])
    with pytest.raises(DataFileError, match="raise max_length"):
        JsonlTextDataset(only_long, None, max_length=20)


def test_a_custom_tokenizer_with_the_char_interface_is_used(tmp_path):
    from ray_trainer._demo.addition import CharTokenizer

    path = write_lines(tmp_path / "d.jsonl", [json.dumps({"prompt": "1+2=", "completion": "3"})])
    ds = JsonlTextDataset(path, CharTokenizer(), max_length=16)
    tok = CharTokenizer()
    assert ds[0]["input_ids"].tolist() == tok.encode("1+2=3", add_eos=True)
    assert ds.pad_id == tok.pad_id


# ---- collate ------------------------------------------------------------------------------


def test_collate_right_pads_with_pad_and_ignore_index():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "labels": torch.tensor([-100, 6, 7])},
        {"input_ids": torch.tensor([8]), "labels": torch.tensor([8])},
    ]
    batch = collate_batch(items, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert all(v.dtype == torch.long for v in batch.values())


def test_collate_keeps_item_masks_and_other_keys_and_checks_lengths():
    items = [
        {"input_ids": [1, 2], "labels": [1, 2], "attention_mask": [0, 1], "weight": 0.5},
        {"input_ids": [3], "labels": [3], "attention_mask": [1], "weight": 2.0},
    ]
    batch = collate_batch(items, pad_id=9)
    assert batch["attention_mask"].tolist() == [[0, 1], [1, 0]]
    assert batch["weight"].tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match="differ in length"):
        collate_batch([{"input_ids": [1, 2], "labels": [1]}], pad_id=0)


def test_jsonl_batches_train_the_tiny_model(text_file):
    ds = JsonlTextDataset(text_file, None, max_length=32)
    loader = DataLoader(ds, batch_size=2, collate_fn=ds.collate)
    batch = next(iter(loader))
    width = max(len("hello world"), len("héllo ☃".encode())) + 1  # + EOS
    assert batch["input_ids"].shape == (2, width)
    assert batch["attention_mask"].sum().item() == len(ds[0]["input_ids"]) + len(ds[1]["input_ids"])
    torch.manual_seed(0)
    model = TinyCausalLM(TinyLMConfig(vocab_size=258, max_len=32, d_model=32, n_heads=2))
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
