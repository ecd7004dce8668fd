"""Driver and data-preparation tasks: where a run's records come from, in which format.

``data`` and ``val_data`` name a source: a JSONL, JSON or Parquet file, a glob of them, a folder of
them, a folder written by ``datasets.Dataset.save_to_disk``, local or on a bucket (``s3://``,
``gs://``: read through ``pyarrow.fs``, never assuming a shared disk), or an in-memory
``datasets.Dataset`` (a ``ray.data.Dataset`` is read by Ray Data, ``_driver/ray_dataset.py``;
its `Source` is made there). :func:`resolve` (driver, before Ray starts) finds the files and detects the
format from the columns; :func:`scan` (driver) checks every record and cuts the source into
:class:`Piece` s; :func:`read_piece` (a preparation task, on any node) yields a piece's records,
read from the file, or from the piece's content that the driver read (:func:`piece_content`)
when the file is on the driver's disk only. Every record comes with where it is
(``file:line``, or ``file[row]``), so an error names it.

Bounded memory, whatever the file's size: detection reads a prefix of the first file (at most
`MAX_LINE_BYTES`, usually 64 KiB; ranged reads on a bucket, never a download of the whole
object) or a table's first row; the scan streams every file in blocks; a piece is at most
`PIECE_RECORDS` records or about `PIECE_BYTES` bytes. Only a JSON file that holds one array is
parsed whole, so it may be at most `MAX_JSON_ARRAY_BYTES`. What is not a regular file (a FIFO, a
device, a socket) is refused, naming it, before anything opens it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import Location, is_uri, locate

_SUFFIXES = {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
_GLOB = set("*?[")
#: A piece holds at most this many records or bytes of a file (one preparation task each).
PIECE_RECORDS = 4096
PIECE_BYTES = 32 * 2**20
#: A JSONL line (one record) may be at most this long; detection reads at most this much.
MAX_LINE_BYTES = PIECE_BYTES
#: A JSON file holding one array of records is parsed whole: at most this big (JSONL above it).
MAX_JSON_ARRAY_BYTES = 256 * 2**20
_PROBE = 64 * 2**10  # detection's first read; each next one is 4x larger, up to MAX_LINE_BYTES
_UTF8_BOM = b"\xef\xbb\xbf"
_ACCEPTED = (
    '{"messages": [{"role": ..., "content": ...}, ...]} (chat), {"prompt": ..., "completion": ...} '
    '(strings, or lists of messages), {"text": ...}, or {"prompt": ..., "chosen": ..., '
    '"rejected": ...} (preference pairs, with objective="dpo")'
)


class DataFileError(TrainingArgsError):
    """A data file that is missing or malformed; the message names the file, the line and the fix
    (a `TrainingArgsError`: the one family of errors bad input gets, still a ``ValueError``)."""


@dataclass(frozen=True)
class DataFile:
    """One file of a source: its name as users see it (a path or URI), kind, size, mtime."""

    name: str
    kind: str  # "jsonl" | "json" | "parquet" | "arrow"
    size: int
    mtime: float | None = None


@dataclass(frozen=True)
class Piece:
    """A slice of one file (or of an in-memory table) that one preparation task encodes:
    bytes ``[start, end)`` of a JSONL file, rows ``[start, end)`` otherwise."""

    file: DataFile | None  # None: the source's in-memory table
    start: int
    end: int
    first_line: int = 1  # JSONL: the line number at `start`
    records: int = 0


@dataclass
class Source:
    """A resolved ``data`` or ``val_data`` input (picklable: it travels to preparation tasks)."""

    field: str
    name: str
    files: list[DataFile]
    fmt: str
    columns: list[str]
    table: Any = None  # an in-memory dataset's pyarrow Table (or, in tasks, its ObjectRef)
    fingerprint: str = ""  # what identifies the records: files' names, sizes and mtimes
    # False where `fingerprint` does not cover the records' content (a ray.data.Dataset read
    # from neither files nor memory): its token cache is built again at every start.
    stable: bool = True
    # A ray.data.Dataset, read by the driver's plug for it (``_driver/ray_dataset.py``) with
    # Ray Data's own tasks; it never travels with the source.
    dataset: Any = None
    records: int | None = None  # set by `scan`
    pieces: list[Piece] = field(default_factory=list)
    first: dict[str, Any] = field(default_factory=dict, repr=False)  # told the format
    # A "preference" source's pair format (see `preference`), or a "prompts" source's prompt
    # format (see `prompts`).
    pair_format: str | None = None


def is_hf_dataset(value: Any) -> bool:
    """True for a ``datasets.Dataset`` (checked without importing datasets)."""
    return type(value).__module__.startswith("datasets") and hasattr(value, "with_format")


def resolve(value: Any, field_name: str, text_field: str = "text") -> Source | None:
    """The source of ``value`` (None for what ray-trainer does not tokenize: a torch
    ``Dataset``, a callable, None). Reads the first record (a bounded prefix of the first file
    that holds one, or a table's first batch) to detect the format.

    Raises:
        DataFileError: a missing path, a glob that matches nothing, a folder without data files,
            a path that is not a regular file (a FIFO, a device, a socket; never opened), a
            source with no record, a file that is not the Parquet or Arrow file it is named, a
            ``DatasetDict``, or columns that fit no format (the message lists both).
    """
    if type(value).__name__ == "DatasetDict":
        raise DataFileError(
            f"{field_name}: got a datasets.DatasetDict of splits {list(value)}; pass one split, "
            f"e.g. {field_name}=dataset['train']"
        )
    if is_hf_dataset(value):
        table = value.with_format("arrow")[:]  # the rows in their logical order
        cols = list(table.column_names)
        first = table.slice(0, 1).to_pylist()[0] if len(table) else {}
        name = f"{field_name} (a datasets.Dataset)"
        fmt = detect_format(name, cols, first, text_field)
        fp = getattr(value, "_fingerprint", None) or table_digest(table)
        return Source(
            field_name, name, [], fmt, cols, table=table, fingerprint=f"dataset:{fp}",
            first=_drop_nulls(first),
        )  # fmt: skip
    if not isinstance(value, str):
        return None
    files = _files(value, field_name)
    cols, first, named = _first_columns(files, value, field_name)
    fmt = detect_format(named, cols, first, text_field)
    parts = [f"{f.name}|{f.size}|{f.mtime}" for f in files]
    first = _drop_nulls(first) if isinstance(first, dict) else {}
    return Source(field_name, value, files, fmt, cols, fingerprint=";".join(parts), first=first)


def detect_format(name: str, columns: list[str], first: dict[str, Any], text_field: str) -> str:
    """The record format from the columns: ``chosen`` and ``rejected`` (preference pairs, in
    any of their formats: ``preference``) first, then ``messages``, then ``prompt``/``completion``
    (lists of messages: ``conversational``), then the text field, then ``prompt`` alone
    (prompt-only records: ``prompts``, see ``prompts``)."""
    if "chosen" in columns and "rejected" in columns:
        return "preference"
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "conversational" if isinstance(first.get("prompt"), list) else "prompt_completion"
    if text_field in columns:
        return "text"
    if "prompt" in columns:  # prompt-only records, with any other columns (GRPO's data)
        return "prompts"
    found = ", ".join(repr(c) for c in columns) or "none"
    hint = "" if text_field != "text" else "; set text_field to read another column as text"
    raise DataFileError(
        f"{name}: no known record format in its columns ({found}); ray-trainer reads {_ACCEPTED}"
        + hint
    )


def record_format(record: Any, source_fmt: str, text_field: str = "text") -> str:
    """The format of one record: its source's, except that the plain formats mix (a JSONL file
    may hold both ``{"text"}`` and ``{"prompt", "completion"}`` lines, as it always could)."""
    if source_fmt in ("text", "prompt_completion") and isinstance(record, dict):
        if text_field in record:
            return "text"
        if "prompt" in record or "completion" in record:
            return "prompt_completion"
    return source_fmt


def _files(spec: str, field_name: str) -> list[DataFile]:
    """The data files a string names: a file, a glob, a folder of files or a save_to_disk one.
    Nothing is opened here: a FIFO, a device or a socket is refused by its type alone."""
    if _GLOB & set(os.path.basename(spec)):
        parent, pattern = spec.rsplit("/", 1) if "/" in spec else (".", spec)
        found = [e for e in _listing(locate(parent)) if fnmatch.fnmatch(_base(e[0].name), pattern)]
        if not found:
            raise DataFileError(f"{field_name}: {spec} matches no file; check the pattern")
        return _supported(found, spec, field_name)
    location = locate(spec)
    info = location.fs.get_file_info(location.path)
    if info.type.name == "NotFound":
        where = "no such object" if is_uri(spec) else f"resolved to {location.path}"
        raise DataFileError(
            f"{field_name}: {spec} does not exist ({where}); check the path (a relative path "
            "means the folder the driver runs in; a bucket needs this process's credentials)"
        )
    if info.type.name == "Directory":
        state = location.child("state.json").read_text()
        if state is not None:  # written by datasets' save_to_disk: its arrow files, in order
            names = [f["filename"] for f in json.loads(state).get("_data_files", [])]
            listed = {_base(e[0].name): e for e in _listing(location)}
            return _supported([listed[n] for n in names if n in listed], spec, field_name)
        return _supported(_listing(location), spec, field_name)
    if info.type.name != "File":  # a FIFO, a device, a socket: never opened
        raise _not_a_file(field_name, spec, info.type.name)
    return _supported([(_data_file(location, info), "File")], spec, field_name)


def _supported(entries: list[tuple[DataFile, str]], spec: str, field_name: str) -> list[DataFile]:
    """The data files among `entries` (a file and its type, "File" for a regular file); an
    entry with a data file's suffix that is not a regular file is refused, naming it."""
    for file, kind in entries:
        if file.kind and kind != "File":
            raise _not_a_file(field_name, file.name, kind)
    kept = [file for file, _ in entries if file.kind]
    if not kept:
        names = ", ".join(_base(file.name) for file, _ in entries[:5]) or "nothing"
        raise DataFileError(
            f"{field_name}: {spec} holds no data file ({names}); ray-trainer reads .jsonl, .json, "
            ".parquet and the folders datasets' save_to_disk writes"
        )
    return sorted(kept, key=lambda f: f.name)


