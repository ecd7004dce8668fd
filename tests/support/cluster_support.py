"""Helpers shared by the unit tests of `ray-trainer submit` / `status` (no Ray, no cluster)."""

from __future__ import annotations

import socket
from pathlib import Path


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path, extra: str = "") -> Path:
    """A small valid run config `run.yaml` in `folder`."""
    path = folder / "run.yaml"
    path.write_text(f"max_steps: 10\nnum_workers: 2\n{extra}")
    return path
