"""A GRPO reward function that never returns (issue 74, point 1), on the shared real Ray: two
tiny runs (1 gloo worker, one ``hf`` engine on half a CPU, reward tasks on a quarter CPU), the
second overlapping the first so that the module costs about one run's wall time.

- ``reward_timeout_s=5``: the first step's rewards time out; the run fails with a
  ``RunFailedError`` naming the stuck function (not the quick one beside it), the step's
  completions, their prompts and the time, and the run's lease (``lease.json``) is released;
- the default timeout (600 s), SIGTERM to the driver (``ray-trainer run`` as its own process,
  joined to the shared Ray) while the reward is stuck: the driver exits within the documented
  bound (a slice to see the stop, ``STOP_GRACE_S`` for the reward to return, the workers'
  teardown), rc 1 with the stop and the function named, and the lease released.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml
from support_paths import pythonpath
from waiting import wait_until

from ray_trainer._rollout.reward_wait import SLICE_S, STOP_GRACE_S

#: The smallest GRPO run of the suite's (test_grpo.py's FSDP run), on one worker.
SETTINGS = {
    "objective": "grpo",
    "grpo": {"num_generations": 2, "max_completion_length": 4},
    "rollout_backend": "hf",
    "rollout_resources": {"CPU": 0.5},
    "reward_resources": {"CPU": 0.25},
    "max_length": 40,
    "num_workers": 1,
    "batch_size": 2,
    "max_steps": 2,
    "dashboard": False,
}
#: How long after SIGTERM the driver may take to exit: a slice to see the stop, the grace, then
#: Ray Train's teardown of the workers and the driver's end (with room for a loaded machine).
STOP_BOUND_S = SLICE_S + STOP_GRACE_S + 30


def _prompts(path, mark) -> str:
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt": f"Count to {i}.", "mark": str(mark)}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ray_trainer._demo.chat import make_tiny_chat_model

    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny") / "model", style="chatml"))


@pytest.fixture(scope="module")
def stuck_driver(ray_session, model, tmp_path_factory):
    """`ray-trainer run` in its own process, joined to the shared Ray, its reward stuck for good
    (the default reward_timeout_s): started first, stopped by the SIGTERM test."""
    root = tmp_path_factory.mktemp("sigterm")
    mark = root / "reward-started"
    config = root / "run.yaml"
    fields = {
        **SETTINGS, "model": model, "data": _prompts(root / "prompts.jsonl", mark),
        "reward_fns": ["rollout_fakes:never_returns"], "run_name": "stuck-sigterm",
        "storage_path": str(root / "storage"),
    }  # fmt: skip
    config.write_text(yaml.safe_dump(fields))
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    env["PYTHONPATH"] = pythonpath(env=env)
    env["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps(  # the workers import rollout_fakes
        {"runtime_env": {"env_vars": {"PYTHONPATH": env["PYTHONPATH"]}}}
    )
    # Its output to files: a pipe nobody reads while the run is stuck could fill and block it.
    out, err = (root / "stdout.txt").open("w"), (root / "stderr.txt").open("w")
    driver = subprocess.Popen(
        [sys.executable, "-m", "ray_trainer.cli", "run", str(config), "--quiet"],
        env=env, stdout=out, stderr=err, text=True,
    )  # fmt: skip
    try:
        yield driver, mark, root
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        out.close()
        err.close()


def test_a_reward_past_reward_timeout_s_fails_the_run_naming_it(stuck_driver, model, tmp_path):
    from rollout_fakes import never_returns, zeros

    from ray_trainer import run_training
    from ray_trainer._driver.launch import RunFailedError

    started = time.monotonic()
    with pytest.raises(RunFailedError) as info:
        run_training(
            **SETTINGS, model=model, data=_prompts(tmp_path / "prompts.jsonl", tmp_path / "m"),
            reward_fns=[zeros, never_returns], reward_timeout_s=5, run_name="stuck-timeout",
            storage_path=str(tmp_path / "storage"),
        )  # fmt: skip
    took = time.monotonic() - started
    msg = str(info.value)
    print(f"timeout run: {took:.1f} s")
    # The quick function is named too when its task had not even started within the 5 s (a
    # new worker process on a loaded machine, as in the first run here: both were named).
    assert re.search(
        r"reward function\(s\) ('zeros', )?'never_returns' did not return within "
        r"reward_timeout_s=5 s on step 1's 4 completions \(prompts \d+, \d+ of the data\); "
        r"their tasks were cancelled", msg,
    ), msg  # fmt: skip
    # It was called, and stuck; unless no task had even started within the 5 s (the quick one
    # named too: on a loaded machine a reward task's new worker process can take that long, as
    # in a CI run on 2026-12-02 where neither marked its start before the timeout).
    assert (tmp_path / "m").exists() or "'zeros', 'never_returns'" in msg, msg
    assert not (tmp_path / "storage" / "stuck-timeout" / "lease.json").exists()


def test_sigterm_during_a_stuck_reward_stops_the_run_and_releases_its_lease(stuck_driver):
    driver, mark, root = stuck_driver
    run_dir = root / "storage" / "stuck-sigterm"

    def stderr() -> str:
        return (root / "stderr.txt").read_text()

    wait_until(lambda: mark.exists() or driver.poll() is not None, 240, "the stuck reward")
    assert driver.poll() is None, stderr()
    assert (run_dir / "lease.json").exists()  # held while the run lives
    time.sleep(2 * SLICE_S)  # stuck for a while: the wait has asked the actor already
    asked = time.monotonic()
    driver.send_signal(signal.SIGTERM)  # what `ray job stop` sends
    try:
        driver.wait(timeout=STOP_BOUND_S + 60)
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"the driver did not exit within {STOP_BOUND_S + 60:.0f} s of SIGTERM:\n{stderr()}"
        )
    took = time.monotonic() - asked
    err = stderr()
    print(f"SIGTERM to exit: {took:.1f} s")
    assert driver.returncode == 1, err[-3000:]
    assert "SIGTERM: saving a checkpoint at the next step boundary" in err
    assert (
        "stopped from outside the run: SIGTERM to the driver, during the rewards of step 1's 4 "
        "completions (prompts " in err
    ), err[-3000:]
    assert "reward function(s) 'never_returns' had not returned after" in err, err[-3000:]
    assert "ray-trainer: run failed: run 'stuck-sigterm' failed after 1 attempt(s)" in err
    assert took < STOP_BOUND_S, f"the driver took {took:.1f} s to stop"
    assert not (run_dir / "lease.json").exists()