def _not_a_file(field_name: str, name: str, kind: str) -> DataFileError:
    """The refusal of a path that is not a regular file (`kind`: its pyarrow file type)."""
    if kind == "Directory":  # inside a folder or a glob: e.g. a Spark-written "x.parquet/"
        fix = f"point {field_name} at its files ({name.rstrip('/')}/*)"
    else:
        fix = f"write the data into a regular file and point {field_name} at it"
    return DataFileError(
        f"{field_name}: {name} is {_what_is(name, kind)}, not a regular file; ray-trainer reads "
        f"data from regular files or a bucket's objects (read in ranges, and more than once): {fix}"
    )


def _what_is(name: str, kind: str) -> str:
    """What a path that is not a regular file is, in words (told without opening it)."""
    if kind == "Directory":
        return "a folder"
    if not is_uri(name):
        try:
            mode = os.stat(name).st_mode  # follows a symlink, as reading it would
        except OSError:
            return "not readable as a file"
        for test, words in (
            (stat.S_ISFIFO, "a named pipe (FIFO)"),
            (stat.S_ISCHR, "a character device"),
            (stat.S_ISBLK, "a block device"),
            (stat.S_ISSOCK, "a socket"),
        ):
            if test(mode):
                return words
    return "neither a file nor a folder"


