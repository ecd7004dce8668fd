"""Data sources in bounded memory: detection reads a bounded prefix (ranged reads, never the whole
file), the scan streams, what is not a regular file is refused by its type before anything opens
it, and empty or fake files are refused naming them. No Ray."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import tempfile
import threading
import tracemalloc

import pytest

from ray_trainer._data import records as records_module
from ray_trainer._data import sources
from ray_trainer._data.records import scan
from ray_trainer._data.sources import DataFileError, read_piece, resolve

GIB = 2**30


class _CountingFS:
    """The local filesystem, counting the bytes read through ranged reads; a whole-file
    stream is refused (detection must not use one)."""

    def __init__(self, fs) -> None:
        self.fs, self.read = fs, 0

    def __getattr__(self, name):
        return getattr(self.fs, name)

    def open_input_file(self, path):
        return _CountingFile(self, self.fs.open_input_file(path))

    def open_input_stream(self, path):
        raise AssertionError(f"{path}: opened as a stream (read whole) during detection")


class _CountingFile:
    def __init__(self, owner: _CountingFS, file) -> None:
        self.owner, self.file = owner, file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()

    def read_at(self, nbytes, offset):
        data = self.file.read_at(nbytes, offset)
        self.owner.read += len(data)
        return data


@pytest.fixture
def counted(monkeypatch):
    """Every file `sources` opens goes through one `_CountingFS`."""
    real = sources.locate
    holder = {}

    def locate(path, filesystem=None):
        location = real(path, filesystem)
        holder.setdefault("fs", _CountingFS(location.fs))
        return dataclasses.replace(location, fs=holder["fs"])

    monkeypatch.setattr(sources, "locate", locate)
    return lambda: holder["fs"].read


def _sparse(path, head: bytes, size: int = 10 * GIB):
    """A file of `size` bytes (sparse: no disk used past `head`) that starts with `head`."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


@pytest.mark.parametrize(
    ("name", "head", "bound"),
    [
        ("d.jsonl", b'{"text": "hello"}\n', 64 * 2**10),
        ("d.json", b'[{"prompt": "2+2=", "completion": "4"}, ', 64 * 2**10),
        ("d.jsonl", json.dumps({"text": "x" * 2**20}).encode() + b"\n", 4 * 2**20),
    ],
)
def test_detection_of_a_10_gib_file_reads_a_bounded_prefix(tmp_path, counted, name, head, bound):
    path = _sparse(tmp_path / name, head)
    source = resolve(str(path), "data")
    assert source.fmt in ("text", "prompt_completion")
    assert source.files[0].size == 10 * GIB
    assert 0 < counted() <= bound  # a record of 1 MiB: 64 KiB, then up to 256 KiB, 1 MiB, 4 MiB


def test_a_first_line_longer_than_the_bound_is_refused_after_reading_the_bound(
    tmp_path, counted, monkeypatch
):
    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 256 * 2**10)
    path = _sparse(tmp_path / "one_line.jsonl", b'{"text": "' + b"x" * 2**20)
    with pytest.raises(DataFileError, match=rf"^{path}: no whole record in its first 0 MiB"):
        resolve(str(path), "data")
    assert counted() == 256 * 2**10  # the bound, each byte read once


def test_the_scan_refuses_a_line_longer_than_the_bound_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "MAX_LINE_BYTES", 64 * 2**10)
    monkeypatch.setattr(records_module, "_BLOCK", 16 * 2**10)
    path = tmp_path / "d.jsonl"
    long = json.dumps({"text": "y" * 200_000})
    path.write_text(f'{{"text": "a"}}\n{{"text": "b"}}\n{long}\n')
    with pytest.raises(DataFileError, match=rf"^{path}:3: a line longer than 0 MiB"):
        scan(resolve(str(path), "data"))


def test_a_json_array_above_its_bound_is_refused_naming_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "MAX_JSON_ARRAY_BYTES", 1000)
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"text": f"record {i}"} for i in range(100)]))
    source = resolve(str(path), "data")  # detection reads its first element only
    assert source.fmt == "text"
    with pytest.raises(
        DataFileError, match=rf"^{path}: a JSON array of 0 MiB.*write its records as JSONL"
    ):
        scan(source)


