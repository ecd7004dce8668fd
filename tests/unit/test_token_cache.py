"""The run's token cache: written piece by piece, completed by its meta, read sample by sample
from a local disk (memory-mapped) or a bucket (ranged reads, never downloaded whole)."""

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
    location = cache_location(root, "abc123", fs)
    pieces = [_samples(0, 7), _samples(1, 1), _samples(2, 12)]
    _write(location, pieces)
    cache = TokenCache(location.name, fs)
    assert cache.location.is_local == (where == "local")
    flat = [s for piece in pieces for s in piece]
    assert len(cache) == len(flat) == int(read_meta(location)["samples"])
    for i, (ids, labels) in enumerate(flat):
        got_ids, got_labels = cache.sample(i)
        assert got_ids.tolist() == ids and got_labels.tolist() == labels
    assert [a.tolist() for a, _ in cache.samples([19, 3, 7])] == [flat[i][0] for i in (19, 3, 7)]
    assert cache.lengths.tolist() == [len(i) for i, _ in flat]


def test_a_cache_without_its_meta_is_not_opened(tmp_path):
    location = cache_location(str(tmp_path), "partial")
    write_piece(location, 0, _samples(0, 3))
    with pytest.raises(FileNotFoundError, match="no complete token cache"):
        TokenCache(location.name)