def _listing(folder: Location) -> list[tuple[DataFile, str]]:
    """The entries directly in `folder`, each with its type ("File" for a regular file)."""
    import pyarrow.fs as pafs

    selector = pafs.FileSelector(folder.path, allow_not_found=True, recursive=False)
    infos = folder.fs.get_file_info(selector)
    return [(_data_file(folder.child(i.base_name), i), i.type.name) for i in infos]


def _data_file(location: Location, info: Any) -> DataFile:
    suffix = os.path.splitext(location.path)[1].lower()
    mtime = info.mtime.timestamp() if info.mtime is not None else None
    return DataFile(location.name, _SUFFIXES.get(suffix, ""), int(info.size or 0), mtime)


def _base(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1]


def table_digest(table: Any) -> str:
    """A digest of a pyarrow Table's content (16 hex digits): its Arrow IPC stream, hashed as
    it is written, so that a big table is never copied whole and a slice digests only its
    rows. The same rows laid out otherwise (other chunks) may digest otherwise."""
    import hashlib

    import pyarrow as pa

    digest = _Digest(hashlib.sha256())
    with pa.ipc.new_stream(pa.PythonFile(digest, mode="w"), table.schema) as writer:
        writer.write_table(table)
    return digest.hash.hexdigest()[:16]


