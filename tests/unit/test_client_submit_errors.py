"""`ray-trainer submit` / `status` against what goes wrong: a stub dashboard on 127.0.0.1 that
refuses the credentials, a port that never answers, a GCS address, an oversized working dir.

No Ray cluster: the stub is a plain HTTP server in a thread; the real `JobSubmissionClient` talks
to it. Every wait is bounded, and the tests show it by events rather than a stopwatch where they
can: a refusal "at once" makes no connection at all, and a `--timeout` gives up before a stub
that holds its answer sends it.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cluster_support import closed_port, write_config

from ray_trainer._client import status as status_cmd
from ray_trainer._client.runtime_env import (
    RuntimeEnvError,
    build_runtime_env,
    check_upload_size,
    load_runtime_env,
    parse_env,
    upload_files,
)
from ray_trainer.cli import main

MiB = 1024 * 1024
#: How long a held stub keeps its answer: far above the 1.5 s --timeout the tests pass, below the
#: commands' default (30 s), so a command that ignored --timeout would get the answer.
HELD_S = 15.0


class StubDashboard:
    """An HTTP server on 127.0.0.1 answering each (method, path) with a fixed (status, body);
    anything else gets ``default``. Records every request's method, path and headers. With
    `hold` (an Event), each answer waits until the test sets it, or HELD_S: a dashboard that
    accepts and answers late; `answered` counts the answers sent."""

    def __init__(
        self,
        routes: dict[tuple[str, str], tuple[int, str]],
        default=(404, ""),
        hold: threading.Event | None = None,
    ):
        self.routes, self.default, self.requests = routes, default, []
        self.hold, self.answered = hold, 0
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                stub.requests.append((self.command, self.path, dict(self.headers)))
                if stub.hold is not None:
                    stub.hold.wait(HELD_S)
                status, body = stub.routes.get((self.command, self.path), stub.default)
                data = body.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up on a held answer and left
                    return
                stub.answered += 1

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> StubDashboard:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def silent_port():
    """A port that accepts connections (the kernel's backlog) and never answers a byte."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@pytest.fixture
def connections(monkeypatch):
    """Every connection this process tries from here on, refused and recorded: a command that
    must fail before it reaches for the network shows that it did."""
    tried: list = []

    def refuse(sock, address):
        tried.append(address)
        raise ConnectionRefusedError(f"the test allows no connection (to {address})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return tried


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path, "run_name: r1\n")


def _version() -> str:
    ray = pytest.importorskip("ray")
    return json.dumps({"ray_version": ray.__version__, "version": "4"})


def _submit(config, address, *extra) -> list[str]:
    return ["submit", str(config), "--address", address, "--no-working-dir", *extra]


# ---- credentials ---------------------------------------------------------------------------


def test_a_401_is_one_message_with_its_own_exit_code(config, capsys):
    unauthorized = (401, "Unauthorized: Missing authentication token")
    with StubDashboard({}, default=unauthorized) as stub:
        assert main(_submit(config, stub.url)) == 3
        assert main(["status", "r1", "--address", stub.url]) == 3
    err = capsys.readouterr().err
    assert err.count("ray-trainer: error: the cluster refused the request: authentication ") == 2
    assert f"HTTP 401 from {stub.url}" in err and "Missing authentication token" in err
    assert "--headers" in err and "RAY_JOB_HEADERS" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2


def test_a_403_on_submitting_is_the_same_message(config, capsys):
    # The version check passes (as on a cluster that lets it through); the job is refused.
    routes = {
        ("GET", "/api/version"): (200, _version()),
        ("POST", "/api/jobs/"): (403, "Forbidden: Invalid authentication token"),
    }
    with StubDashboard(routes) as stub:
        code = main(_submit(config, stub.url, "--headers", '{"Authorization": "Bearer nope"}'))
    assert code == 3
    err = capsys.readouterr().err
    assert "the cluster refused the request: authentication failed (HTTP 403" in err
    assert "Traceback" not in err
    posted = [h for method, path, h in stub.requests if method == "POST"]
    assert posted and posted[0]["Authorization"] == "Bearer nope"  # --headers reached it


def test_a_non_ray_server_is_named(config, capsys):
    with StubDashboard({}, default=(200, "<html>hello</html>")) as stub:
        assert main(_submit(config, stub.url)) == 2
    assert "not as a Ray dashboard does" in capsys.readouterr().err


# ---- addresses and time bounds -------------------------------------------------------------


def test_a_gcs_address_exits_2_at_once_with_the_dashboard_url(config, capsys, connections):
    assert main(_submit(config, "10.0.0.5:6379")) == 2
    assert connections == []  # issue 12: a 40 s hang, then a 28-line RpcError
    err = capsys.readouterr().err.strip()
    assert err == (
        "ray-trainer: error: 10.0.0.5:6379 is the cluster's GCS address (the head's `ray start "
        "--port`, 6379 by default), not the dashboard, whose job API submit and status use: "
        "pass the dashboard URL --address http://10.0.0.5:8265 (after `ray dashboard "
        "cluster.yaml`, http://127.0.0.1:8265)"
    )


def test_a_dead_address_fails_within_timeout(config, capsys):
    hold = threading.Event()
    with StubDashboard({}, hold=hold) as stub:
        try:
            for argv in (
                _submit(config, stub.url, "--timeout", "1.5"),
                ["status", "r1", "--address", stub.url, "--timeout", "1.5"],
            ):
                assert main(argv) == 2
                assert stub.answered == 0  # it gave up before the held answer came
        finally:
            hold.set()
    err = capsys.readouterr().err
    assert err.count("no answer from the Ray dashboard at http://127.0.0.1:") == 2
    assert "within 1.5 s (--timeout)" in err


def test_a_closed_port_fails_at_once(config, capsys):
    port = closed_port()
    assert main(_submit(config, f"http://127.0.0.1:{port}")) == 2
    assert f"cannot reach the Ray dashboard at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_status_bounds_joining_a_gcs_that_never_answers(silent_port):
    # ray.init against a port that accepts and stays silent: the query process is killed.
    pytest.importorskip("ray")
    start = time.monotonic()
    with pytest.raises(status_cmd.ClusterUnreachable) as e:
        status_cmd.ask_in_subprocess("r1", f"127.0.0.1:{silent_port}", timeout_s=4.0)
    assert time.monotonic() - start < 4.0 + 3.0
    assert "within 4 s (--timeout)" in str(e.value) and "GCS address" in str(e.value)


# ---- the working dir's size ----------------------------------------------------------------


def _sparse(path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb"):
        pass
    os.truncate(path, size)  # no blocks written: cheap at any size


def test_an_oversized_working_dir_is_refused_naming_the_biggest(
    tmp_path, config, capsys, connections
):
    wd = config.parent
    _sparse(wd / "weights.bin", 400 * MiB)
    _sparse(wd / "data" / "train.jsonl", 150 * MiB)
    _sparse(wd / "ignored.bin", 2048 * MiB)  # in .gitignore: Ray leaves it behind
    _sparse(wd / ".git" / "objects" / "pack.pack", 2048 * MiB)  # always excluded
    (wd / ".gitignore").write_text("ignored.bin\n")
    argv = ["submit", str(config), "--address", "http://127.0.0.1:9", "--working-dir", str(wd)]
    assert main(argv) == 2
    assert connections == []  # refused before any connection (port 9 is never tried)
    err = capsys.readouterr().err
    assert "holds 550.0 MiB to upload" in err and "over Ray's 512.0 MiB limit" in err
    assert "Biggest: weights.bin 400.0 MiB, data/ 150.0 MiB;" in err
    assert "biggest files: weights.bin 400.0 MiB, data/train.jsonl 150.0 MiB." in err
    assert "ignored.bin" not in err and ".git/" not in err
    assert "--no-working-dir" in err and ".gitignore" in err and "bucket" in err


def test_upload_files_follow_rays_rules(tmp_path, monkeypatch):
    (tmp_path / "keep.py").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".gitignore").write_text("*.ckpt\n")  # relative to sub/
    (tmp_path / "sub" / "a.ckpt").write_text("x")
    (tmp_path / "top.ckpt").write_text("x")  # sub's .gitignore does not reach here
    (tmp_path / ".rayignore").write_text("/scratch/\n")
    (tmp_path / "scratch").mkdir()
    (tmp_path / "scratch" / "big").write_text("x")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "r.json").write_text("x")
    files = dict(upload_files(tmp_path, ["runs/", ".git"]))
    assert set(files) == {"keep.py", "top.ckpt", "sub/.gitignore", ".rayignore"}
    monkeypatch.setenv("RAY_RUNTIME_ENV_IGNORE_GITIGNORE", "1")
    assert "sub/a.ckpt" in dict(upload_files(tmp_path, []))
    assert check_upload_size(str(tmp_path), [], limit=10**6) < 10**6


