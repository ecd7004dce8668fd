"""Driver: every record of a source checked, and the source cut into pieces for preparation.

:func:`scan` runs in the driver before Ray starts (skipped when the run's token cache already
holds the source): it reads every record once, checks its shape for the source's format
(``chat.check_record``, for preference pairs ``preference.check_in_file``, for prompt-only
records ``prompts.check_prompt``: pure Python, no tokenizer; a prompt is also tokenized when
`scan` is given a ``PromptEncoder``, to refuse one that leaves no room for its completion), and cuts the source into :class:`Piece` s of at most ``PIECE_RECORDS`` records for the
preparation tasks. The first bad record fails the run with its file and line (or row) and the
fix, and how many other records are bad.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from ray_trainer._data.chat import RecordError, check_record
from ray_trainer._data.preference import _EXAMPLE, check_in_file
from ray_trainer._data.prompts import PromptEncoder, check_prompt
from ray_trainer._data.sources import (
    _ACCEPTED,
    _UTF8_BOM,
    MAX_JSON_ARRAY_BYTES,
    MAX_LINE_BYTES,
    PIECE_BYTES,
    PIECE_RECORDS,
    DataFile,
    DataFileError,
    Piece,
    Source,
    _drop_nulls,
    _parse_line,
    read_piece,
    record_format,
    table_batches,
)
from ray_trainer._storage import locate

_BLOCK = 8 * 2**20


def scan(
    source: Source,
    text_field: str = "text",
    train_on: str = "assistant",
    prompt_encoder: PromptEncoder | None = None,
    encoded: list | None = None,
) -> Source:
    """Check every record of `source` and cut it into pieces; returns it with ``records`` and
    ``pieces`` set (and ``pair_format``, for preference pairs or prompt-only records). Raises
    :class:`DataFileError` naming the first bad record."""
    if source.fmt == "preference":
        return _scan_pairs(source)
    if source.fmt == "prompts":
        return _scan_prompts(source, prompt_encoder, encoded)
    errors: list[str] = []
    pieces: list[Piece] = []
    some_text = False

    def check(record: dict[str, Any]) -> str:
        fmt = record_format(record, source.fmt, text_field)
        check_record(record, fmt, train_on=train_on, text_field=text_field)
        return fmt

    for rows in _units(source):
        for _, record, fmt in _checked(rows, check, errors, pieces):
            some_text = some_text or _has_text(record, fmt, text_field)
    total = sum(piece.records for piece in pieces)
    if errors:
        raise DataFileError(first_bad(errors))
    if total == 0:
        raise DataFileError(
            f"{source.field}: {source.name} holds no records; write one JSON object per line, "
            f"e.g. {_ACCEPTED}"
        )
    check_some_text(source, total, some_text, text_field)
    source.records, source.pieces = total, pieces
    return source


def check_some_text(source: Source, total: int, some_text: bool, text_field: str) -> None:
    """Refuse a source whose every record has empty text (`some_text`: one record has some),
    naming the fields to fill."""
    if not some_text:
        fields = {"text": repr(text_field), "prompt_completion": "'prompt'/'completion'"}
        raise DataFileError(
            f"{source.name}: all {total} record(s) have empty text (nothing to train on); fill "
            f"the {fields.get(source.fmt, 'message content')} fields"
        )


def _scan_pairs(source: Source) -> Source:
    """`scan` of a preference source: every pair checked, one format per file and per source
    (TRL reads one format per dataset); sets ``pair_format`` to it."""
    errors: list[str] = []
    pieces: list[Piece] = []
    source_first: tuple[str, str] | None = None  # the source's format, and where it was set
    first: tuple[str, str] | None = None  # the file's first good pair: (format, where)

    def check(record: dict[str, Any]) -> str:
        return check_in_file(record, first)

    for rows in _units(source):
        first = None
        for where, _, fmt in _checked(rows, check, errors, pieces):
            first = first or (fmt, where)
        if first is None or source_first is None or first[0] == source_first[0]:
            source_first = source_first or first
            continue
        errors.append(
            f"{first[1]}: a pair in the {first[0]!r} format, but {source_first[1]} is in the "
            f"{source_first[0]!r} one; the files of one source share one format (TRL, too, reads "
            "one format per dataset): write them all alike"
        )
    if errors:
        raise DataFileError(f"{source.field}: {first_bad(errors)}")
    if source_first is None:
        raise DataFileError(
            f"{source.field}: {source.name} holds no preference pairs; write one JSON object per "
            f"line, e.g. {_EXAMPLE}"
        )
    source.records, source.pieces = sum(piece.records for piece in pieces), pieces
    source.pair_format = source_first[0]
    return source


def _scan_prompts(
    source: Source, encoder: PromptEncoder | None, encoded: list | None = None
) -> Source:
    """`scan` of prompt-only records: every record checked (and tokenized, with `encoder`;
    each ``EncodedPrompt`` appended to `encoded` when given), one format (strings, or lists of
    messages) per source; sets ``pair_format`` to it."""
    errors: list[str] = []
    pieces: list[Piece] = []
    first: tuple[str, str] | None = None  # the source's format, and where it was set

    def check(record: dict[str, Any]) -> str:
        fmt = check_prompt(record, first)
        if encoder is not None:
            prompt = encoder.encode(record)
            if encoded is not None:
                encoded.append(prompt)
        return fmt

    for rows in _units(source):
        for where, _, fmt in _checked(rows, check, errors, pieces):
            first = first or (fmt, where)
    if errors:
        raise DataFileError(f"{source.field}: {first_bad(errors)}")
    if first is None:
        raise DataFileError(
            f"{source.field}: {source.name} holds no prompts; write one JSON object per line, "
            'e.g. {"prompt": "What is 2 + 2?", "answer": "4"}'
        )
    source.records, source.pieces = sum(piece.records for piece in pieces), pieces
    source.pair_format = first[0]
    return source


def _checked(
    rows: Iterator[tuple[Piece, list]],
    check: Callable[[Any], str],
    errors: list[str],
    pieces: list[Piece],
) -> Iterator[tuple[str, Any, str]]:
    """Each record of one file's `rows`, checked: ``(where, record, format)`` of each record
    `check` takes (it returns the record's format or raises :class:`RecordError`); each bad
    record's error, naming where it is, goes into `errors`, and each piece, once read, into
    `pieces`."""
    for piece, records in rows:
        for where, record in records:
            try:
                if isinstance(record, _Bad):
                    raise RecordError(record.why)
                fmt = check(record)
            except RecordError as e:
                errors.append(f"{where}: {e}")
                continue
            yield where, record, fmt
        pieces.append(piece)


def first_bad(errors: list[str]) -> str:
    """The first error, and how many more there are (with the second as an example)."""
    more = len(errors) - 1
    return errors[0] + (
        f" ({more} more bad record{'s' if more > 1 else ''}, e.g. {errors[1]})" if more else ""
    )


def _has_text(record: dict[str, Any], fmt: str, text_field: str) -> bool:
    if fmt == "text":
        return bool(record[text_field])
    if fmt == "prompt_completion":
        return bool(record["prompt"] or record["completion"])
    messages = record["messages"] if fmt == "messages" else record["completion"]
    return any(m.get("content") for m in messages)


def _units(source: Source) -> Iterator[Iterator[tuple[Piece, list]]]:
    """Per file (or the in-memory table): its pieces, each with its (where, record) list. Each
    file is read once, in order, a block or a record batch at a time."""
    if source.table is not None:
        yield _row_pieces(source, len(source.table))
        return
    for file in source.files:
        if file.kind in ("parquet", "arrow"):
            yield _table_pieces(file)
        else:
            yield _line_pieces(source, file)


def _row_pieces(source: Source, rows: int) -> Iterator[tuple[Piece, list]]:
    """The in-memory table's pieces."""
    for start in range(0, rows, PIECE_RECORDS):
        piece = Piece(None, start, min(rows, start + PIECE_RECORDS))
        records = list(read_piece(source, piece))
        yield Piece(None, piece.start, piece.end, records=len(records)), records


def _table_pieces(file: DataFile) -> Iterator[tuple[Piece, list]]:
    """A Parquet or Arrow file's pieces: one per record batch of at most `PIECE_RECORDS` rows,
    from one pass over the file."""
    start = 0
    for batch in table_batches(file, PIECE_RECORDS):
        rows = batch.to_pylist()
        records = [(f"{file.name}[{start + i}]", _drop_nulls(row)) for i, row in enumerate(rows)]
        yield Piece(file, start, start + len(rows), records=len(rows)), records
        start += len(rows)


def _line_pieces(source: Source, file: DataFile) -> Iterator[tuple[Piece, list]]:
    """A JSONL (or JSON) file read in blocks, cut at line ends into pieces."""
    location = locate(file.name)
    with location.fs.open_input_stream(location.path) as f:
        pending = f.read(_BLOCK)
        if file.kind == "json" and pending.lstrip()[:1] == b"[":  # one JSON array: one piece
            if file.size > MAX_JSON_ARRAY_BYTES:  # parsed whole, here and in its task
                raise DataFileError(
                    f"{file.name}: a JSON array of {file.size / 2**20:.0f} MiB; one array is "
                    f"parsed whole, so at most {MAX_JSON_ARRAY_BYTES // 2**20} MiB: write its "
                    "records as JSONL, one per line (e.g. jq -c '.[]'), read piece by piece"
                )
            rows = list(read_piece(source, Piece(file, 0, file.size)))
            yield Piece(file, 0, file.size, records=len(rows)), rows
            return
        skip = len(_UTF8_BOM) if pending.startswith(_UTF8_BOM) else 0
        pending = pending[skip:]
        start = offset = skip
        first_line = lineno = 1
        records: list[tuple[str, Any]] = []
        while True:
            more = f.read(_BLOCK)
            lines = pending.split(b"\n")
            pending = lines.pop() if more else b""  # an unfinished line waits for the next block
            if len(pending) > MAX_LINE_BYTES:  # never hold more than a line's bound of it
                raise DataFileError(
                    f"{file.name}:{lineno + len(lines)}: a line longer than "
                    f"{MAX_LINE_BYTES // 2**20} MiB; a record (one line of JSONL) may be at most "
                    f"{MAX_LINE_BYTES // 2**20} MiB: check that the file holds one record per line"
                )
            for raw in lines:
                offset += len(raw) + 1
                if raw.strip():
                    records.append((f"{file.name}:{lineno}", _parsed(file, lineno, raw)))
                lineno += 1
                if len(records) >= PIECE_RECORDS or offset - start >= PIECE_BYTES:
                    yield (
                        Piece(file, start, min(offset, file.size), first_line, len(records)),
                        records,
                    )
                    start, first_line, records = offset, lineno, []
            if not more:
                break
            pending += more
    if records:
        yield Piece(file, start, min(offset, file.size), first_line, len(records)), records


def _parsed(file: DataFile, lineno: int, raw: bytes) -> Any:
    """The parsed line, or a `_Bad` that `scan` reports (so every bad line is counted)."""
    try:
        return _parse_line(file.name, lineno, raw)
    except DataFileError as e:
        return _Bad(str(e).split(": ", 1)[1])


class _Bad:
    """A line that did not parse, and why."""

    def __init__(self, why: str) -> None:
        self.why = why
