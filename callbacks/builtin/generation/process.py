"""Runs in the eval task (or the evaluator actor, or the rollout actor): the generation child as a subprocess.

`ChildProcess` starts the generation child (``child/run_generation_child.py``) under a given
interpreter (``python=``, a vLLM
environment's) and speaks its JSON-lines protocol: one request line, one answer line, each
waited for at most ``timeout_s``. The child leads a process group of its own and is told by the
kernel when the process that started it dies (``die_with_parent``), so it ends its engine's
processes with it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import queue
import subprocess
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from callbacks.builtin.common import die_with_parent

__all__ = ["CHILD", "CHILD_ROOT", "ChildDied", "ChildProcess"]

#: The folder the child's interpreter gets on its path: the ``generation_child`` package (which
#: imports nothing of ``callbacks``) and its launcher, nothing else.
CHILD_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child")
#: The generation program's launcher, run as a plain file: its folder is ``CHILD_ROOT``.
CHILD = os.path.join(CHILD_ROOT, "run_generation_child.py")
#: Lines of the child's stderr kept for an error message.
_STDERR_LINES = 40


class ChildDied(RuntimeError):
    """The generation subprocess ended before it answered."""


class ChildProcess:
    """The generation child as a subprocess of `python`, spoken to in JSON lines.

    Runs in the evaluation task (or the rollout actor: the ``"vllm"`` rollout engine). Each request waits at most `timeout_s` for its answer; then
    the subprocess is killed and the error holds the last lines of its stderr. ``close`` (always
    called, also after an error) asks it to exit and kills it when it does not.
    """

    def __init__(self, python: str, timeout_s: float, who: str = "GenerationEval") -> None:
        self.python = python
        self.timeout_s = timeout_s
        self.who = who  # whose child it is, for the errors
        self.stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._answers: queue.Queue[str | None] = queue.Queue()
        try:
            self.process = subprocess.Popen(
                [python, CHILD],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                bufsize=1,
                start_new_session=True,  # its own group: killed with whatever it started
                preexec_fn=die_with_parent,  # and told when this process dies (Ctrl-C, a kill)
            )
        except OSError as e:
            raise RuntimeError(
                f"{who}: cannot start {python} on this node ({e}); python= must be an "
                "interpreter on every node that runs the child"
            ) from e
        readers = [(self.process.stdout, self._answers.put), (self.process.stderr, None)]
        self._readers = [
            threading.Thread(target=self._read, args=reader, daemon=True) for reader in readers
        ]
        for thread in self._readers:
            thread.start()

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send `request`; its answer, or an error after `timeout_s` or when the child died."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except OSError:  # a broken pipe: it has ended
            self._raise(
                f"exited with code {self._exit_code()} before it read the request", ChildDied
            )
        try:
            line = self._answers.get(timeout=self.timeout_s)
        except queue.Empty:
            self.kill()
            self._raise(f"did not answer within timeout_s={self.timeout_s:g} s; killed")
        if line is None:
            self._raise(f"exited with code {self._exit_code()}", ChildDied)
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._raise(f"wrote a line that is not JSON: {line[:200]!r}")

    def close(self) -> None:
        """Ask the child to exit; kill it (and its group) if it has not within 10 s."""
        if self.process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.process.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()

    def kill(self) -> None:
        """Kill the child's process group (vLLM's engine processes with it) and reap it."""
        import signal

        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def _read(self, stream: Any, sink: Callable[[str | None], None] | None) -> None:
        for line in stream:
            if sink is not None:
                sink(line)
            else:
                self.stderr.append(line.rstrip("\n"))
        if sink is not None:
            sink(None)

    def _exit_code(self) -> int | None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        return self.process.returncode

    def _raise(self, what: str, kind: type[RuntimeError] = RuntimeError) -> NoReturn:
        if self.process.poll() is not None:  # it ended: its last words are on their way
            self._readers[1].join(timeout=5)
        tail = "\n".join(self.stderr) or "(nothing)"
        raise kind(
            f"{self.who}: the generation subprocess ({self.python} {CHILD}) {what}; its "
            f"stderr ends:\n{tail}"
        )
