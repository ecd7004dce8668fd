"""Data where Ray users keep it (issue 70, part 3): a ``ray.data.Dataset`` as ``data``.

Real Ray (the session's) and moto's S3-compatible server: a chat Dataset that Ray Data reads from
a bucket trains, encoded by Ray Data's own tasks into a token cache equal to the one the same
records give from a file; another Dataset over the same object reuses that cache and continues
the run's name, while a Dataset that reads something else is refused under it; a bad record
fails the run before anything is written, naming its row; DPO pairs and GRPO prompts from a
Dataset equal their files' too.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from data_support import encode_here
from preference_support import conversational
from s3_server import S3Server

from ray_trainer import TrainingArgs, run_training
from ray_trainer._data.cache import TokenCache
from ray_trainer._data.sources import DataFileError
from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model
from ray_trainer._driver import ray_dataset as ray_dataset_module
from ray_trainer._driver.checks.inputs import check_storage
from ray_trainer._driver.data import plan_data, prepare_data
from ray_trainer._driver.run_fingerprint import ray_dataset_digest
from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import locate

BUCKET = "ray-data"
RUN = "from-ray-data"


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """The bucket: one Parquet object of chat records (and the same records as a local JSONL),
    read through a pyarrow S3 filesystem that names the server (it travels to Ray's tasks)."""
    import pyarrow as pa
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("ray-data")
    records = [{"messages": m} for m in chat_conversations(48, seed=2)]
    jsonl = root / "train.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records))
    pq.write_table(pa.Table.from_pylist(records), root / "train.parquet", row_group_size=16)
    pq.write_table(pa.Table.from_pylist(records[:40]), root / "fewer.parquet")
    server = S3Server()
    server.start()
    try:
        client = server.client()
        client.create_bucket(Bucket=BUCKET)
        client.upload_file(str(root / "train.parquet"), BUCKET, "chat/train.parquet")
        env = server.env()
        fs = pafs.S3FileSystem(
            endpoint_override=server.endpoint, scheme="http", region=env["AWS_DEFAULT_REGION"],
            access_key=env["AWS_ACCESS_KEY_ID"], secret_key=env["AWS_SECRET_ACCESS_KEY"],
        )  # fmt: skip
        model = str(make_tiny_chat_model(root / "model", style="chatml"))
        yield SimpleNamespace(root=root, server=server, fs=fs, model=model, jsonl=str(jsonl))
    finally:
        server.stop()


def _read(bucket, key: str = "chat/train.parquet"):
    import ray.data

    return ray.data.read_parquet(f"{BUCKET}/{key}", filesystem=bucket.fs)


def _fields(bucket, **overrides):
    fields = dict(
        model=bucket.model, max_length=128, packing=True, max_tokens_per_batch=256, batch_size=4,
        num_workers=1, max_steps=2, learning_rate=1e-3, warmup_steps=0,
        storage_path=str(bucket.root / "storage"), run_name=RUN,
    )  # fmt: skip
    fields.update(overrides)
    return fields


def _samples(cache: TokenCache) -> list[tuple[list[int], list[int]]]:
    return [tuple(a.tolist() for a in cache.sample(i)) for i in range(len(cache))]


@pytest.fixture(scope="module")
def trained(ray_session, bucket):
    """One short run whose data is the bucket's Dataset and whose validation data is one in
    memory (its checkpoint names the run)."""
    import ray.data

    held_out = ray.data.from_items([{"messages": m} for m in chat_conversations(6, seed=9)])
    return run_training(**_fields(bucket, data=_read(bucket), val_data=held_out,
                                  eval_every_steps=2))  # fmt: skip


def test_a_dataset_from_a_bucket_trains_on_the_cache_its_records_give_as_a_file(bucket, trained):
    assert trained.global_step == 2 and trained.checkpoint_path is not None
    assert trained.metrics["val_loss"] > 0  # val_data: a Ray Dataset too
    caches = locate(str(bucket.root / "storage/.ray_trainer/data-cache"))
    (folder,) = [f for f in caches.listdir() if TokenCache(caches.child(f)).meta["samples"] == 48]
    from_ray = TokenCache(locate(str(bucket.root / "storage/.ray_trainer/data-cache" / folder)))
    args = TrainingArgs(model=bucket.model, data=bucket.jsonl, max_length=128,
                        storage_path=str(bucket.root / "files"))  # fmt: skip
    from_file = TokenCache(locate(encode_here(args)["data"]))
    assert len(from_ray) == len(from_file) == 48
    assert _samples(from_ray) == _samples(from_file)
    assert np.array_equal(from_ray.lengths, from_file.lengths)
    assert np.array_equal(from_ray.targets, from_file.targets)
    assert from_ray.meta["source"] == "data (a ray.data.Dataset)"
    assert all(p.get("name") for p in from_ray.meta["pieces"])  # written by Ray Data's tasks


def test_the_same_dataset_reuses_the_cache_and_the_name_another_is_refused(bucket, trained):
    same = TrainingArgs(**_fields(bucket, data=_read(bucket)))  # a new Dataset, the same object
    plan = plan_data(same)["data"]
    assert plan.meta is not None and plan.source.stable  # a hit: nothing read but one record
    check_storage(same)  # the run continues under its name
    for other in (_read(bucket).limit(40), _read(bucket).map_batches(lambda b: b)):
        with pytest.raises(TrainingArgsError, match=f"run_name '{RUN}'.*different run"):
            check_storage(TrainingArgs(**_fields(bucket, data=other)))
    # A changed object under the same key is another dataset: its size and time are read.
    client = bucket.server.client()
    client.upload_file(str(bucket.root / "train.parquet"), BUCKET, "chat/changing.parquet")
    before = ray_dataset_digest(_read(bucket, "chat/changing.parquet"))
    client.upload_file(str(bucket.root / "fewer.parquet"), BUCKET, "chat/changing.parquet")
    after = ray_dataset_digest(_read(bucket, "chat/changing.parquet"))
    assert before[1] and before[0] != after[0]
    # Blocks in memory by their content; a plan that reads neither files nor blocks, by its
    # parameters: not covered (its cache is built again at each start).
    import ray.data

    items = [ray_dataset_digest(ray.data.from_items([{"text": t}])) for t in ("a", "a", "b")]
    assert items[0] == items[1] != items[2] and items[0][1]
    ranges = [ray_dataset_digest(ray.data.range(n)) for n in (4, 4, 5)]
    assert ranges[0] == ranges[1] != ranges[2] and not ranges[0][1]


def test_a_bad_record_fails_the_run_by_its_row_before_anything_is_written(
    ray_session, bucket, monkeypatch
):
    import ray.data

    records = [{"messages": m} for m in chat_conversations(12, seed=4)]
    records[5]["messages"][0]["role"] = "robot"
    monkeypatch.setattr(ray_dataset_module, "PIECE_RECORDS", 4)  # rows 0-3 encode first
    storage = bucket.root / "bad-storage"
    with pytest.raises(DataFileError, match=r"data \(a ray.data.Dataset\)\[5\]: .*'robot'"):
        run_training(**_fields(bucket, data=ray.data.from_items(records), run_name="bad",
                               storage_path=str(storage)))  # fmt: skip
    cache = storage / ".ray_trainer" / "data-cache"
    assert not cache.exists() or os.listdir(cache) == []  # rows 0-3's piece deleted with it
    run = storage / "bad"
    assert not run.exists() or not {"run.json"} & set(os.listdir(run))
    blank = TrainingArgs(**_fields(bucket, data=ray.data.from_items([{"text": ""}] * 3),
                                   storage_path=str(storage)))  # fmt: skip
    with pytest.raises(DataFileError, match=r"all 3 record\(s\) have empty text"):
        prepare_data(plan_data(blank), blank)
    assert not cache.exists() or os.listdir(cache) == []  # its piece deleted with it too
    empty = ray.data.from_items(records).filter(lambda r: False)
    with pytest.raises(DataFileError, match=r"data \(a ray.data.Dataset\) holds no records"):
        plan_data(TrainingArgs(**_fields(bucket, data=empty, storage_path=str(storage))))


def test_dpo_pairs_and_grpo_prompts_from_a_dataset_equal_their_files(ray_session, bucket, tmp_path):
    import ray.data

    pairs = [conversational(t) for t in ("sky", "sea", "sun", "moon", "snow")]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in pairs))
    dpo = dict(model=bucket.model, objective="dpo", max_length=96)
    from_file = TokenCache(
        locate(
            encode_here(TrainingArgs(**dpo, data=str(path), storage_path=str(tmp_path / "f")))[
                "data"
            ]
        )
    )
    args = TrainingArgs(**dpo, data=ray.data.from_items(pairs), storage_path=str(tmp_path / "r"))
    plans = plan_data(args)
    assert plans["data"].settings.pair_format == "conversational"
    from_ray = TokenCache(locate(prepare_data(plans, args)["data"]))
    assert _samples(from_ray) == _samples(from_file) and from_ray.meta["pairs"] == 5

    prompts = [{"prompt": [{"role": "user", "content": f"Name {i}."}], "answer": str(i)}
               for i in range(6)]  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in prompts))
    grpo = dict(model=bucket.model, objective="grpo", reward_fns=[_reward], max_length=64,
                grpo={"max_completion_length": 16}, storage_path=str(tmp_path / "g"))  # fmt: skip
    expected = plan_data(TrainingArgs(**grpo, data=str(path)))["data"].prompts
    found = plan_data(TrainingArgs(**grpo, data=ray.data.from_items(prompts)))["data"].prompts
    assert found == expected and [p.columns for p in found] == [
        {"answer": str(i)} for i in range(6)
    ]


def _reward(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)
