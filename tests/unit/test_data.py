"""Plain text data: the byte tokenizer, text and prompt/completion records encoded, and their
batches collated for the model. (Bad records, named by file and line: `test_data_sources.py`.)"""

from __future__ import annotations

import pytest
import torch

from ray_trainer._data.encode import ByteTokenizer, Encoder
from ray_trainer._demo.model import TinyCausalLM, TinyLMConfig
from ray_trainer._worker.step.micro_batches import collate_batch

# ---- ByteTokenizer -------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_unicode_and_has_distinct_specials():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ☃", add_eos=True)
    assert ids[-1] == tok.eos_id == 257 and tok.pad_id == 256 and tok.vocab_size == 258
    assert max(ids[:-1]) < 256
    assert tok.decode(ids) == "héllo ☃"
    assert tok.decode([104, 105, tok.pad_id], skip_special_tokens=False) == "hi<pad>"


# ---- plain text records, encoded ----------------------------------------------------------


def test_text_records_take_loss_on_every_token_and_end_with_eos():
    tok = ByteTokenizer()
    enc = Encoder(tok, max_length=64)
    assert enc.pad_id == tok.pad_id and enc.eos_id == tok.eos_id
    out = enc.encode({"text": "hello world"}, "text")
    assert out.input_ids == tok.encode("hello world", add_eos=True)
    assert out.labels == out.input_ids and out.labels is not out.input_ids
    assert tok.decode(enc.encode({"text": "héllo ☃"}, "text").input_ids) == "héllo ☃"


def test_prompt_completion_takes_loss_on_completion_only():
    out = Encoder(ByteTokenizer(), max_length=64).encode(
        {"prompt": "Q: 2+2?", "completion": " 4"}, "prompt_completion"
    )
    tok = ByteTokenizer()
    n_prompt = len("Q: 2+2?")
    assert out.input_ids == tok.encode("Q: 2+2? 4", add_eos=True)
    assert out.labels[:n_prompt] == [-100] * n_prompt
    assert out.labels[n_prompt:] == tok.encode(" 4", add_eos=True)


def test_custom_text_field_and_truncation():
    out = Encoder(ByteTokenizer(), max_length=10, text_field="body").encode(
        {"body": "x" * 100}, "text"
    )
    assert len(out.input_ids) == len(out.labels) == 10 and out.truncated
    assert ByteTokenizer().eos_id not in out.input_ids


def test_a_custom_tokenizer_with_the_char_interface_is_used():
    from ray_trainer._demo.addition import CharTokenizer

    tok = CharTokenizer()
    enc = Encoder(tok, max_length=16)
    out = enc.encode({"prompt": "1+2=", "completion": "3"}, "prompt_completion")
    assert out.input_ids == tok.encode("1+2=3", add_eos=True)
    assert enc.pad_id == tok.pad_id


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


def test_encoded_batches_train_the_tiny_model():
    enc = Encoder(ByteTokenizer(), max_length=32)
    items = []
    for text in ("hello world", "héllo ☃"):
        out = enc.encode({"text": text}, "text")
        items.append({"input_ids": out.input_ids, "labels": out.labels})
    batch = collate_batch(items, enc.pad_id)
    width = max(len("hello world"), len("héllo ☃".encode())) + 1  # + EOS
    assert batch["input_ids"].shape == (2, width)
    assert batch["attention_mask"].sum().item() == sum(len(it["input_ids"]) for it in items)
    torch.manual_seed(0)
    model = TinyCausalLM(TinyLMConfig(vocab_size=258, max_len=32, d_model=32, n_heads=2))
    loss = model(**batch).loss
    assert torch.isfinite(loss)
    loss.backward()
