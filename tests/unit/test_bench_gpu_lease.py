"""bench/gpu/lease.sh, the next GPU lease's prepared calls: every step a call names is one it
knows, a step that no longer fits in what is left of its call is skipped and named (never cut
short by the call's end), an unknown step is refused, and the scripts parse. Runs the real
script with no time left (`SMOKE_CPU=1`: nothing installed, nothing trained); the steps
themselves are smoke-run on the CPU by hand (docs/gpu.md), not here: they train for minutes."""

import os
import re
import subprocess

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SCRIPTS = ["bench/gpu/lease.sh", "bench/gpu/gpu_run.sh", "bench/gpu/_gpu_env.sh"]


def _lease(*args, tmp_path):
    env = {**os.environ, "SMOKE_CPU": "1", "OUT": str(tmp_path)}
    return subprocess.run(["bash", "bench/gpu/lease.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)  # fmt: skip


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_scripts_parse(script):
    done = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("call", ["1", "2", "3", "4", "5"])
def test_each_call_names_known_steps_and_skips_what_does_not_fit(call, tmp_path):
    done = _lease(call, "0", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    skipped = re.findall(r"^== (\S+): skipped, (-?\d+) s left of the call and it needs (\d+) s",
                         done.stdout, re.M)  # fmt: skip
    assert skipped, done.stdout
    assert all(int(needs) > 0 for _, _, needs in skipped)
    assert "unknown step" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_one_step_by_name_and_an_unknown_one_refused(tmp_path):
    named = _lease("gpu-4", "0", tmp_path=tmp_path)
    assert named.returncode == 0
    assert re.search(r"^== gpu-4: skipped", named.stdout, re.M)
    unknown = _lease("gpu-9", "0", tmp_path=tmp_path)
    assert unknown.returncode == 2
    assert "unknown step gpu-9" in unknown.stderr
