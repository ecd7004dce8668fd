"""Driver, prep tasks and workers: JSONL text data, validated in the driver, tokenized in the workers.

Runs in two places: :func:`validate_jsonl` in the driver, before any Ray resource is requested,
so that a bad file fails the run at once with the file and line; :class:`JsonlTextDataset` and
:func:`collate_batch` in each training worker (and its DataLoader). Nothing here imports Ray.

A line is one JSON object, either ``{"text": "..."}`` (loss on every token) or
``{"prompt": "...", "completion": "..."}`` (loss on the completion only). Items follow the
common convention of the training loop: ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}``
with labels aligned to the inputs (the model shifts them) and ``-100`` where no loss is taken.
"""

from __future__ import annotations

import io
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

from ray_trainer._data.chat import json_type as _json_type

IGNORE_INDEX = -100
_UTF8_BOM = b"\xef\xbb\xbf"
_EXAMPLE = '{"text": "..."}'
_MAX_REPORTED = 3


class DataFileError(ValueError):
    """A data file that is missing or malformed; the message names the file, the line and the fix."""


class ByteTokenizer:
    """Byte-level tokenizer: the 256 UTF-8 byte values, then pad (256) and eos (257).

    The fallback for JSONL data when no Hugging Face tokenizer is given; it needs no vocabulary
    file and can encode any text. Same interface as the demo's ``CharTokenizer``.

    Example:
        >>> tok = ByteTokenizer()
        >>> tok.decode(tok.encode("héllo", add_eos=True))
        'héllo'
    """

    pad_id = 256
    eos_id = 257
    vocab_size = 258

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text``, then ``eos_id`` if ``add_eos``."""
        ids = list(text.encode("utf-8"))
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 is replaced, pad and eos are dropped or shown."""
        out, raw = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            if not skip_special_tokens:
                out.append("<pad>" if i == self.pad_id else "<eos>" if i == self.eos_id else "<?>")
        out.append(raw.decode("utf-8", errors="replace"))
        return "".join(out)


def validate_jsonl(path: str | os.PathLike[str], text_field: str = "text") -> int:
    """Check every line of a JSONL data file and return the number of records.

    Runs in the driver before Ray starts; needs no tokenizer. Raises :class:`DataFileError`
    naming the file, the first bad line and the fix (and how many other lines are bad), and
    when every record's text is empty (nothing to learn from).
    """
    records = _read_records(path, text_field)
    if all(not _record_text(record, text_field) for _, record in records):
        raise DataFileError(
            f"{path}: all {len(records)} record(s) have empty text (nothing to train on); "
            f"fill the {text_field!r} (or 'prompt'/'completion') fields"
        )
    return len(records)


def _record_text(record: dict, text_field: str) -> str:
    if text_field in record:
        return record[text_field]
    return record.get("prompt", "") + record.get("completion", "")


def _read_records(
    path: str | os.PathLike[str], text_field: str, content: bytes | None = None
) -> list[tuple[int, dict]]:
    """(line number, record) for every non-blank line; raises DataFileError on any bad line.

    The file is read through the run's storage layer (a local path or a URI such as
    ``s3://bucket/train.jsonl``), unless its ``content`` was shipped by the driver.
    """
    data = content if content is not None else read_data_file(path)
    records: list[tuple[int, dict]] = []
    errors: list[str] = []
    if data.startswith(_UTF8_BOM):  # as editors on Windows write it
        data = data[len(_UTF8_BOM) :]
    for lineno, raw in enumerate(io.BytesIO(data), start=1):
        try:
            record = _parse_line(raw, text_field)
        except _LineError as e:
            errors.append(f"{path}:{lineno}: {e}")
            continue
        if record is not None:
            records.append((lineno, record))
    if errors:
        more = len(errors) - 1
        tail = f" ({more} more bad line{'s' if more > 1 else ''}, e.g. {errors[1]})" if more else ""
        raise DataFileError(errors[0] + tail)
    if not records:
        raise DataFileError(
            f"{path}: the file is empty (no JSON records); "
            f"write one JSON object per line, like {_example(text_field)}"
        )
    return records