class _Digest:
    """A write-only file that hashes what is written to it (`table_digest`'s sink)."""

    closed = False

    def __init__(self, hash: Any) -> None:
        self.hash, self.written = hash, 0

    def write(self, data: Any) -> int:
        self.hash.update(data)
        self.written += len(data)
        return len(data)

    def tell(self) -> int:
        return self.written

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


# ---- reading records -------------------------------------------------------------------------


def _first_columns(
    files: list[DataFile], spec: str, field_name: str
) -> tuple[list[str], dict[str, Any], str]:
    """The columns and first record of the first file that holds one, and that file's name
    (told the format); a source whose every file is empty is refused, naming it."""
    for file in files:
        found = _first_record(file)
        if found is not None:
            return found[0], found[1], file.name
    if len(files) == 1:
        what = f"{files[0].name} is empty (no record in it)"
    else:
        what = f"{spec} holds no record (its {len(files)} files are empty)"
    raise DataFileError(
        f"{field_name}: {what}; write one record per line (JSONL), e.g. {_ACCEPTED}"
    )


def _first_record(file: DataFile) -> tuple[list[str], dict[str, Any]] | None:
    """The columns of a file and its first record (for the format); None for a file with no
    record. Reads a table's first row group, or a JSON file's prefix (`_first_value`)."""
    if file.kind in ("parquet", "arrow"):
        table = _read_table(file, 0, 1)
        if not table.num_rows and not table.column_names:
            return None
        return list(table.column_names), (table.to_pylist() or [{}])[0]
    found = _first_value(file)
    if found is None:
        return None
    record = found[1]
    return (list(record), record) if isinstance(record, dict) else ([], {})


_MORE = object()  # `_value_in`: the prefix ends before the first record does


def _first_value(file: DataFile) -> tuple[str, Any] | None:
    """(where, value) of a JSONL or JSON file's first record, or None when it has none. Reads a
    prefix: `_PROBE` bytes, then 4x more while the first record is unfinished, at most
    `MAX_LINE_BYTES` (ranged reads: on a bucket, never the whole object)."""
    location = locate(file.name)
    want, head = min(_PROBE, file.size), b""
    with location.fs.open_input_file(location.path) as f:
        while True:
            head += f.read_at(want - len(head), len(head))  # the bytes not read yet
            found = _value_in(file, head, at_end=len(head) >= file.size)
            if found is not _MORE:
                return found
            if want >= MAX_LINE_BYTES:
                raise DataFileError(
                    f"{file.name}: no whole record in its first {MAX_LINE_BYTES // 2**20} MiB; a "
                    f"record (one line of JSONL) may be at most {MAX_LINE_BYTES // 2**20} MiB"
                )
            want = min(want * 4, MAX_LINE_BYTES, file.size)