# ---- the runtime_env -----------------------------------------------------------------------


def test_runtime_env_merges_and_refuses_clearly(tmp_path):
    f = tmp_path / "env.json"
    f.write_text('{"pip": {"packages": ["a"], "pip_check": false}, "env_vars": {"K": "1"}}')
    base = load_runtime_env(str(f))
    merged = build_runtime_env(base, None, ["b"], parse_env(["K=2", "E=x=y"]))
    assert merged == {
        "pip": {"packages": ["a", "b"], "pip_check": False},
        "env_vars": {"K": "2", "E": "x=y"},
    }
    assert build_runtime_env({}, None, [], {}) == {}  # nothing added that was not asked for
    with pytest.raises(RuntimeEnvError, match="sets working_dir"):
        build_runtime_env({"working_dir": "s3://b/p.zip"}, "/wd", [], {})
    with pytest.raises(RuntimeEnvError, match="a requirements file"):
        build_runtime_env({"pip": "requirements.txt"}, None, ["b"], {})
    with pytest.raises(RuntimeEnvError, match="expected KEY=VALUE"):
        parse_env(["NOVALUE"])
    (tmp_path / "list.yaml").write_text("- a\n")
    with pytest.raises(RuntimeEnvError, match="expected a mapping"):
        load_runtime_env(str(tmp_path / "list.yaml"))
    with pytest.raises(RuntimeEnvError, match=r"missing\.yaml"):
        load_runtime_env(str(tmp_path / "missing.yaml"))