def read_data_file(path: str | os.PathLike[str]) -> bytes:
    """The bytes of a data file: a local path or a URI, read through the storage layer."""
    from ray_trainer._storage import is_uri, locate

    path = os.fspath(path)
    location = locate(path)
    info = location.size()
    if info is None:
        if location.is_dir():
            raise DataFileError(f"{path}: is not a file; give the path of a JSONL file")
        if is_uri(path):
            raise DataFileError(
                f"{path}: no such object; check the bucket and key (and the credentials and "
                "endpoint this process uses, e.g. AWS_ENDPOINT_URL)"
            )
        raise DataFileError(
            f"{path}: data file does not exist (resolved to {Path(path).expanduser().resolve()}); "
            "check the path (a relative path means the folder the driver runs in)"
        )
    return location.read_bytes()


def data_file_size(path: str) -> int | None:
    """The size of a data file in bytes (None when it does not exist), through storage."""
    from ray_trainer._storage import locate

    return locate(path).size()


class _LineError(Exception):
    pass


def _example(text_field: str) -> str:
    return _EXAMPLE if text_field == "text" else json.dumps({text_field: "..."})


def _parse_line(raw: bytes, text_field: str) -> dict | None:
    """The record of one line (None for a blank line), or _LineError saying what is wrong."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _LineError(
            f"not valid UTF-8 ({e.reason} at byte {e.start}); save the file as UTF-8"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(
            f"invalid JSON ({e.msg}: line {e.lineno} column {e.colno}); "
            f"each line must be one JSON object like {_example(text_field)}"
        ) from None
    if not isinstance(record, dict):
        raise _LineError(
            f"expected a JSON object, got a JSON {_json_type(record)}; "
            f"each line must be one JSON object like {_example(text_field)}"
        )
    found = ", ".join(repr(k) for k in record) or "none"
    if text_field in record:
        fields = (text_field,)
    elif "prompt" in record or "completion" in record:
        fields = ("prompt", "completion")
        missing = [f for f in fields if f not in record]
        if missing:
            raise _LineError(
                f"missing field {missing[0]!r} (found keys: {found}); a prompt/completion record "
                'needs both, like {"prompt": "...", "completion": "..."}'
            )
    else:
        raise _LineError(
            f"missing field {text_field!r} (found keys: {found}); each line needs "
            f'{_example(text_field)} or {{"prompt": "...", "completion": "..."}}'
            + ("" if text_field != "text" else "; set text_field to use another key")
        )
    for f in fields:
        if not isinstance(record[f], str):
            raise _LineError(f"field {f!r} must be a string, got a JSON {_json_type(record[f])}")
    return record


class _Encoder:
    """One interface over our tokenizers (``encode(text, add_eos)``) and Hugging Face ones."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.is_hf = hasattr(tokenizer, "eos_token_id") and not hasattr(tokenizer, "eos_id")
        if self.is_hf:
            self.eos_id = tokenizer.eos_token_id
            pad = tokenizer.pad_token_id
            self.pad_id = pad if pad is not None else (self.eos_id or 0)
        else:
            self.eos_id = tokenizer.eos_id
            self.pad_id = tokenizer.pad_id

    def encode(self, text: str, first: bool) -> list[int]:
        if self.is_hf:
            # Special tokens (e.g. a BOS) only at the start of the sequence.
            return list(self.tok(text, add_special_tokens=first)["input_ids"])
        return self.tok.encode(text)


