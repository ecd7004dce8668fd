"""Driver: the first SIGINT/SIGTERM asks the run to stop and says which run_name continues it."""

import os
import signal
import threading

from ray_trainer._driver.signals import resume_hint, run_with_graceful_signals


class _Actor:
    """Stands in for the callback actor's handle: records the one request the handler sends."""

    def __init__(self):
        self.requests = []
        self.asked = threading.Event()
        self.request = self

    def remote(self, kind, reason):
        self.requests.append((kind, reason))
        self.asked.set()


def test_the_resume_hint_names_the_run_for_python_and_for_the_command_line():
    line = resume_hint("run-20261125-083000-ab12")
    assert "run_name='run-20261125-083000-ab12'" in line
    assert "--set run_name=run-20261125-083000-ab12" in line


def test_ctrl_c_asks_the_actor_to_stop_and_prints_the_name_to_resume_with(capsys):
    actor = _Actor()

    def fit():  # runs in a thread; the handler runs in the main thread, which pytest's is
        os.kill(os.getpid(), signal.SIGINT)
        assert actor.asked.wait(30), "the SIGINT handler never asked the actor to stop"

    error = run_with_graceful_signals(fit, actor, "my-run")
    assert error is None
    assert actor.requests == [("stop", "SIGINT to the driver")]
    err = capsys.readouterr().err
    assert "SIGINT: saving a checkpoint at the next step boundary" in err
    assert resume_hint("my-run") in err
