"""Where a piece's records come from when the driver's node may be the only one that sees a
local file, and may offer no CPU (a head with ``CPU: 0``): the driver reads the piece, the task
on another node encodes that content (no Ray here: the task's function runs in this process,
after the file is gone).

The same on a real cluster whose head offers no CPU and whose worker nodes cannot see the file:
``tests/integration/test_multinode.py``.
"""

from __future__ import annotations

import json
import os

import pytest

from ray_trainer import TrainingArgs
from ray_trainer._data import records as records_module
from ray_trainer._data.prepare import encode_piece
from ray_trainer._data.sources import DataFile, Source, piece_content
from ray_trainer._driver.data import (
    MAX_SHIPPED_PIECES,
    pieces_in_flight,
    plan_data,
    ships_content,
)

RECORDS = [{"prompt": f"question {i}?", "completion": " answer" * i} for i in range(1, 12)]


def _source(*names):
    files = [DataFile(n, "jsonl", 10) for n in names]
    return Source("data", names[0], files, "text", ["text"])


def test_local_files_travel_from_the_driver_and_bucket_files_do_not():
    assert ships_content(_source("/home/me/train.jsonl"))
    assert ships_content(_source("/data/a.jsonl", "/data/b.jsonl"))
    assert not ships_content(_source("s3://bucket/train.jsonl"))
    assert not ships_content(_source("gs://bucket/a.jsonl", "gs://bucket/b.jsonl"))
    in_memory = Source("data", "data (a datasets.Dataset)", [], "text", ["text"], table=object())
    assert not ships_content(in_memory)  # the table goes into the object store once, whole


@pytest.mark.parametrize(
    ("ship", "cpus", "pieces", "expected"),
    [
        (True, 0.0, 50, 2),  # no CPU up yet (an autoscaler's first node): still two at a time
        (True, 6.0, 50, 6),  # one per CPU of the cluster
        (True, 1000.0, 50, MAX_SHIPPED_PIECES),  # bounded: the driver's object store holds them
        (False, 6.0, 50, 50),  # tasks that read their own piece: all at once
        (False, 6.0, 0, 1),
    ],
)
def test_shipped_pieces_in_flight_are_bounded(ship, cpus, pieces, expected):
    assert pieces_in_flight(ship, cpus, pieces) == expected


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_piece_read_on_the_driver_is_encoded_where_the_file_does_not_exist(
    tmp_path, monkeypatch, kind
):
    monkeypatch.setattr(records_module, "PIECE_RECORDS", 4)
    path = tmp_path / f"train.{kind}"
    if kind == "jsonl":  # with a byte-order mark, as some editors write it
        path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in RECORDS).encode())
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(RECORDS), path)
    args = TrainingArgs(data=str(path), max_length=64, storage_path=str(tmp_path / "storage"))
    plan = plan_data(args)["data"]
    source, cache = plan.source, plan.cache.name
    assert ships_content(source) and [p.records for p in source.pieces] == [4, 4, 3]

    def encode(index, content=None):  # the preparation task's body, as Ray runs it
        return encode_piece(
            source, index, source.pieces[index], plan.settings, cache, None, content
        )

    from_file = [encode(i) for i in range(3)]
    contents = [piece_content(p) for p in source.pieces]  # the driver's reads
    os.rename(path, tmp_path / "elsewhere")  # the task's node does not see the file
    shipped = [encode(i, content) for i, content in enumerate(contents)]
    for a, b in zip(from_file, shipped, strict=True):
        assert a.records == b.records and a.dropped == b.dropped
        assert a.lengths.tolist() == b.lengths.tolist() and a.targets.tolist() == b.targets.tolist()
    assert sum(r.records for r in shipped) == len(RECORDS)
    with pytest.raises(FileNotFoundError):
        encode(0)  # without the content, the task would need the file