def _value_in(file: DataFile, head: bytes, at_end: bool) -> Any:
    """The first record in a file's first bytes `head`: (where, value), None when the whole
    file (`at_end`) holds none, or `_MORE` when `head` ends before the record does."""
    if head.startswith(_UTF8_BOM):
        head = head[len(_UTF8_BOM) :]
    if file.kind == "json" and head.lstrip()[:1] == b"[":  # one JSON array of records
        try:
            text = head.decode("utf-8")
        except UnicodeDecodeError as e:
            if not at_end and e.start >= len(head) - 3:  # a character cut by the prefix
                text = head[: e.start].decode("utf-8")
            else:
                raise DataFileError(
                    f"{file.name}: not a valid JSON array of records ({e})"
                ) from None
        start = text.index("[") + 1
        while start < len(text) and text[start].isspace():
            start += 1
        if text[start : start + 1] == "]":
            return None
        try:
            return f"{file.name}[0]", json.JSONDecoder().raw_decode(text, start)[0]
        except json.JSONDecodeError as e:
            if at_end:
                raise DataFileError(
                    f"{file.name}: not a valid JSON array of records ({e})"
                ) from None
            return _MORE
    lines = head.split(b"\n")
    if not at_end:
        lines.pop()  # unfinished: the next prefix holds the whole of it
    for lineno, raw in enumerate(lines, start=1):
        if raw.strip():
            return f"{file.name}:{lineno}", _parse_line(file.name, lineno, raw)
    return None if at_end else _MORE


def read_piece(source: Source, piece: Piece, content: Any = None) -> Iterator[tuple[str, Any]]:
    """(where, record) for every record of a piece, in order; ``record`` is whatever the line
    parsed to (checking its shape is `check_record`'s job). Runs in the driver and in
    preparation tasks. With `content` (what :func:`piece_content` read from the piece's file),
    the file is not opened: it may be on another machine. A JSON line that does not parse
    raises :class:`RecordLineError`."""
    if piece.file is None:
        table = source.table
        for offset, row in enumerate(table.slice(piece.start, piece.end - piece.start).to_pylist()):
            yield f"{source.name}[{piece.start + offset}]", _drop_nulls(row)
        return
    yield from _records(piece, content)


def piece_content(piece: Piece) -> Any:
    """What a file piece holds, read here (the driver) to travel to a preparation task that
    cannot see the file: its bytes (JSONL, JSON), or its rows as a pyarrow Table (Parquet,
    Arrow). At most `PIECE_BYTES` of a JSONL file, `PIECE_RECORDS` rows of a table."""
    file = piece.file
    if file is None:
        raise ValueError("piece_content: an in-memory table's piece has no file to read")
    if file.kind in ("parquet", "arrow"):
        return _read_table(file, piece.start, piece.end)
    return _read_bytes(file, piece.start, piece.end)


class RecordLineError(DataFileError):
    """A line that is not one JSON object (the message names file and line)."""


def _records(piece: Piece, content: Any = None) -> Iterator[tuple[str, Any]]:
    file = piece.file
    assert file is not None  # an in-memory table's rows are read by `read_piece`
    if content is None:
        content = piece_content(piece)
    if file.kind in ("parquet", "arrow"):
        for offset, row in enumerate(content.to_pylist()):
            yield f"{file.name}[{piece.start + offset}]", _drop_nulls(row)
        return
    data = content
    if piece.start == 0 and data.startswith(_UTF8_BOM):  # as editors on Windows write it
        data = data[len(_UTF8_BOM) :]
    if file.kind == "json" and data.lstrip()[:1] == b"[":  # one JSON array of records
        for i, record in enumerate(_json_array(file.name, data)):
            yield f"{file.name}[{i}]", record
        return
    for lineno, raw in enumerate(data.split(b"\n"), start=piece.first_line):
        if raw.strip():
            yield f"{file.name}:{lineno}", _parse_line(file.name, lineno, raw)


