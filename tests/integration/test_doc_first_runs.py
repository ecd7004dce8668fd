"""The first snippet of each guide starts on this machine as written: no `ray.init` of the user's,
the embedded Ray sized to the run (docs/rl.md's first run needs 4 logical CPUs: 2 workers, a
rollout engine and a reward task), each run shortened to one step.

One driver process runs them all (`tests/support/doc_first_runs.py`: the stand-ins for the files
the snippets name, the shortening, and which Ray each runs on), in a temporary folder that is
also its ``HOME`` (a run's default storage is ``~/ray_trainer_runs``).
"""

from __future__ import annotations

import os
import subprocess
import sys

from driver_process import embedded_env, outcome_in
from support_paths import SUPPORT

from ray_trainer._driver.checks.resources import embedded_resources

#: rl.md first: it alone runs on the embedded Ray its own `run_training` starts and sizes (the
#: others fit the cores, and share one embedded Ray started after it).
PAGES = ("rl.md", "getting-started.md", "preference.md", "lora.md", "chat.md")
#: The runs of each snippet (preference.md's: an SFT run, then DPO from it).
RUNS = {"preference.md": 2}


def test_each_guides_first_snippet_starts_on_this_machine(tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "doc_first_runs.py"), "1", *PAGES],
        cwd=tmp_path,
        env={**embedded_env(), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    console = done.stdout + done.stderr
    outcome = outcome_in(done.stdout)
    assert outcome is not None, console[-6000:]
    failed = {page: o["error"] for page, o in outcome.items() if o["error"]}
    assert failed == {}, "\n".join(f"{page}: {error}" for page, error in failed.items())
    assert {p: o["steps"] for p, o in outcome.items()} == {p: [1] * RUNS.get(p, 1) for p in PAGES}
    # docs/rl.md's run: an embedded Ray of its own, sized to it, and one line when it shares.
    lines = console.splitlines()
    started = [i for i, line in enumerate(lines) if line.startswith("ray-trainer: local Ray")]
    assert len(started) == 1, console[-6000:]  # the others share one started without a line
    cores = int(embedded_resources(count_gpus=False)["CPU"])
    shared = [line for line in lines if "logical CPUs for this run's" in line]
    if cores < 4:
        assert shared == [
            f"ray-trainer: the embedded Ray offers 4 logical CPUs for this run's 2 workers, "
            f"1 rollout engine and 1 reward task, on {cores} cores: they share them"
        ]
        assert lines.index(shared[0]) == started[0] + 1  # right after the Ray's own line
    else:
        assert shared == []  # fits the cores: nothing more said
    costs = ", ".join(f"{p} {o['seconds']:.0f} s" for p, o in outcome.items())
    print(f"each snippet's run(s): {costs}")
