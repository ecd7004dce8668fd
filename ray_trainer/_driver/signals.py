"""Driver: SIGTERM and SIGINT become a clean stop; a second one aborts.

Runs in the driver, while ``run_training`` waits for Ray Train. ``ray job stop`` sends SIGTERM
to the driver (then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S``, 3 s by default) and Ctrl-C sends
SIGINT. Ray Train's own SIGINT handler aborts the workers with nothing saved, so the driver runs
``TorchTrainer.fit`` in a thread (Ray Train then installs no handler) and keeps the main thread
for its own: the first signal asks the run's callback actor to stop, exactly as ``ray-trainer
stop`` does (a checkpoint at the next agreed boundary, ``on_train_end``, then ``run_training``
returns); a second one raises ``KeyboardInterrupt`` at once, which aborts. The driver prints
the run's name at the start and again on the first signal (`resume_hint`): a run continues from
its newest checkpoint only when started again under the same ``run_name``, and the default name
is new on every call.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

HANDLED = (signal.SIGTERM, signal.SIGINT)


def stop_reason_of(name: str) -> str:
    """The stop reason a run stopped by that signal reports."""
    return f"stopped from outside the run: {name} to the driver"


def exit_code_of(stop_reason: str | None) -> int | None:
    """128 + the signal's number when a run stopped on a signal (130 Ctrl-C, 143 SIGTERM)."""
    for sig in HANDLED:
        if stop_reason == stop_reason_of(sig.name):
            return 128 + int(sig)
    return None


def resume_hint(run_name: str) -> str:
    """How to continue the run `run_name` from its newest checkpoint, in one line. The name is
    never reused silently: a rerun of an edited config would then resume the old run."""
    return (
        f"ray-trainer: run {run_name}; to continue it after a stop or a crash, start it again "
        f"with run_name={run_name!r} (ray-trainer run/demo: --set run_name={run_name})"
    )


def run_with_graceful_signals(
    fit: Callable[[], Any], actor: Any, run_name: str | None = None
) -> BaseException | None:
    """Run `fit()`; the error it raised, or None. In the main thread, SIGTERM/SIGINT ask
    `actor` (the run's callback actor) to stop, and print `resume_hint(run_name)` when given; a
    second signal raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        return _call(fit)  # no signal handlers outside the main thread: just run it
    received: list[str] = []

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        received.append(name)
        if len(received) > 1:
            raise KeyboardInterrupt(f"{name} again: aborting the run")
        print(
            f"ray-trainer: {name}: saving a checkpoint at the next step boundary, then stopping "
            "(send it again to abort at once)",
            file=sys.stderr,
            flush=True,
        )
        if run_name is not None:
            print(resume_hint(run_name), file=sys.stderr, flush=True)
        actor.request.remote("stop", f"{name} to the driver")  # fire-and-forget

    previous = {sig: signal.signal(sig, handle) for sig in HANDLED}
    outcome: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: outcome.append(_call(fit)), name="ray-trainer-fit")
    thread.daemon = True  # an aborted driver must not wait for it
    try:
        thread.start()
        while thread.is_alive():
            thread.join(timeout=0.2)  # the main thread stays free to run signal handlers
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return outcome[0] if outcome else None


def _call(fit: Callable[[], Any]) -> BaseException | None:
    try:
        fit()
    except Exception as e:  # ray.train.TrainingFailedError and friends
        return e
    return None