def _parse_line(name: str, lineno: int, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise RecordLineError(
            f"{name}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start}); save it as UTF-8"
        ) from None
    except json.JSONDecodeError as e:
        raise RecordLineError(
            f"{name}:{lineno}: invalid JSON ({e.msg}: column {e.colno}); each line must be one "
            f"JSON object, e.g. {_ACCEPTED}"
        ) from None


def _json_array(name: str, data: bytes) -> list[Any]:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFileError(f"{name}: not a valid JSON array of records ({e})") from None


def _drop_nulls(row: dict[str, Any]) -> dict[str, Any]:
    """Arrow fills a field that another row has with None: drop those (recursively in
    messages, a preference pair's answers included) so a chat template sees the record as it
    was written."""
    out = {k: v for k, v in row.items() if v is not None}
    for key in ("messages", "prompt", "completion", "chosen", "rejected"):
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [
                {k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                for m in value
            ]
    return out


def _read_bytes(file: DataFile, start: int, end: int) -> bytes:
    location = locate(file.name)
    if start == 0 and end >= file.size:
        return location.read_bytes()
    with location.fs.open_input_file(location.path) as f:
        return f.read_at(end - start, start)


def _read_table(file: DataFile, start: int, end: int) -> Any:
    """Rows ``[start, end)`` of a Parquet file or an Arrow stream file (save_to_disk's), read
    batch by batch: only the batches that hold them are kept, and a Parquet file's row groups
    before `start` are skipped unread."""
    import pyarrow as pa

    kept, schema = [], None
    for batch_schema, first, batch in _batches(file, PIECE_RECORDS, start):
        schema, rows = batch_schema, batch.num_rows
        if first + rows > start and first < end:
            lo, hi = max(start - first, 0), min(end - first, rows)
            kept.append(batch.slice(lo, hi - lo))
        if first + rows >= end:
            break
    if schema is None:  # no batch at all: the file's schema, no rows
        schema = _schema(file)
    return pa.Table.from_batches(kept, schema=schema)


def table_batches(file: DataFile, rows: int = PIECE_RECORDS) -> Iterator[Any]:
    """Every row of a Parquet or Arrow file, in order, in record batches of at most `rows`
    rows, from one pass over the file (the scan's way through it)."""
    for _, _, batch in _batches(file, rows):
        for lo in range(0, batch.num_rows, rows):
            yield batch.slice(lo, rows)


def _batches(file: DataFile, rows: int, start: int = 0) -> Iterator[tuple[Any, int, Any]]:
    """(schema, index of its first row, record batch) of a Parquet or Arrow file in order, from
    the Parquet row group that holds row `start` (an Arrow stream has no index: from its
    start); a file that is not one is refused, naming it (not pyarrow's bare error)."""
    import pyarrow as pa

    location = locate(file.name)
    with location.fs.open_input_file(location.path) as f:
        try:
            reader = _table_reader(file, f)
            if file.kind == "parquet":
                schema, groups, first = reader.schema_arrow, [], 0
                for group in range(reader.metadata.num_row_groups):
                    size = reader.metadata.row_group(group).num_rows
                    if first + size <= start and not groups:
                        first += size  # wholly before `start`: not read
                    else:
                        groups.append(group)
                batches = reader.iter_batches(batch_size=rows, row_groups=groups)
            else:
                schema, first, batches = reader.schema, 0, reader
            for batch in batches:
                yield schema, first, batch
                first += batch.num_rows
        except pa.ArrowInvalid as e:
            raise _not_a_table(file, e) from None


def _schema(file: DataFile) -> Any:
    import pyarrow as pa

    location = locate(file.name)
    with location.fs.open_input_file(location.path) as f:
        try:
            reader = _table_reader(file, f)
        except pa.ArrowInvalid as e:
            raise _not_a_table(file, e) from None
        return reader.schema_arrow if file.kind == "parquet" else reader.schema


def _table_reader(file: DataFile, f: Any) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pq.ParquetFile(f) if file.kind == "parquet" else pa.ipc.open_stream(f)


def _not_a_table(file: DataFile, error: Exception) -> DataFileError:
    what = (
        "a Parquet file (write one with pyarrow.parquet.write_table or pandas' to_parquet)"
        if file.kind == "parquet"
        else "an Arrow stream file (as datasets' save_to_disk writes)"
    )
    return DataFileError(
        f"{file.name}: not {what}: {error}; if it holds JSON lines, name it .jsonl"
    )
