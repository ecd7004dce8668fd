"""tests/support/local_cluster.py, with two Rays on one machine (another checkout's tests, a
benchmark run beside the tests): `session_ray_servers`, the integration tier's check that a
module left no Ray running, counts the Rays of its own test session only; `LocalCluster`
finds, stops and reaches its own processes only, never another cluster's."""

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


def test_a_clusters_processes_are_those_it_started_never_anothers_on_a_port_it_left_unused():
    # Two clusters on one machine (CI's smoke run beside the integration tier): a port that one
    # chose and no process of it listens on (its dashboard's, with the dashboard off) is free for
    # the other to take. A process naming that port belongs to the other cluster, and stopping
    # or re-prioritising "this" cluster's processes must not reach it.
    import sys

    from local_cluster import CLUSTER_MARK, HOST, LocalCluster

    ours, theirs = LocalCluster(), LocalCluster()
    unused = ours.ports["dashboard_port"]
    sleep = [sys.executable, "-c", "import subprocess, sys, time; "
             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"]  # fmt: skip
    procs = {
        # a daemon of ours (started with its node_env) and, below, the child it starts
        "ours": subprocess.Popen([*sleep, "--gcs-address=x"], env=ours.node_env()),
        # the other cluster's daemon, which took the port this one left unused
        "theirs": subprocess.Popen([*sleep, f"--gcs-address={HOST}:{unused}"], env=theirs.node_env()),
        # named by our temp dir on its command line, without the mark (`ray start --temp-dir`)
        "by temp dir": subprocess.Popen([*sleep, f"--temp-dir={ours.temp_dir}"],
                                        env={k: v for k, v in os.environ.items() if k != CLUSTER_MARK}),
    }  # fmt: skip
    try:
        import psutil

        def children_started() -> bool:
            return all(len(psutil.Process(p.pid).children()) == 1 for p in procs.values())

        wait_until(children_started, 20, "the stand-ins' children", interval=0.05)
        mine = {p.pid for p in ours.processes()}
        expected = {procs["ours"].pid, procs["by temp dir"].pid}
        expected |= {
            c.pid for n in ("ours", "by temp dir") for c in psutil.Process(procs[n].pid).children()
        }
        assert mine == expected
        theirs_pids = {
            procs["theirs"].pid,
            *(c.pid for c in psutil.Process(procs["theirs"].pid).children()),
        }
        assert {p.pid for p in theirs.processes()} == theirs_pids
        ours.stop(timeout_s=2)
        assert procs["theirs"].poll() is None  # stopping ours left theirs running
        assert procs["ours"].wait(timeout=10) is not None
        assert not os.path.exists(ours.temp_dir)
    finally:
        for p in procs.values():
            for c in psutil.Process(p.pid).children() if p.poll() is None else []:
                c.kill()
            p.kill()
            p.wait()
        theirs.stop(timeout_s=1)
