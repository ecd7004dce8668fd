"""Preparation task: encode one piece of a source into the run's token cache.

A record becomes one sample; a preference pair (``objective="dpo"``) becomes two consecutive
samples, its chosen then its rejected sequence (``EncodedPair.sequences``), so that a piece of
``n`` kept pairs holds ``2n`` samples and sample ``2i + 1`` is the rejected side of sample ``2i``.

:func:`encode_piece` is the body of the preparation tasks the driver launches
(``ray_trainer._driver.data`` wraps it in the Ray task), one per piece, on any node; the tests
of the encoding run it in their own process. :func:`encode_records` is its encoding of records
already read, which a Ray Data task also calls for its batch (``batches.py``). It needs the source's records (read from its files
or its table through ``pyarrow.fs``, or the piece's content as the driver read it), the run's
tokenizer (built as the workers build it) and the storage the cache lives on. Nothing here
imports Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ray_trainer._data.cache import PieceResult, write_piece
from ray_trainer._data.chat import RecordError
from ray_trainer._data.encode import IGNORE_INDEX, Encoder
from ray_trainer._data.preference import PairEncoder, pair_format
from ray_trainer._data.sources import DataFileError, Piece, Source, read_piece, record_format
from ray_trainer._storage import locate

#: Records with no label left (truncated away, or no assistant turn) named in the result, at most.
MAX_NAMED = 5


@dataclass(frozen=True)
class EncodeSettings:
    """How records become samples: the run's tokenizer (as a `ModelSpec` builds it) and the
    `TrainingArgs` fields that decide the encoding. Part of the cache's fingerprint."""

    model_spec: Any  # ray_trainer._model.spec.ModelSpec (for build_tokenizer)
    chat_template: str | None
    train_on: str
    max_length: int
    text_field: str
    objective: str = "sft"  # "dpo": the source holds preference pairs
    pair_format: str | None = None  # their format (`preference.PAIR_FORMATS`), under "dpo"


def encode_piece(
    source: Source,
    index: int,
    piece: Piece,
    settings: EncodeSettings,
    cache_name: str,
    filesystem: Any = None,
    content: Any = None,
) -> PieceResult:
    """Encode every record of `piece` and write them as piece `index` of the cache at
    `cache_name`. Records that keep no label are left out and named in the result. With
    `content` (``sources.piece_content`` of the piece, read by the driver), the piece's file
    is not opened here.

    Raises:
        DataFileError: a record the template cannot render as asked, with where it is.
    """
    records = read_piece(source, piece, content)
    return encode_records(records, source, settings, cache_name, filesystem, index)


def encode_records(
    records: Iterable[tuple[str, Any]],
    source: Source,
    settings: EncodeSettings,
    cache_name: str,
    filesystem: Any,
    index: int | None,
) -> PieceResult:
    """Encode `records` (``(where, record)`` each, of `source`'s format) as one piece of the
    cache at `cache_name`: piece `index`, or with None a piece named by its content (one that
    Ray Data encoded, whose place the driver gives it). Records that keep no label are left
    out and named in the result.

    Raises:
        DataFileError: a record the template cannot render as asked, with where it is.
    """
    cpu = time.process_time()
    encode = _pair_samples if source.fmt == "preference" else _record_samples
    samples: list[tuple[list[int], list[int]]] = []
    targets: list[int] = []
    dropped: list[str] = []
    count = truncated = dropped_count = 0
    for where, record in records:
        count += 1
        try:
            kept, cut = encode(record, source, settings, cache_name)
        except RecordError as e:
            raise DataFileError(f"{where}: {e}") from None
        truncated += cut
        scored = [sum(1 for label in labels[1:] if label != IGNORE_INDEX) for _, labels in kept]
        if not kept or 0 in scored:
            dropped_count += 1
            if len(dropped) < MAX_NAMED:
                dropped.append(where)
            continue
        samples.extend(kept)
        targets.extend(scored)
    name = write_piece(locate(cache_name, filesystem), index, samples)
    lengths = np.fromiter((len(ids) for ids, _ in samples), dtype=np.int32, count=len(samples))
    return PieceResult(
        index=-1 if index is None else index,
        lengths=lengths,
        targets=np.asarray(targets, dtype=np.int32),
        records=count,
        truncated=truncated,
        dropped=dropped_count,
        dropped_where=dropped,
        cpu_s=time.process_time() - cpu,
        name=None if index is not None else name,
    )


_Samples = list[tuple[list[int], list[int]]]


def _record_samples(
    record: Any, source: Source, settings: EncodeSettings, key: str
) -> tuple[_Samples, bool]:
    """One record's sample and whether it was truncated (left out if it scores no label)."""
    encoder = _encoder(settings, key)
    encoded = encoder.encode(record, record_format(record, source.fmt, settings.text_field))
    return [(list(encoded.input_ids), list(encoded.labels))], bool(encoded.truncated)


def _pair_samples(
    record: Any, source: Source, settings: EncodeSettings, key: str
) -> tuple[_Samples, bool]:
    """One pair's two samples (chosen, rejected) and whether either side was truncated; none
    when its prompt alone fills ``max_length``. `scan` refused files that mix formats."""
    pair = _pair_encoder(settings, key).encode(record, pair_format(record))
    if pair is None:
        return [], False
    return list(pair.sequences()), pair.truncated


_ENCODERS: dict[str, Any] = {}


def _cached(key: str, build: Any) -> Any:
    """One encoder per process and cache (a task process may encode several pieces)."""
    if key not in _ENCODERS:
        _ENCODERS.clear()
        _ENCODERS[key] = build()
    return _ENCODERS[key]


def _encoder(settings: EncodeSettings, key: str) -> Encoder:
    return _cached(
        key,
        lambda: Encoder(
            settings.model_spec.data_tokenizer(),
            chat_template=settings.chat_template,
            train_on=settings.train_on,
            max_length=settings.max_length,
            text_field=settings.text_field,
        ),
    )


def _pair_encoder(settings: EncodeSettings, key: str) -> PairEncoder:
    return _cached(
        key,
        lambda: PairEncoder(
            settings.model_spec.data_tokenizer(),
            chat_template=settings.chat_template,
            max_length=settings.max_length,
        ),
    )
