"""Small files a run keeps beside its checkpoints, under ``<storage_path>/<run_name>/``.

Written by rank 0 of the training workers and read by the driver: the attempt counter of each
`run_training` call (its launch id) and the run summary. ``run.json`` (written by the driver)
records what the run trains, so that a new run cannot silently reuse another run's folder.
Each file is written to a temporary name and renamed: a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from typing import Any

_META = ".ray_trainer"


class RunFiles:
    def __init__(self, run_dir: str, launch_id: str = "") -> None:
        self.run_dir = run_dir
        self.launch_id = launch_id
        self.meta_dir = os.path.join(run_dir, _META)

    def bump_attempt(self) -> int:
        """Count one more start of the worker group for this launch; return its attempt index."""
        path = os.path.join(self.meta_dir, f"attempts-{self.launch_id}")
        previous = int(_read(path) or -1)
        _write(path, str(previous + 1))
        return previous + 1

    def attempts(self) -> int:
        value = _read(os.path.join(self.meta_dir, f"attempts-{self.launch_id}"))
        return int(value) + 1 if value else 0

    def write_summary(self, summary: dict[str, Any]) -> None:
        _write(os.path.join(self.meta_dir, f"summary-{self.launch_id}.json"), json.dumps(summary))

    def read_summary(self) -> dict[str, Any] | None:
        raw = _read(os.path.join(self.meta_dir, f"summary-{self.launch_id}.json"))
        return json.loads(raw) if raw else None

    def read_run_record(self) -> dict[str, Any] | None:
        raw = _read(os.path.join(self.run_dir, "run.json"))
        return json.loads(raw) if raw else None

    def write_run_record(self, record: dict[str, Any]) -> None:
        _write(os.path.join(self.run_dir, "run.json"), json.dumps(record, indent=1, sort_keys=True))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)
