"""Runs anywhere a built-in hook runs (usually the callback actor): their shared helpers.

The run directory, number formatting, JSON safety: pure functions.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

__all__ = [
    "as_float",
    "die_with_parent",
    "json_safe",
    "resolve_stream",
    "run_dir_of",
    "stream_state",
    "throughput_of",
]


def run_dir_of(context: Any) -> str | None:
    """``<storage_path>/<run_name>`` from ``context.args`` (and ``context.run_name``), or None.

    Contexts of ``EvalOnSave`` results carry no ``args``: callbacks remember the directory from
    an earlier event (``on_train_begin``, ``on_log``).
    """
    args = getattr(context, "args", None) or {}
    storage = args.get("storage_path")
    name = getattr(context, "run_name", None) or args.get("run_name")
    if not storage or not name:
        return None
    return os.path.join(os.path.expanduser(str(storage)), str(name))


def throughput_of(context: Any) -> Any:
    """Tokens/s of the step: `context.throughput`, else the `tokens_per_s` of `batch_metrics`."""
    if context.throughput is not None:
        return context.throughput
    return (context.batch_metrics or {}).get("tokens_per_s")


def objective_metrics(context: Any) -> dict[str, float]:
    """The objective's own numbers among a log's ``batch_metrics``: those its description
    names, listed in the run's args (``args["objective_metrics"]``: DPO's are TRL's,
    ``rewards/chosen``, ..., ``logps/rejected``; SFT has none)."""
    logged = getattr(context, "batch_metrics", None) or {}
    names = (getattr(context, "args", None) or {}).get("objective_metrics") or ()
    return {k: float(logged[k]) for k in names if isinstance(logged.get(k), (int, float))}


def as_float(value: Any) -> float | None:
    """``float(value)`` for numbers (bool, int, float, numpy/torch scalars); None otherwise."""
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def json_safe(value: Any) -> Any:
    """A value ``json.dumps(..., allow_nan=False)`` accepts: non-finite floats become the
    strings ``"nan"``, ``"inf"``, ``"-inf"``; scalars with ``__float__`` become floats; other
    objects their ``str``."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    number = as_float(value)
    return json_safe(number) if number is not None else str(value)


def stream_state(stream: Any) -> Any:
    """What to pickle for an output stream: ``sys.stdout``/``sys.stderr`` by name (they are
    resolved again where the callback runs), anything else as is."""
    import sys

    if stream is not None and stream in (sys.stdout, sys.__stdout__):
        return "stdout"
    if stream is not None and stream in (sys.stderr, sys.__stderr__):
        return "stderr"
    return stream


def resolve_stream(stream: Any) -> Any:
    """The stream to write to now: ``None`` is the current ``sys.stdout``."""
    import sys

    if stream is None or stream == "stdout":
        return sys.stdout
    if stream == "stderr":
        return sys.stderr
    return stream


def die_with_parent() -> None:
    """A subprocess's ``preexec_fn``: on Linux it gets SIGTERM when the process that started it
    dies (a cancelled evaluation task, a killed evaluator actor, Ctrl-C), so no engine is left
    behind (the generation child then ends its whole process group)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
