"""Runs on the callback actor: ``ProgressBar``, a progress line per log and a final summary."""

from __future__ import annotations

import datetime
import time
from collections import deque
from typing import Any

from callbacks._callback import TrainerCallback
from callbacks.builtin.common import as_float, resolve_stream, stream_state

__all__ = ["ProgressBar"]

#: How many recent logs the step rate (and so the ETA) is measured over.
RATE_WINDOW = 10
#: The rate from arrival times needs this much time between the oldest and newest log in the
#: window: actor-side events arrive in batches, so a shorter span is mostly batching jitter.
MIN_RATE_SPAN_S = 1.0


class ProgressBar(TrainerCallback):
    """Print training progress: a line per log, per evaluation, and a summary at the end.

    Runs on the callback actor (``runs_on="actor"``): its output goes to the actor's stdout,
    which Ray forwards to the driver and to ``ray job logs``. A log line reads::

        [run] step 120/1000 (12%) loss 1.2345 lr 3.0e-04 1,234 tok/s ETA 0:02:13

    (fields without a value are left out; a GRPO run adds ``engines N``, its rollout engines
    serving, before the ETA). On a TTY the log line is redrawn in place with
    ``\\r``; anywhere else (a file, a pipe, Ray's log forwarding) every line is a plain line.
    The ETA comes from the step rate over the last ``RATE_WINDOW`` logs, measured on their
    arrival times when they span at least ``MIN_RATE_SPAN_S`` (events reach the actor in
    batches), else from the average step time of those logs.

    Args:
        every_n_logs: print every n-th ``on_log`` (the first is always printed); evaluations
            and the summary are always printed.
        stream: where to write (default: ``sys.stdout`` of the process it runs in).

    Example:
        >>> run_training(log_every_steps=10, callbacks=[ProgressBar(every_n_logs=5)])
    """

    def __init__(self, every_n_logs: int = 1, stream: Any = None) -> None:
        if not isinstance(every_n_logs, int) or every_n_logs < 1:
            raise ValueError(f"ProgressBar: every_n_logs must be an int >= 1, got {every_n_logs!r}")
        self.every_n_logs = every_n_logs
        self.stream = stream
        self._clock = time.monotonic
        self._reset()

    def _reset(self) -> None:
        self._logs = 0
        self._recent: deque[tuple[float, int, float | None]] = deque(maxlen=RATE_WINDOW)
        self._started: float | None = None
        self._open_line = 0  # length of a TTY line being redrawn (0: none)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["stream"] = stream_state(self.stream)
        return state

    # -- hooks -------------------------------------------------------------------------------

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor before the first step of each attempt."""
        if self._started is None:  # the summary counts from the first attempt
            self._started = self._clock()
        self._recent.clear()  # a restart resumes from an earlier step: a new rate

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor at each log: prints the progress line."""
        now = self._clock()
        if self._started is None:
            self._started = now
        self._recent.append((now, context.global_step, as_float(context.elapsed_time)))
        self._logs += 1
        if (self._logs - 1) % self.every_n_logs:
            return
        self._write(self.format_log(context), redraw=True)

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor with each evaluation's results: prints them."""
        step = kwargs.get("eval_step", context.global_step)
        metrics = " ".join(f"{k} {_fmt_value(v)}" for k, v in (context.val_metrics or {}).items())
        self._write(f"[{_run_name(context)}] eval step {step}: {metrics or '(no metrics)'}")

    def on_train_end(self, context: Any, **kwargs: Any) -> None:
        """Called on the callback actor once at the end: prints a summary line."""
        parts = [f"[{_run_name(context)}] done at step {_step_of(context)}"]
        if self._started is not None:
            parts.append(f"in {_fmt_duration(self._clock() - self._started)}")
        if context.loss is not None:
            parts.append(f"loss {_fmt_value(context.loss)}")
        if context.stop_reason:
            parts.append(f"(stopped: {context.stop_reason})")
        self._write(" ".join(parts))
        self._reset()

    # -- formatting --------------------------------------------------------------------------

    def format_log(self, context: Any) -> str:
        """The progress line for a log context (uses the recent logs for the ETA)."""
        step = context.global_step
        parts = [f"[{_run_name(context)}] step {_step_of(context)}"]
        max_steps = _max_steps(context)
        if max_steps:
            parts.append(f"({100 * step // max_steps}%)")
        loss = as_float(context.loss)
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        lr = as_float(context.learning_rate)
        if lr is not None:
            parts.append(f"lr {lr:.1e}")
        throughput = as_float(context.throughput)
        if throughput is not None:
            parts.append(f"{throughput:,.0f} tok/s")
        engines = as_float((getattr(context, "batch_metrics", None) or {}).get("rollout/engines"))
        if engines is not None:  # GRPO: the rollout engines serving
            parts.append(f"engines {engines:g}")
        eta = self.eta(max_steps - step) if max_steps else None
        if eta is not None:
            parts.append(f"ETA {_fmt_duration(eta)}")
        return " ".join(parts)

    def eta(self, steps_left: int) -> float | None:
        """Seconds for ``steps_left`` more steps at the recent rate, or None when unknown."""
        if steps_left <= 0:
            return 0.0
        rate = self.steps_per_second()
        return steps_left / rate if rate else None

    def steps_per_second(self) -> float | None:
        """The step rate over the recent logs (see the class docstring), or None."""
        if len(self._recent) >= 2:
            (t0, s0, _), (t1, s1, _) = self._recent[0], self._recent[-1]
            if t1 - t0 >= MIN_RATE_SPAN_S and s1 > s0:
                return (s1 - s0) / (t1 - t0)
        step_times = [st for _, _, st in self._recent if st]
        if step_times:
            return len(step_times) / sum(step_times)
        return None

    def _write(self, line: str, redraw: bool = False) -> None:
        out = resolve_stream(self.stream)
        isatty = getattr(out, "isatty", None)
        tty = bool(isatty and isatty())
        if tty and redraw:
            pad = " " * max(0, self._open_line - len(line))
            out.write(f"\r{line}{pad}")
            self._open_line = len(line)
        else:
            if self._open_line:
                out.write("\n")  # end the line being redrawn
                self._open_line = 0
            out.write(line + "\n")
        out.flush()


def _run_name(context: Any) -> str:
    return context.run_name or (context.args or {}).get("run_name") or "run"


def _max_steps(context: Any) -> int | None:
    value = context.max_steps or (context.args or {}).get("max_steps")
    return int(value) if value else None


def _step_of(context: Any) -> str:
    max_steps = _max_steps(context)
    return f"{context.global_step}/{max_steps}" if max_steps else str(context.global_step)


def _fmt_value(value: Any) -> str:
    number = as_float(value)
    if number is None or isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{number:.4f}" if 1e-3 <= abs(number) < 1e6 else f"{number:.4g}"


def _fmt_duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(max(0.0, seconds))))
