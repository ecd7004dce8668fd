"""bench/_forkrun.py: a benchmark script forked from the smoke run's fork server behaves as
``python SCRIPT ARGS...`` would: `__main__`, its arguments, environment, working folder and
folder on the path, its output in the log, its exit status, its atexit functions, a timeout.
A real fork server (nothing preloaded here, to keep it quick; the smoke run preloads torch and
Ray)."""

import json
import os
import sys
import textwrap

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
from _forkrun import Forker


@pytest.fixture(scope="module")
def forker():
    forker = Forker({"RAY_TRAINER_TEST_SERVER": "1"}, preload=[])
    yield forker
    forker.close()


def _script(folder, body: str) -> str:
    path = folder / "bench_x.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_forked_script_runs_as_python_would(forker, tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 7\n")
    seen, ended = tmp_path / "seen.json", tmp_path / "ended"
    script = _script(
        tmp_path,
        f"""
        import atexit, json, os, sys
        import sibling  # the script's own folder is on the path
        atexit.register(lambda: open({str(ended)!r}, "w").write("yes"))
        print("to stdout")
        print("to stderr", file=sys.stderr)
        json.dump({{"name": __name__, "argv": sys.argv[1:], "cwd": os.getcwd(),
                   "env": os.environ.get("ONLY_HERE"), "server": "RAY_TRAINER_TEST_SERVER" in os.environ,
                   "sibling": sibling.VALUE}}, open({str(seen)!r}, "w"))
        """,
    )
    work, log = tmp_path / "work", tmp_path / "x.log"
    work.mkdir()
    code = forker.run(
        [sys.executable, script, "--json", "out", "-n", "3"],
        str(work),
        {"ONLY_HERE": "yes", "PATH": os.environ["PATH"]},
        str(log),
        60,
    )
    assert code == 0, log.read_text()
    assert json.loads(seen.read_text()) == {
        "name": "__main__",
        "argv": ["--json", "out", "-n", "3"],
        "cwd": str(work),
        "env": "yes",
        "server": False,
        "sibling": 7,
    }
    assert log.read_text().splitlines() == ["to stdout", "to stderr"]
    assert ended.read_text() == "yes"


@pytest.mark.parametrize(("body", "code", "logged"), [
    ("raise SystemExit(3)", 3, ""),
    ("import sys; sys.exit('no report')", 1, "no report"),
    ("raise ValueError('broken benchmark')", 1, "ValueError: broken benchmark"),
])  # fmt: skip
def test_its_exit_status_and_errors(forker, tmp_path, body, code, logged):
    log = tmp_path / "x.log"
    assert (
        forker.run([sys.executable, _script(tmp_path, body)], str(tmp_path), {}, str(log), 60)
        == code
    )
    assert logged in log.read_text()


def test_a_script_past_its_time_is_killed(forker, tmp_path):
    script = _script(tmp_path, "import time; time.sleep(60)")
    assert (
        forker.run([sys.executable, script], str(tmp_path), {}, str(tmp_path / "x.log"), 1)
        == "timeout"
    )


def test_close_stops_the_fork_server_and_its_resource_tracker(tmp_path):
    from multiprocessing import forkserver, resource_tracker

    forker = Forker({}, preload=[])
    assert forker.run([sys.executable, _script(tmp_path, "pass")], str(tmp_path), {},
                      str(tmp_path / "x.log"), 60) == 0  # fmt: skip
    pids = [forkserver._forkserver._forkserver_pid, resource_tracker._resource_tracker._pid]
    assert all(pids)
    forker.close()
    for pid in pids:  # waited for by close: gone, not a zombie
        assert not os.path.exists(f"/proc/{pid}")
    assert forker.run([sys.executable, _script(tmp_path, "pass")], str(tmp_path), {},
                      str(tmp_path / "x.log"), 60) == 0  # a later run starts a new one  # fmt: skip
    forker.close()