class JsonlTextDataset(Dataset):
    """Tokenized records of a JSONL file, each truncated to ``max_length`` tokens.

    The whole file is read, validated (see :func:`validate_jsonl`) and tokenized at construction,
    in the process that builds the dataset (each training worker). Every sequence ends with EOS
    (if the tokenizer has one) unless truncated. Items have different lengths: batch them with
    :func:`collate_batch` (or ``dataset.collate``).

    Args:
        path: the JSONL file.
        tokenizer: a Hugging Face tokenizer, or an object with ``encode(text)``, ``eos_id`` and
            ``pad_id``; ``None`` for :class:`ByteTokenizer`.
        max_length: the longest item, in tokens.
        text_field: the key of the text in ``{"text": ...}`` records.
        content: the file's bytes when the driver shipped them (the path then only names it).

    Example:
        >>> ds = JsonlTextDataset("train.jsonl", tokenizer=None, max_length=256)  # doctest: +SKIP
        >>> batch = ds.collate([ds[0], ds[1]])  # doctest: +SKIP
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        tokenizer: Any = None,
        max_length: int = 512,
        text_field: str = "text",
        content: bytes | None = None,
    ) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2, got {max_length}")
        self.path = str(path)
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        self.max_length = max_length
        self.text_field = text_field
        enc = _Encoder(self.tokenizer)
        self.pad_id: int = enc.pad_id
        self.eos_id: int | None = enc.eos_id
        self._items: list[tuple[torch.Tensor, torch.Tensor]] = []
        no_loss: list[int] = []
        records = _read_records(path, text_field, content)
        record_texts = [_record_text(record, text_field) for _, record in records]
        for lineno, record in records:
            if text_field in record:
                prompt: list[int] = []
                answer = enc.encode(record[text_field], first=True)
            else:
                prompt = enc.encode(record["prompt"], first=True)
                answer = enc.encode(record["completion"], first=not prompt)
            if self.eos_id is not None:
                answer.append(self.eos_id)
            ids = (prompt + answer)[:max_length]
            labels = ([IGNORE_INDEX] * len(prompt) + answer)[:max_length]
            # The model predicts position t from positions < t: position 0 never takes loss.
            if all(x == IGNORE_INDEX for x in labels[1:]):
                no_loss.append(lineno)
            self._items.append((torch.tensor(ids), torch.tensor(labels)))
        if len(no_loss) == len(self._items):
            if not any(record_texts):
                raise DataFileError(
                    f"{path}: all {len(self._items)} record(s) have empty text (nothing to "
                    f"train on); fill the {text_field!r} (or 'prompt'/'completion') fields"
                )
            raise DataFileError(
                f"{path}: no record has a token to learn from within max_length={max_length} "
                "(the prompts fill it); raise max_length or shorten the prompts"
            )
        if no_loss:
            lines = ", ".join(map(str, no_loss[:_MAX_REPORTED]))
            warnings.warn(
                f"{path}: {len(no_loss)} record(s) (lines {lines}"
                f"{', ...' if len(no_loss) > _MAX_REPORTED else ''}) have no completion token "
                f"within max_length={max_length} and take no loss; raise max_length",
                stacklevel=2,
            )

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self._items[i]
        return {"input_ids": ids, "labels": labels}

    def collate(self, items: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """:func:`collate_batch` with this dataset's pad id."""
        return collate_batch(items, self.pad_id)


def collate_batch(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack variable-length items into a right-padded batch with an ``attention_mask``.

    ``input_ids`` are padded with ``pad_id``, ``labels`` with ``-100`` (no loss on padding) and
    the attention mask is 1 on real tokens, 0 on padding (an item's own ``attention_mask`` is
    kept). Other keys are batched by torch's ``default_collate``. Runs in the DataLoader of
    each training worker.
    """
    if not items:
        raise ValueError("collate_batch needs at least one item")
    ids = [torch.as_tensor(it["input_ids"], dtype=torch.long) for it in items]
    for it, x in zip(items, ids, strict=True):
        if x.dim() != 1:
            raise ValueError(f"input_ids must be 1-D per item, got shape {tuple(x.shape)}")
        if "labels" in it and len(it["labels"]) != len(x):
            raise ValueError(
                f"labels ({len(it['labels'])}) and input_ids ({len(x)}) differ in length"
            )
    width = max(len(x) for x in ids)
    batch_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (it, x) in enumerate(zip(items, ids, strict=True)):
        n = len(x)
        batch_ids[row, :n] = x
        labels[row, :n] = torch.as_tensor(it.get("labels", x), dtype=torch.long)
        if "attention_mask" in it:
            mask[row, :n] = torch.as_tensor(it["attention_mask"], dtype=torch.long)
        else:
            mask[row, :n] = 1
    batch = {"input_ids": batch_ids, "labels": labels, "attention_mask": mask}
    rest = [k for k in items[0] if k not in batch]
    if rest:
        batch.update(default_collate([{k: it[k] for k in rest} for it in items]))
    return batch
