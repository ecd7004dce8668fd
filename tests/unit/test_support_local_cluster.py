"""tests/support/local_cluster.py's `session_ray_servers`: the integration tier's check that a
module left no Ray running counts the Rays of its own test session only, never one that another
process on the machine started (CI's smoke run of the benchmarks, beside the integration tier)."""

from __future__ import annotations

import os
import shutil
import subprocess

from local_cluster import SESSION_MARK, session_ray_servers
from waiting import wait_until


def test_only_the_gcs_servers_of_the_session_are_its_own(tmp_path):
    # Stand-ins named as Ray's GCS server is: `sleep` copied as `gcs_server`.
    server = tmp_path / "gcs_server"
    shutil.copy(shutil.which("sleep"), server)
    other = tmp_path / "raylet"
    shutil.copy(shutil.which("sleep"), other)
    env = {k: v for k, v in os.environ.items() if k != SESSION_MARK}
    procs = {
        "ours": subprocess.Popen([server, "60"], env={**env, SESSION_MARK: "s1"}),
        "another session's": subprocess.Popen([server, "60"], env={**env, SESSION_MARK: "s2"}),
        "unmarked": subprocess.Popen([server, "60"], env=env),
        "not a GCS": subprocess.Popen([other, "60"], env={**env, SESSION_MARK: "s1"}),
    }
    try:
        wait_until(lambda: session_ray_servers("s2"), 10, "the stand-ins to start", interval=0.05)
        assert [p.pid for p in session_ray_servers("s1")] == [procs["ours"].pid]
        assert [p.pid for p in session_ray_servers("s2")] == [procs["another session's"].pid]
        assert session_ray_servers("s3") == []
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert session_ray_servers("s1") == []
