"""Preparation tasks that Ray Data runs (``map_batches``, on any node): a batch of records, checked
as `scan` checks a file's, encoded as a piece of the token cache (prompts: tokenized).

A ``ray.data.Dataset`` is read by Ray Data itself (``_driver/ray_dataset.py`` hands these
functions to ``map_batches``): each call gets a pyarrow Table of consecutive records and does not
know where they sit in the dataset. So a bad record, or one left out, is named by its row in the
batch (``"3"``), and the driver, which reads the batches' results in the dataset's order, names
its row in the dataset. Records are read from the table as a Parquet file's are (`scan`'s
``to_pylist``, nulls dropped) and encoded by the pipeline's own encoders (``prepare``), so the
samples equal those of the same records in a file. Nothing here imports Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_trainer._data.cache import PieceResult
from ray_trainer._data.chat import RecordError, check_record
from ray_trainer._data.preference import check_in_file
from ray_trainer._data.prepare import EncodeSettings, encode_records
from ray_trainer._data.prompts import EncodedPrompt, PromptEncoder, check_prompt
from ray_trainer._data.records import _has_text
from ray_trainer._data.sources import DataFileError, Source, _drop_nulls, record_format


@dataclass
class BatchResult:
    """What one batch reports to the driver (small: it travels back through Ray Data)."""

    records: int
    errors: list[tuple[int, str]] = field(default_factory=list)  # (row in the batch, why)
    piece: PieceResult | None = None  # its piece of the token cache; None when a record is bad
    some_text: bool = False  # a record with text to train on (`scan`'s check of the source)
    prompts: list[EncodedPrompt] | None = None  # prompt-only records, tokenized


def batch_records(table: Any) -> list[tuple[str, Any]]:
    """A batch's records, read as `scan` reads a Parquet file's: ``(row in the batch, record)``."""
    return [(str(i), _drop_nulls(row)) for i, row in enumerate(table.to_pylist())]


def first_record(source: Source) -> tuple[str, str] | None:
    """(format, where) of the source's first record, whose format the pairs (or the prompts) of
    every batch must share, as a file's must share its first one's; None when it is bad."""
    if source.pair_format is None:
        return None
    return source.pair_format, f"{source.name}[0]"


def encode_batch(
    table: Any, source: Source, settings: EncodeSettings, cache_name: str, filesystem: Any
) -> BatchResult:
    """Check every record of a batch; when all are good, encode them as one piece of the cache
    at `cache_name`, named by its content (the driver gives it its place)."""
    rows = batch_records(table)
    result = BatchResult(records=len(rows))
    first = first_record(source)
    for where, record in rows:
        try:
            if source.fmt == "preference":
                check_in_file(record, first)
                continue
            fmt = record_format(record, source.fmt, settings.text_field)
            check_record(record, fmt, train_on=settings.train_on, text_field=settings.text_field)
            result.some_text = result.some_text or _has_text(record, fmt, settings.text_field)
        except RecordError as e:
            result.errors.append((int(where), str(e)))
    if result.errors:
        return result
    result.some_text = result.some_text or source.fmt == "preference"
    try:
        result.piece = encode_records(rows, source, settings, cache_name, filesystem, None)
    except DataFileError as e:  # "<row>: why": a record the template cannot render
        row, _, why = str(e).partition(": ")
        result.errors.append((int(row), why))
    return result


def encode_prompt_batch(table: Any, source: Source, encoder: PromptEncoder) -> BatchResult:
    """Check and tokenize every prompt-only record of a batch (GRPO's data)."""
    rows = batch_records(table)
    result = BatchResult(records=len(rows), prompts=[])
    first = first_record(source)
    for where, record in rows:
        try:
            check_prompt(record, first)
            result.prompts.append(encoder.encode(record))
        except RecordError as e:
            result.errors.append((int(where), str(e)))
    return result
