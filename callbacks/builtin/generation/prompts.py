"""Runs in the driver (``GenerationEval``'s construction): the prompts as checked rows.

A list of prompts, or a JSONL, JSON, CSV or Parquet file of them (local, or a URI read with
``pyarrow.fs``), becomes rows ``{"row", "prompt", "messages", "reference"}``; a chat row of
training data (its last turn the assistant's) is asked without that turn, its reference.
Bad rows are refused with the row named.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["read_rows", "reference_of"]

DATA_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")


def read_rows(prompts: Any) -> list[dict[str, Any]]:
    """The prompts as rows ``{"row", "prompt", "messages", "reference"}``, checked."""
    if isinstance(prompts, (str, os.PathLike)):
        path = os.fspath(prompts)
        raw, where = _read_file(path), lambda i: f"{path}, row {i}"
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, dict)):
        raw, where = list(prompts), lambda i: f"prompts[{i}]"
    else:
        raise TypeError(
            "GenerationEval: prompts must be a list of prompts or the path of a JSONL, JSON, CSV "
            f"or Parquet file, got {type(prompts).__name__}"
        )
    if not raw:
        raise ValueError("GenerationEval: no prompts; give at least one prompt")
    return [_row(i, item, where(i)) for i, item in enumerate(raw)]


def _row(i: int, item: Any, where: str) -> dict[str, Any]:
    row: dict[str, Any] = {"row": i, "prompt": None, "messages": None, "reference": None}
    if isinstance(item, str):
        row["prompt"] = item
    elif isinstance(item, list):
        row["messages"] = _messages(item, where)
    elif isinstance(item, dict):
        prompt, messages = item.get("prompt"), item.get("messages")
        if isinstance(prompt, list):
            prompt, messages = None, prompt
        if isinstance(messages, str):  # a CSV cell or a JSON-encoded column
            messages = _json_cell(messages, where, "messages") if messages else None
        if messages is not None:
            messages = _messages(messages, where)
            reference = reference_of(item.get("reference"), f"{where}: reference")
            if reference is None and messages and messages[-1]["role"] == "assistant":
                # A chat row of training data: its last answer is the reference, not sent.
                reference, messages = messages[-1]["content"], messages[:-1]
            row["messages"], row["reference"] = messages, reference
        elif isinstance(prompt, str) and prompt:
            row["prompt"] = prompt
            row["reference"] = reference_of(item.get("reference"), f"{where}: reference")
        else:
            raise ValueError(
                f"GenerationEval: {where} has neither a 'prompt' (text) nor 'messages' (a list of "
                f"chat messages), keys {sorted(item)}; give each row one of them"
            )
    else:
        raise TypeError(
            f"GenerationEval: {where} is a {type(item).__name__}; a prompt is a string, a list "
            "of chat messages, or a dict with 'prompt' or 'messages'"
        )
    if row["messages"] is not None and not row["messages"]:
        raise ValueError(f"GenerationEval: {where} has no messages before the answer")
    if row["prompt"] is not None and not row["prompt"]:
        raise ValueError(f"GenerationEval: {where} is an empty prompt")
    return row


def _messages(value: Any, where: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok:
        raise ValueError(
            f"GenerationEval: {where}: messages must be a list of "
            '{"role": ..., "content": ...} dicts with text content'
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def reference_of(value: Any, where: str) -> str | list[str] | None:
    if value is None or isinstance(value, str):
        return value or None  # an empty CSV cell: no reference
    if isinstance(value, float) and math.isnan(value):  # an empty CSV/Parquet cell
        return None
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(value, (int, float)):
        return str(value)
    raise ValueError(
        f"GenerationEval: {where} must be a string or a list of accepted strings, got {value!r}"
    )


def _json_cell(text: str, where: str, column: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"GenerationEval: {where}: the {column!r} cell is not a JSON list of messages ({e})"
        ) from e


def _read_file(path: str) -> list[Any]:
    """The rows of a JSONL, JSON, CSV or Parquet file (local, or a URI read with pyarrow.fs)."""
    suffix = os.path.splitext(path.rstrip("/"))[1].lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(
            f"GenerationEval: {path}: prompts files are {', '.join(DATA_SUFFIXES)}; got "
            f"{suffix or 'no suffix'}"
        )
    data = _read_bytes(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(io.BytesIO(data)).to_pylist()
    text = data.decode("utf-8-sig")
    if suffix == ".csv":
        return list(csv.DictReader(io.StringIO(text)))
    if suffix == ".json":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"GenerationEval: {path}: not JSON ({e})") from e
        if not isinstance(value, list):
            raise ValueError(f"GenerationEval: {path}: a JSON prompts file holds a list of rows")
        return value
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"GenerationEval: {path}:{lineno}: not a JSON object ({e})") from e
    return rows


def _read_bytes(path: str) -> bytes:
    if "://" in path:
        import pyarrow.fs

        fs, inner = pyarrow.fs.FileSystem.from_uri(path)
        with fs.open_input_stream(inner) as f:
            return f.read()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GenerationEval: prompts file {path} does not exist")
    with open(path, "rb") as f:
        return f.read()
