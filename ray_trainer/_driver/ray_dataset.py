"""Driver: a ``ray.data.Dataset`` as a run's data, read and encoded by Ray Data itself.

Ray users keep their data in Ray Datasets (``ray.data.read_parquet("s3://...")``, the output of
``ray.data.llm`` batch inference). :class:`RayDatasets` is their source kind, registered beside
the files' in ``data.py``:

- `resolve`: the format from the dataset's first record (``limit(1)``: Ray Data reads only what
  that record needs), the fingerprint from its plan (``run_fingerprint.ray_dataset_digest``:
  the files it reads by name, size and modification time, its blocks in memory by content, its
  functions by code), so that a second run on the same dataset reuses the token cache without
  reading the data;
- `check`: nothing before encoding: every record is checked as it is encoded, in one pass (a
  pass of checks first would read the whole dataset twice);
- `build`: one ``map_batches`` pass. Each task gets a batch of at most ``PIECE_RECORDS``
  consecutive records as a pyarrow Table, checks them as a file's are checked and encodes them
  with the pipeline's own encoders (``_data/batches.py``) into one piece of the token cache,
  written by the task, named by its content. The driver reads the tasks' small results (a
  piece's name and two int32 numbers per sample) in the dataset's order and gives each piece
  its place: ``preserve_order`` is set on the dataset's execution options for the pass (and
  put back after), so the same dataset gives the same samples in the same order, and split
  invariance and exact resume hold as for files. The driver never holds a record.
- `prompts`: the same pass for GRPO's prompt-only records, tokenized by the tasks and kept by
  the driver, as a file's are.

A bad record stops the pass at its batch: the error names its row in the dataset
(``data (a ray.data.Dataset)[17]``), the field and the fix, and the pieces written so far are
deleted with the incomplete cache folder, before any worker starts and before the run folder is
written.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._config.rules import is_ray_dataset
from ray_trainer._data.batches import BatchResult, encode_batch, encode_prompt_batch
from ray_trainer._data.cache import PieceResult
from ray_trainer._data.chat import RecordError
from ray_trainer._data.preference import pair_format
from ray_trainer._data.prepare import EncodeSettings
from ray_trainer._data.prompts import PromptEncoder, prompt_format
from ray_trainer._data.records import check_some_text, first_bad
from ray_trainer._data.sources import (
    PIECE_RECORDS,
    DataFileError,
    Source,
    _drop_nulls,
    detect_format,
)
from ray_trainer._driver.run_fingerprint import ray_dataset_digest
from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import Location

#: How the first record's format is told, for the formats whose records must all share it.
_FIRST_FORMAT: dict[str, Callable[[Any], str]] = {
    "preference": pair_format,
    "prompts": prompt_format,
}


class RayDatasets:
    """The source kind of ``ray.data.Dataset`` objects (see the module's docstring). Runs in
    the driver; its passes run as Ray Data's tasks, wherever the cluster has CPUs."""

    def takes(self, value: Any) -> bool:
        return is_ray_dataset(value)

    def resolve(self, value: Any, field: str, text_field: str) -> Source:
        """The dataset's columns, format and fingerprint, from its first record and its plan."""
        name = f"{field} (a ray.data.Dataset)"
        try:  # what `take_batch(1)` does, without its error for an empty dataset
            batches = value.limit(1).iter_batches(batch_size=1, batch_format="pyarrow")
            batch = next(iter(batches), None)
        except Exception as e:  # a read that fails in Ray Data's tasks (a bucket, a path)
            raise TrainingArgsError(
                f"{name}: Ray Data could not read its first record ({_last_line(e)}); check "
                "what the dataset reads and this cluster's access to it"
            ) from e
        rows = [] if batch is None else batch.to_pylist()
        if not rows:
            raise DataFileError(f"{name} holds no records; check what it reads")
        first = _drop_nulls(rows[0])
        fmt = detect_format(name, list(batch.column_names), first, text_field)
        digest, covered = ray_dataset_digest(value)
        return Source(
            field, name, [], fmt, list(batch.column_names), fingerprint=f"ray-dataset:{digest}",
            first=first, pair_format=_first_format(fmt, first), stable=covered, dataset=value,
        )  # fmt: skip

    def check(self, source: Source, args: TrainingArgs) -> None:
        """Nothing here: `build` checks every record as it encodes it (one pass, not two)."""

    def prompts(self, source: Source, encoder: PromptEncoder, args: TrainingArgs) -> list[Any]:
        """Every prompt-only record checked and tokenized by Ray Data's tasks, in order."""
        task = functools.partial(_prompt_task, source=_bare(source), encoder=encoder)
        encoded: list[Any] = []
        for _, result in _in_order(source, task):
            encoded.extend(result.prompts or [])
        return encoded

    def build(
        self, source: Source, settings: EncodeSettings, cache: Location, args: TrainingArgs
    ) -> list[PieceResult]:
        """Encode every record into the token cache at `cache` (one ``map_batches`` pass);
        returns the pieces' results in the dataset's order, each given its place."""
        task = functools.partial(
            _encode_task, source=_bare(source), settings=settings, cache=cache.name,
            filesystem=args.storage_filesystem,
        )  # fmt: skip
        results: list[PieceResult] = []
        some_text = False
        try:
            for row, result in _in_order(source, task):
                piece = result.piece
                assert piece is not None  # `_in_order` stops at a batch with a bad record
                where = [f"{source.name}[{row + int(w)}]" for w in piece.dropped_where]
                results.append(dataclasses.replace(piece, index=len(results), dropped_where=where))
                some_text = some_text or result.some_text
            source.records = sum(r.records for r in results)
            check_some_text(source, source.records, some_text, settings.text_field)
        except DataFileError:
            cache.delete()  # nothing half-written: no meta.json was, the pieces go too
            raise
        return results


def _in_order(source: Source, task: Callable[[Any], BatchResult]) -> Iterator[tuple[int, Any]]:
    """(first row, result) of each batch of a ``map_batches`` pass of `task` over the dataset,
    in the dataset's order; a batch with a bad record ends the pass with its error."""
    out = source.dataset.map_batches(
        _Batches(task), batch_format="pyarrow", batch_size=PIECE_RECORDS, zero_copy_batch=True
    )
    options = out.context.execution_options  # shared with the user's dataset: put back after
    kept, options.preserve_order = options.preserve_order, True
    rows = iter(out.iter_rows())
    try:
        start = 0
        for item in rows:
            result: BatchResult = pickle.loads(item["result"])
            if result.errors:
                raise _bad_batch(source, start, result)
            yield start, result
            start += result.records
    finally:
        close = getattr(rows, "close", None)
        if close is not None:  # ends Ray Data's execution when the pass stops early
            close()
        options.preserve_order = kept


class _Batches:
    """Ray Data's task function: a batch (a pyarrow Table) in, its pickled result out, one row
    per batch (so that the driver reads one small row per piece)."""

    def __init__(self, task: Callable[[Any], BatchResult]) -> None:
        self.task = task

    def __call__(self, table: Any) -> dict[str, list[bytes]]:
        return {"result": [pickle.dumps(self.task(table), protocol=5)]}


def _encode_task(
    table: Any, *, source: Source, settings: EncodeSettings, cache: str, filesystem: Any
) -> BatchResult:
    """A Ray Data task (on any node): one batch checked and encoded into the cache."""
    return encode_batch(table, source, settings, cache, filesystem)


def _prompt_task(table: Any, *, source: Source, encoder: PromptEncoder) -> BatchResult:
    """A Ray Data task (on any node): one batch of prompt-only records checked and tokenized."""
    return encode_prompt_batch(table, source, encoder)


def _bad_batch(source: Source, start: int, result: BatchResult) -> DataFileError:
    """The refusal of a batch with bad records: the first, named by its row in the dataset,
    and how many more the batch holds."""
    errors = [f"{source.name}[{start + row}]: {why}" for row, why in result.errors]
    checked = f"rows {start}-{start + result.records - 1}"
    return DataFileError(
        f"{first_bad(errors)} (found while encoding {checked}; the records after them were "
        "not checked)"
    )


def _bare(source: Source) -> Source:
    """The source as the tasks get it: without the dataset (Ray Data hands them its records)."""
    return dataclasses.replace(source, dataset=None)


def _first_format(fmt: str, first: dict[str, Any]) -> str | None:
    """The format of the first record, which every record of a preference or prompt-only
    source must share (None for other formats, and for a bad first record: its batch names
    it)."""
    tell = _FIRST_FORMAT.get(fmt)
    if tell is None:
        return None
    try:
        return tell(first)
    except RecordError:
        return None


def _last_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__
