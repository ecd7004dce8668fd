"""A Ray Dataset's batches through the pipeline (issue 70, part 3): what each Ray Data task does
with its batch (`encode_batch`, `encode_prompt_batch`), run here without Ray, gives the token
cache (or the prompts) that the same records give from a JSONL file, for every objective's
format: text and prompt/completion, chat messages, DPO pairs, GRPO prompts. A bad record is
named by its row in the batch, and its batch writes nothing.

No Ray: the batches are the records as a pyarrow Table (what ``map_batches`` hands a task), cut
into slices the way Ray Data may cut them, and their results are placed in order as the driver
places them (``_driver/ray_dataset.py``); the pass itself runs in tests/integration.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pyarrow as pa
import pytest
from data_support import encode_here
from preference_support import conversational, standard

from ray_trainer import TrainingArgs
from ray_trainer._data.batches import encode_batch, encode_prompt_batch
from ray_trainer._data.cache import TokenCache, cache_location
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model
from ray_trainer._driver.data import finish_cache, plan_data
from ray_trainer._storage import locate

THINGS = ("sky", "grass", "sea", "sun", "moon", "snow", "fire")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny", style="chatml"))


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _table(records: list[dict]) -> pa.Table:
    """The records as one table, every key a column (``from_pylist`` takes the first row's)."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    return pa.table({k: [r.get(k) for r in records] for k in keys})


def _samples(cache: TokenCache) -> list[tuple[list[int], list[int]]]:
    return [tuple(a.tolist() for a in cache.sample(i)) for i in range(len(cache))]


def _batched(tmp_path, args, records, size) -> TokenCache:
    """The cache as the Ray Data pass builds it: the records' table in batches of `size`, each
    encoded by `encode_batch` into a piece named by its content, placed in order, completed."""
    plan = plan_data(args)["data"]
    location = cache_location(locate(str(tmp_path / "ray-storage")), plan.fingerprint)
    plan = dataclasses.replace(plan, cache=location, meta=None)
    table = _table(records)
    results = []
    for start in range(0, len(records), size):
        batch = encode_batch(
            table.slice(start, size), plan.source, plan.settings, location.name, None
        )
        assert batch.errors == [] and batch.records == min(size, len(records) - start)
        results.append(dataclasses.replace(batch.piece, index=len(results)))
    finish_cache(plan, args, results, 0.0)
    return TokenCache(location)


def _compare(tmp_path, args_of, records, size=3):
    from_file = TokenCache(
        locate(encode_here(args_of(_jsonl(tmp_path / "d.jsonl", records)))["data"])
    )
    batched = _batched(tmp_path, args_of(_jsonl(tmp_path / "d.jsonl", records)), records, size)
    assert _samples(batched) == _samples(from_file) and len(batched) > 0
    assert np.array_equal(batched.lengths, from_file.lengths)
    assert np.array_equal(batched.targets, from_file.targets)
    pieces = batched.meta["pieces"]
    assert len(pieces) == -(-len(records) // size) and all(len(p["name"]) == 20 for p in pieces)
    return batched, from_file


def test_text_and_prompt_completion_records_encode_as_from_a_file(tmp_path, model):
    records = [{"text": f"The {t} is bright today."} for t in THINGS]
    records[2] = {"prompt": "What is the sea? ", "completion": "Wide."}  # the formats mix
    args = lambda data: TrainingArgs(  # noqa: E731
        model=model, data=data, max_length=6, storage_path=str(tmp_path / "storage")
    )
    batched, _ = _compare(tmp_path, args, records)
    assert batched.meta["truncated"] >= 1  # max_length cut some, the same way


def test_chat_messages_encode_as_from_a_file_with_the_template_and_mask(tmp_path, model):
    records = [{"messages": m} for m in chat_conversations(10, seed=3)]
    records[4]["messages"][0]["name"] = "ann"  # a key the others lack: Arrow fills in None
    args = lambda data: TrainingArgs(  # noqa: E731
        model=model, data=data, max_length=96, storage_path=str(tmp_path / "storage"),
        train_on="last_assistant",
    )  # fmt: skip
    batched, _ = _compare(tmp_path, args, records, size=4)
    assert batched.meta["format"] == "messages"


@pytest.mark.parametrize("make", [standard, conversational], ids=["standard", "conversational"])
def test_dpo_pairs_encode_as_from_a_file_two_samples_a_pair(tmp_path, model, make):
    records = [make(t) for t in THINGS]
    args = lambda data: TrainingArgs(  # noqa: E731
        model=model, data=data, max_length=96, objective="dpo",
        storage_path=str(tmp_path / "storage"),
    )  # fmt: skip
    batched, _ = _compare(tmp_path, args, records)
    assert batched.meta["pairs"] == len(records) and len(batched) == 2 * len(records)
    assert all(p["samples"] % 2 == 0 for p in batched.meta["pieces"])


def test_grpo_prompts_tokenize_as_from_a_file_columns_kept(tmp_path, model):
    records = [
        {"prompt": [{"role": "user", "content": f"What color is the {t}?"}], "answer": t}
        for t in THINGS
    ]
    args = TrainingArgs(
        model=model, data=_jsonl(tmp_path / "p.jsonl", records), objective="grpo",
        reward_fns=[_reward], max_length=64,
        grpo={"max_completion_length": 16}, storage_path=str(tmp_path / "storage"),
    )  # fmt: skip
    plan = plan_data(args)["data"]
    from ray_trainer._data.prompts import PromptEncoder

    encoder = PromptEncoder(
        plan.settings.model_spec.data_tokenizer(), max_length=64, max_completion_length=16
    )
    table = _table(records)
    prompts = [
        p
        for start in (0, 4)
        for p in encode_prompt_batch(table.slice(start, 4), plan.source, encoder).prompts
    ]
    assert prompts == plan.prompts and [p.columns for p in prompts] == [
        {"answer": t} for t in THINGS
    ]


def _reward(prompts, completions, completion_ids, trainer_state, answer):
    return [0.0] * len(completions)


def test_a_bad_record_is_named_by_its_row_and_its_batch_writes_nothing(tmp_path, model):
    records = [{"messages": m} for m in chat_conversations(6, seed=1)]
    args = TrainingArgs(
        model=model, data=_jsonl(tmp_path / "d.jsonl", records), max_length=96,
        storage_path=str(tmp_path / "storage"),
    )  # fmt: skip
    plan = plan_data(args)["data"]
    records[1]["messages"][0]["role"] = "robot"
    records[4]["messages"] = []
    folder = cache_location(locate(str(tmp_path / "ray")), "x")
    result = encode_batch(_table(records), plan.source, plan.settings, folder.name, None)
    assert result.piece is None and result.records == 6
    assert [row for row, _ in result.errors] == [1, 4]
    assert "robot" in result.errors[0][1] and "messages" in result.errors[1][1]
    assert not folder.exists()  # nothing written for a batch with a bad record


def test_pairs_in_another_format_than_the_first_record_are_refused_by_row(tmp_path, model):
    records = [conversational(t) for t in THINGS[:3]]
    args = TrainingArgs(
        model=model, data=_jsonl(tmp_path / "d.jsonl", records), objective="dpo",
        max_length=96, storage_path=str(tmp_path / "storage"),
    )  # fmt: skip
    plan = plan_data(args)["data"]
    source = dataclasses.replace(plan.source, name="data (a ray.data.Dataset)")
    folder = cache_location(locate(str(tmp_path / "ray")), "x")
    batch = _table([standard("sun"), standard("moon")])
    result = encode_batch(batch, source, plan.settings, folder.name, None)
    assert [row for row, _ in result.errors] == [0, 1]
    assert "'conversational' one" in result.errors[0][1]
    assert "data (a ray.data.Dataset)[0]" in result.errors[0][1]  # the source's first record


def test_a_batch_of_empty_texts_says_it_has_nothing_to_train_on(tmp_path, model):
    args = TrainingArgs(
        model=model, data=_jsonl(tmp_path / "d.jsonl", [{"text": "a"}]), max_length=16,
        storage_path=str(tmp_path / "storage"),
    )  # fmt: skip
    plan = plan_data(args)["data"]
    folder = cache_location(locate(str(tmp_path / "ray")), "x")
    empty = encode_batch(
        pa.table({"text": ["", ""]}), plan.source, plan.settings, folder.name, None
    )
    some = encode_batch(
        pa.table({"text": ["", "b"]}), plan.source, plan.settings, folder.name, None
    )
    assert (empty.some_text, some.some_text) == (False, True)
