"""Preference pairs through the token cache (issue 35): each pair becomes two consecutive samples
(chosen at 2i, rejected at 2i + 1) with the very ids `PairEncoder` makes, from JSONL, Parquet and
a ``datasets.Dataset``; pairs whose prompt fills max_length are left out and named; and what DPO
cannot train on (or SFT should not) is refused before Ray starts, with the file and the row.

No Ray: the preparation tasks' own function runs in this process (``data_support.encode_here``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from data_support import encode_here
from preference_support import MAKE, assistant, conversational, standard, user

from ray_trainer import TrainingArgs
from ray_trainer._data import records as records_module
from ray_trainer._data.cache import TokenCache
from ray_trainer._data.preference import PairEncoder
from ray_trainer._data.sources import DataFileError, read_piece
from ray_trainer._demo.chat import make_tiny_chat_model
from ray_trainer._driver.data import fingerprint, plan_data, prepare_data
from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import locate

THINGS = ("sky", "grass", "sea", "sun", "moon")
MAKERS = MAKE


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _args(tmp_path, model, data, **kw):
    kw.setdefault("objective", "dpo")
    kw.setdefault("max_length", 96)
    return TrainingArgs(model=model, data=data, storage_path=str(tmp_path / "storage"), **kw)


def _expected(model, records, fmt, max_length):
    from transformers import AutoTokenizer

    encoder = PairEncoder(AutoTokenizer.from_pretrained(model), max_length=max_length)
    pairs = [encoder.encode(r, fmt) for r in records]
    return [seq for pair in pairs if pair is not None for seq in pair.sequences()]


def _cache_samples(args, field="data"):
    cache = TokenCache(locate(encode_here(args)[field], args.storage_filesystem))
    samples = [tuple(a.tolist() for a in cache.sample(i)) for i in range(len(cache))]
    return cache, samples


def _check_cache(cache, samples, expected, fmt, pairs):
    assert samples == [tuple(s) for s in expected]  # chosen at 2i, rejected at 2i + 1
    assert cache.meta["format"] == "preference" and cache.meta["pair_format"] == fmt
    assert cache.meta["pairs"] == pairs and cache.meta["samples"] == 2 * pairs
    assert all(p["samples"] % 2 == 0 for p in cache.meta["pieces"])  # no pair straddles pieces
    scored = [sum(label != -100 for label in labels[1:]) for _, labels in expected]
    assert cache.targets.tolist() == scored


@pytest.mark.parametrize("fmt", list(MAKERS))
def test_each_format_from_jsonl_is_two_samples_per_pair(tmp_path, model, monkeypatch, fmt):
    monkeypatch.setattr(records_module, "PIECE_RECORDS", 2)  # 5 pairs: pieces of 2, 2, 1
    records = [MAKERS[fmt](t) for t in THINGS]
    args = _args(tmp_path, model, _jsonl(tmp_path / "prefs.jsonl", records))
    plan = plan_data(args)["data"]
    assert [p.records for p in plan.source.pieces] == [2, 2, 1]
    # Standard pairs are tokenized as text: they need no chat template; conversations do.
    assert (plan.settings.chat_template is None) == (fmt == "standard")
    assert plan.settings.pair_format == fmt and plan.settings.objective == "dpo"
    cache, samples = _cache_samples(args)
    _check_cache(cache, samples, _expected(model, records, fmt, 96), fmt, len(records))
    assert cache.meta["records"] == len(records) and len(cache.meta["pieces"]) == 3


def _with_nulls():
    """Conversational pairs whose messages have keys others lack: Arrow fills them with None."""
    records = [conversational(t) for t in THINGS]
    records[0]["prompt"][1]["name"] = "ann"
    records[1]["chosen"][0]["name"] = "bot"
    records[2]["rejected"][0]["name"] = "bot"
    return records


@pytest.mark.parametrize("kind", ["parquet", "dataset"])
def test_conversational_pairs_from_parquet_and_a_dataset_read_back_as_written(
    tmp_path, model, kind
):
    import pyarrow as pa

    records = _with_nulls()
    if kind == "parquet":
        import pyarrow.parquet as pq

        data = str(tmp_path / "prefs.parquet")
        pq.write_table(pa.Table.from_pylist(records), data)
    else:
        import datasets

        data = datasets.Dataset.from_list(records)
    args = _args(tmp_path, model, data)
    source = plan_data(args)["data"].source
    assert source.fmt == "preference" and source.pair_format == "conversational"
    read = [r for piece in source.pieces for _, r in read_piece(source, piece)]
    assert read == records  # no None where a record had no key
    cache, samples = _cache_samples(args)
    expected = _expected(model, records, "conversational", 96)
    _check_cache(cache, samples, expected, "conversational", len(records))


def test_a_pair_whose_prompt_fills_max_length_is_dropped_counted_and_named(tmp_path, model, caplog):
    long = standard("sea")
    long["prompt"] = "Why is the sea so very wide and deep? " * 12 + "\n"
    records = [standard("sky"), long, standard("sun")]
    path = _jsonl(tmp_path / "prefs.jsonl", records)
    args = _args(tmp_path, model, path, max_length=40)
    cache, samples = _cache_samples(args)
    expected = _expected(model, records, "standard", 40)
    assert len(expected) == 4  # the long prompt's pair is the one left out
    _check_cache(cache, samples, expected, "standard", 2)
    assert cache.meta["records"] == 3 and cache.meta["dropped"] == 1
    assert cache.meta["dropped_where"] == [f"{path}:2"]
    plans = plan_data(args)  # complete now: its meta, nothing to encode, the report only
    with caplog.at_level("WARNING", logger="ray_trainer"):
        prepare_data(plans, args)
    assert (
        "data: 1 of 3 pair(s) have a prompt that alone fills max_length=40; they are left out "
        f"({path}:2); raise max_length to keep them"
    ) in caplog.text

    _jsonl(tmp_path / "prefs.jsonl", [long])
    encode_here(args)
    with pytest.raises(DataFileError, match=r"none of the 1 pair\(s\) .* raise max_length"):
        prepare_data(plan_data(args), args)


def test_a_truncated_answer_keeps_the_start_and_is_counted(tmp_path, model):
    record = standard("sky")
    record["chosen"] = "The sky is blue, " * 20
    args = _args(tmp_path, model, _jsonl(tmp_path / "prefs.jsonl", [record]), max_length=30)
    cache, samples = _cache_samples(args)
    assert cache.meta["truncated"] == 1 and len(samples[0][0]) == 30
    _check_cache(cache, samples, _expected(model, [record], "standard", 30), "standard", 1)


def test_formats_that_mix_in_one_file_are_refused_with_the_row(tmp_path, model):
    path = _jsonl(tmp_path / "mixed.jsonl", [standard("sky"), conversational("sea")])
    with pytest.raises(DataFileError) as info:
        plan_data(_args(tmp_path, model, path))
    message = str(info.value)
    assert message.startswith(f"data: {path}:2: a pair in the 'conversational' format"), message
    assert f"but {path}:1 is in the 'standard' one" in message


def test_files_of_one_source_in_two_formats_are_refused(tmp_path, model):
    (tmp_path / "d").mkdir()
    a = _jsonl(tmp_path / "d" / "a.jsonl", [standard("sky")])
    b = _jsonl(tmp_path / "d" / "b.jsonl", [conversational("sea")])
    with pytest.raises(DataFileError, match=rf"^data: {b}:1: .* but {a}:1 is in the 'standard'"):
        plan_data(_args(tmp_path, model, str(tmp_path / "d")))


def test_bad_pairs_are_named_with_file_and_row_and_counted(tmp_path, model):
    empty = {**standard("sea"), "chosen": "  "}
    same = {**standard("sun"), "rejected": standard("sun")["chosen"]}
    wrong_role = conversational("sky")
    wrong_role["chosen"] = [user("blue")]
    path = _jsonl(tmp_path / "prefs.jsonl", [standard("sky"), empty, same])
    with pytest.raises(DataFileError) as info:
        plan_data(_args(tmp_path, model, path))
    message = str(info.value)
    assert message.startswith(f"data: {path}:2: 'chosen' is empty"), message
    assert f"(1 more bad record, e.g. {path}:3: 'chosen' and 'rejected' are the same" in message

    path = _jsonl(tmp_path / "conv.jsonl", [conversational("sea"), wrong_role])
    with pytest.raises(DataFileError, match=rf"^data: {path}:2: chosen\[0\] has role 'user'"):
        plan_data(_args(tmp_path, model, path))


def test_dpo_refuses_data_that_is_not_pairs(tmp_path, model):
    chat = {"messages": [user("Hi?"), assistant("Hello.")]}
    path = _jsonl(tmp_path / "chat.jsonl", [chat])
    with pytest.raises(TrainingArgsError) as info:
        plan_data(_args(tmp_path, model, path))
    assert str(info.value).startswith(
        f"data: {path} holds 'messages' records; objective='dpo' trains on preference pairs"
    )
    pairs = _jsonl(tmp_path / "prefs.jsonl", [standard("sky")])
    with pytest.raises(TrainingArgsError, match=rf"^val_data: {path} holds 'messages' records"):
        plan_data(_args(tmp_path, model, pairs, val_data=path))

    import torch

    dataset = torch.utils.data.TensorDataset(torch.zeros(2, 3))
    with pytest.raises(
        TrainingArgsError, match="objective='dpo' reads preference pairs from files"
    ):
        plan_data(_args(tmp_path, model, dataset))


def test_sft_refuses_pairs_and_passes_a_torch_dataset_through(tmp_path, model):
    pairs = _jsonl(tmp_path / "prefs.jsonl", [standard("sky")])
    with pytest.raises(TrainingArgsError) as info:
        plan_data(_args(tmp_path, model, pairs, objective="sft"))
    text = str(info.value)
    assert text.startswith(f"data: {pairs} holds preference pairs (chosen/rejected); ")
    assert "objective='sft' trains on 'messages', prompt/completion or text records" in text
    assert "set objective='dpo' to train on them" in text
    import torch

    dataset = torch.utils.data.TensorDataset(torch.zeros(2, 3))
    assert plan_data(_args(tmp_path, model, dataset, objective="sft")) == {}


def test_sft_and_dpo_caches_of_the_same_records_never_share_a_fingerprint(tmp_path, model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    path = _jsonl(tmp_path / "prefs.jsonl", [conversational(t) for t in THINGS])
    plan = plan_data(_args(tmp_path, model, path))["data"]
    assert plan.fingerprint == fingerprint(plan.source, plan.settings, tokenizer)
    sft = dataclasses.replace(plan.settings, objective="sft", pair_format=None)
    other = dataclasses.replace(plan.settings, pair_format="implicit_prompt")
    prints = {fingerprint(plan.source, s, tokenizer) for s in (plan.settings, sft, other)}
    assert len(prints) == 3
    # A file of the same conversations as SFT records lands in another cache folder too.
    chat = [{"messages": r["prompt"] + r["chosen"]} for r in map(conversational, THINGS)]
    sft_plan = plan_data(
        _args(tmp_path, model, _jsonl(tmp_path / "chat.jsonl", chat), objective="sft")
    )["data"]
    assert sft_plan.cache.name != plan.cache.name
