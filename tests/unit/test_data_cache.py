"""The run's token cache: written piece by piece, completed by its meta, read sample by sample
from a local disk (memory-mapped) or a bucket (ranged reads, never downloaded whole); records
that keep no label left out of it, named, and reported by the driver."""

from __future__ import annotations

import numpy as np
import pyarrow.fs as pafs
import pytest

from ray_trainer._data.cache import (
    PieceResult,
    TokenCache,
    cache_location,
    read_meta,
    write_meta,
    write_piece,
)
from ray_trainer._storage import locate


def _samples(seed, n):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        k = int(rng.integers(2, 30))
        ids = rng.integers(0, 50_000, k).tolist()
        labels = [t if rng.random() < 0.6 else -100 for t in ids]
        out.append((ids, labels))
    return out


def _result(index, samples):
    lengths = np.array([len(i) for i, _ in samples], dtype=np.int32)
    targets = np.array([sum(x != -100 for x in lab[1:]) for _, lab in samples], dtype=np.int32)
    return PieceResult(index, lengths, targets, len(samples), 0, 0, [])


def _write(location, pieces):
    for i, samples in enumerate(pieces):
        write_piece(location, i, samples)
    assert read_meta(location) is None  # not complete before its meta
    write_meta(location, {"fingerprint": "x"}, [_result(i, s) for i, s in enumerate(pieces)])


@pytest.mark.parametrize("where", ["local", "bucket"])
def test_every_sample_reads_back_exactly(tmp_path, where):
    fs = None
    if where == "bucket":  # a filesystem that is not the local one: ranged reads
        import fsspec

        fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("memory")))
    root = "/runs" if fs else str(tmp_path)
    location = cache_location(locate(root, fs), "abc123")
    pieces = [_samples(0, 7), _samples(1, 1), _samples(2, 12)]
    _write(location, pieces)
    cache = TokenCache(location)
    assert cache.location.is_local == (where == "local")
    flat = [s for piece in pieces for s in piece]
    assert len(cache) == len(flat) == int(read_meta(location)["samples"])
    for i, (ids, labels) in enumerate(flat):
        got_ids, got_labels = cache.sample(i)
        assert got_ids.tolist() == ids and got_labels.tolist() == labels
    assert [a.tolist() for a, _ in cache.samples([19, 3, 7])] == [flat[i][0] for i in (19, 3, 7)]
    assert cache.lengths.tolist() == [len(i) for i, _ in flat]


def test_a_cache_without_its_meta_is_not_opened(tmp_path):
    location = cache_location(locate(str(tmp_path)), "partial")
    write_piece(location, 0, _samples(0, 3))
    with pytest.raises(FileNotFoundError, match="no complete token cache"):
        TokenCache(location)


def test_the_cache_and_its_reference_folders_share_one_versioned_meta(tmp_path):
    import json

    from ray_trainer import _reference

    cache = cache_location(locate(str(tmp_path)), "abc123")
    _write(cache, [_samples(0, 4)])
    reference = _reference.reference_location(cache, "key")
    assert _reference.read_meta(reference) is None  # no meta yet: partial
    _reference.write_meta(reference, [(0, 2), (2, 4)], dtype="float32")
    meta = _reference.read_meta(reference)
    assert meta == {
        "version": _reference.REFERENCE_VERSION,
        "pieces": [[0, 2], [2, 4]],
        "sequences": 4,
        "dtype": "float32",
    }
    # A folder written by another version of its format is stale: read as absent, rebuilt.
    for folder, read in ((cache, read_meta), (reference, _reference.read_meta)):
        file = folder.child("meta.json")
        body = json.loads(file.read_text())
        file.write_text(json.dumps({**body, "version": body["version"] + 1}))
        assert read(folder) is None


def test_records_with_no_label_left_are_left_out_and_named_or_refused(tmp_path, caplog):
    import json

    from data_support import encode_here

    from ray_trainer import TrainingArgs
    from ray_trainer._data.sources import DataFileError
    from ray_trainer._driver.data import plan_data, prepare_data

    long = json.dumps({"prompt": "p" * 50, "completion": "c"})  # the prompt fills max_length
    short = json.dumps({"prompt": "p", "completion": "c"})
    path = tmp_path / "d.jsonl"
    path.write_text(f"{short}\n{long}\n")
    args = TrainingArgs(data=str(path), max_length=20, storage_path=str(tmp_path / "s"))
    encode_here(args)
    plans = plan_data(args)  # the cache is complete now: its meta, nothing to encode
    assert plans["data"].meta["samples"] == 1 and plans["data"].meta["dropped"] == 1
    with caplog.at_level("WARNING", logger="ray_trainer"):
        prepare_data(plans, args)  # complete: nothing to encode, the report only
    assert "1 of 2 record(s) keep no token to learn from within max_length=20" in caplog.text
    assert f"left out ({path}:2); raise max_length" in caplog.text
    path.write_text(f"{long}\n")
    encode_here(args)
    plans = plan_data(args)
    with pytest.raises(DataFileError, match=r"none of the 1 record\(s\) .* raise max_length"):
        prepare_data(plans, args)