def test_the_scan_s_memory_stays_below_the_file_s_size(tmp_path, monkeypatch):
    monkeypatch.setattr(records_module, "_BLOCK", 64 * 2**10)
    monkeypatch.setattr(records_module, "PIECE_RECORDS", 32)
    path = tmp_path / "d.jsonl"
    line = json.dumps({"prompt": "q " * 250, "completion": "a " * 250}) + "\n"  # ~1 KiB
    count = 4 * 2**20 // len(line)
    path.write_text(line * count)  # 4 MiB
    source = resolve(str(path), "data")
    tracemalloc.start()
    try:
        scan(source)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert source.records == count and len(source.pieces) == -(-count // 32)
    assert peak < 2**20  # about two blocks and a piece's records; reading it whole: over 4 MiB


@pytest.mark.parametrize("group", [None, 3])  # one row group, or pieces across groups
def test_table_pieces_are_cut_from_one_pass_and_read_back_alike(tmp_path, monkeypatch, group):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(records_module, "PIECE_RECORDS", 4)
    monkeypatch.setattr(sources, "PIECE_RECORDS", 3)  # the reads' batches: not the pieces'
    rows = [{"text": f"row {i}"} for i in range(10)]
    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=group)
    source = scan(resolve(str(path), "data"))
    assert [(p.start, p.end) for p in source.pieces] == [(0, 4), (4, 8), (8, 10)]
    got = [(w, r) for p in source.pieces for w, r in read_piece(source, p)]
    assert got == [(f"{path}[{i}]", row) for i, row in enumerate(rows)]


def _refused_in_time(target, field="data"):
    """resolve(target) in a thread: it must refuse at once (a FIFO opened would block)."""
    outcome = {}

    def run():
        try:
            resolve(str(target), field)
        except Exception as e:  # the test inspects it
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=20)
    assert not thread.is_alive(), f"resolve({target}) did not return: it opened the file"
    assert isinstance(outcome.get("error"), DataFileError), outcome
    return str(outcome["error"])


def test_a_fifo_is_refused_naming_it_without_opening_it(tmp_path):
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    message = _refused_in_time(fifo)
    assert message.startswith(f"data: {fifo} is a named pipe (FIFO), not a regular file")
    assert "write the data into a regular file" in message
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n')
    for spec in (tmp_path, tmp_path / "*.jsonl"):  # in a folder, or matched by a glob
        assert f"{fifo} is a named pipe (FIFO)" in _refused_in_time(spec, "val_data")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/null"])
def test_a_device_or_a_link_to_one_is_refused_naming_it(tmp_path, device):
    link = tmp_path / "data.jsonl"
    link.symlink_to(device)
    for target in (link, device):
        assert _refused_in_time(target).startswith(f"data: {target} is a character device")


def test_a_socket_is_refused_naming_it():
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:  # a socket's path is short
        path = os.path.join(folder, "s.jsonl")
        server = socket.socket(socket.AF_UNIX)
        try:
            server.bind(path)
            assert _refused_in_time(path).startswith(f"data: {path} is a socket")
        finally:
            server.close()


def test_a_folder_with_a_data_suffix_is_refused_naming_it(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n')
    (tmp_path / "spark.parquet").mkdir()  # what Spark writes: a folder of part files
    message = _refused_in_time(tmp_path)
    assert f"{tmp_path / 'spark.parquet'} is a folder, not a regular file" in message
    assert f"point data at its files ({tmp_path / 'spark.parquet'}/*)" in message


@pytest.mark.parametrize("content", [b'{"text": "x"}\n', b""])
def test_a_file_that_is_not_really_parquet_is_refused_naming_it(tmp_path, content):
    path = tmp_path / "fake.parquet"
    path.write_bytes(content)
    with pytest.raises(DataFileError, match=rf"^{path}: not a Parquet file .*name it \.jsonl"):
        resolve(str(path), "data")


def test_a_fake_parquet_behind_a_good_one_is_named_by_the_scan(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "ok"}]), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_text('{"text": "x"}\n')
    source = resolve(str(tmp_path), "data")  # detection reads a.parquet only
    with pytest.raises(DataFileError, match=rf"^{tmp_path / 'b.parquet'}: not a Parquet file"):
        scan(source)


def test_an_empty_first_file_leaves_detection_to_the_next_and_all_empty_is_refused(tmp_path):
    (tmp_path / "a.jsonl").write_text("")
    (tmp_path / "b.jsonl").write_text('{"prompt": "q", "completion": "a"}\n')
    assert resolve(str(tmp_path), "data").fmt == "prompt_completion"
    (tmp_path / "b.jsonl").write_text("\n")
    with pytest.raises(DataFileError, match=rf"^data: {tmp_path} holds no record \(its 2 files"):
        resolve(str(tmp_path), "data")


def test_the_cache_s_per_sample_files_are_built_in_place_in_the_driver():
    import io

    import numpy as np

    from ray_trainer._data.cache import _joined_npy

    parts = [np.arange(i * 1000, (i + 1) * 1000, dtype=np.int32) for i in range(1000)]  # 4 MB
    tracemalloc.start()
    try:
        npy = _joined_npy(parts, np.int32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(np.load(io.BytesIO(npy)), np.arange(1_000_000, dtype=np.int32))
    assert peak < 4_000_000 + 2**16  # the file's bytes only: no joined copy beside them
    assert np.load(io.BytesIO(_joined_npy([], np.int32))).shape == (0,)
