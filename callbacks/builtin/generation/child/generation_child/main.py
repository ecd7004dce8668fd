"""Runs in the generation subprocess: the JSON-lines loop, and the process group that ends with it."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from .rollout import remove_at_exit
from .session import Session


def _end_group_on_sigterm() -> None:
    """The parent died (its ``PR_SET_PDEATHSIG`` is SIGTERM) or someone asks it to end: this
    process leads its own group (``start_new_session``), so the whole group goes, vLLM's engine
    processes with it, and no engine outlives the evaluation that started it."""
    import signal

    def end(signum: int, frame: Any) -> None:
        remove_at_exit()  # a rollout engine's folders: its actor may have been killed
        _kill_own_group()
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, end)


def _kill_own_group() -> None:
    """SIGKILL to this process's group, itself included, when it leads one (as a child of
    ``ChildProcess`` does): nothing it started outlives it."""
    import signal

    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)


class Wire:
    """The JSON-lines wire: requests read from `lines`, responses written to `protocol`. A paused
    rollout sample (``rollout.RolloutLLM``) reads and answers the requests that come while it
    is paused through it too."""

    def __init__(self, lines: Any, protocol: Any) -> None:
        self.lines = lines
        self.protocol = protocol

    def read(self) -> dict[str, Any] | None:
        """The next request (None: the input ended); a line that is not JSON is answered with
        an error here and skipped."""
        for line in self.lines:
            if not line.strip():
                continue
            try:
                return json.loads(line)
            except ValueError as exc:
                self.write({"ok": False, "kind": "error", "error": f"not a JSON line: {exc}"})
        return None

    def write(self, response: dict[str, Any]) -> None:
        self.protocol.write(json.dumps(response) + "\n")
        self.protocol.flush()


def main() -> int:
    """Runs in the generation subprocess: one response line per request line until EOF/exit."""
    _end_group_on_sigterm()
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
    os.dup2(2, 1)  # fd 1 (and so print, C libraries, engine processes) now writes to stderr
    wire = Wire(sys.stdin, protocol)
    session = Session(wire)
    asked_to_exit = False
    try:
        while (request := wire.read()) is not None:
            wire.write(session.handle(request))
            if isinstance(request, dict) and request.get("op") == "exit":
                asked_to_exit = True
                break
    finally:
        session.close()
    if not asked_to_exit:
        # Its input ended without an "exit": the parent is gone. Its death's SIGTERM may come
        # after this EOF, too late to run the handler above: the group goes here instead.
        remove_at_exit()
        _kill_own_group()
    return 0
