"""Integration fixtures: one real local Ray session shared by every test in this folder.

Starting Ray costs ~3 s and a TorchTrainer.fit ~11 s here, so the session is shared and the
number of full training runs is kept small. Workers import the shared helpers (`tests/support`:
the recorder callbacks and the tiny model) and this folder's modules through PYTHONPATH, as a
user's own package would be imported.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from grpo_faults import grpo_faults  # noqa: F401  (a session fixture: test_grpo_nodes)
from local_cluster import SESSION_MARK, session_ray_servers
from lost_nodes import lost_nodes  # noqa: F401  (a session fixture: test_elastic, test_node_loss)
from shared_runs import (  # noqa: F401  (session fixtures that several modules read)
    crash_then_resume,
    evals_run,
    fsdp_runs,
)
from support_paths import pythonpath
from waiting import wait_until

HERE = Path(__file__).resolve().parent
#: This session's mark on every process it starts (`local_cluster.SESSION_MARK`): the check after
#: each module counts this session's Rays only.
SESSION = os.environ.setdefault(SESSION_MARK, f"pytest-{os.getpid()}")
#: The shared `ray_session`'s session folder, once started: the check after each module leaves
#: that Ray up, also after the module that started it.
SHARED_SESSION: dict[str, str] = {}


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


#: Read by Ray Train's controller, which every run of the shared session starts as a process of
#: that session's Ray (whichever driver starts the run): set while `ray.init` starts Ray's
#: processes, so that they and every worker they start inherit them; not in this process's
#: environment after, so a cluster or an embedded Ray that a test starts keeps Ray's defaults.
#: A value the developer set is kept.
SESSION_RAY_TRAIN_SETTINGS = {
    # The controller polls the workers every 2 s by default, and a worker's result queue holds
    # one report: a checkpoint reported within 2 s of the one before blocks the loop until the
    # next poll, and a run's end or a crashed worker is seen up to 2 s late. The tests save every
    # few steps of tiny models: at the default, a 12-step run saving every 2 steps spent ~9.5 s
    # in its steps instead of ~1.5 s, and ~4.5 s instead of ~1 s from its last step to
    # `run_training`'s return.
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    # One local node is never drained: no preemption watcher actor per run (one process fewer
    # to start, and its polling), as `run_training`'s own embedded Ray does (console.py).
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    ours = {k: v for k, v in SESSION_RAY_TRAIN_SETTINGS.items() if k not in os.environ}
    os.environ.update(ours)
    try:
        # 4 logical CPUs on 2 cores: two training workers plus evaluation tasks.
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath(str(HERE))}},
            log_to_driver=True,
        )
    finally:
        for key in ours:
            del os.environ[key]
    SHARED_SESSION["folder"] = ray._private.worker._global_node.get_session_dir_path()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (~15 s to start: once per session)."""
    from tracker_support import MlflowServer

    server = MlflowServer(str(tmp_path_factory.mktemp("mlflow")))
    server.start()
    yield server
    server.stop()


def _is_shared_session(gcs_server) -> bool:
    """Whether a GCS server is the shared `ray_session`'s (its command line names the session
    folder `ray_session` recorded)."""
    folder = SHARED_SESSION.get("folder")
    return bool(folder) and f"{folder}/" in " ".join(gcs_server.cmdline())


@pytest.fixture(scope="module", autouse=True)
def _no_resources_left_behind(request):
    """After each module: no Ray cluster it started is still up, and every logical CPU of the
    shared session is free again, within 30 s each (a cluster, task, actor or placement group a
    test left behind takes the cores or the resources of the tests after it). Only this
    session's Rays count: one that another process on the machine starts meanwhile (CI's smoke
    run beside this tier) is none of this module's."""
    before = {p.pid for p in session_ray_servers(SESSION)}
    yield
    import ray

    def extra_clusters() -> list:  # another cluster (`ray start`, an embedded Ray) still up
        return [  # the shared session's Ray stays up, also where this module started it
            p
            for p in session_ray_servers(SESSION)
            if p.pid not in before and not _is_shared_session(p)
        ]

    try:
        wait_until(lambda: not extra_clusters(), 30, "its Ray clusters to stop", interval=0.2)
    except AssertionError:
        pytest.fail(f"{request.module.__name__} left Ray running: {_cmdlines(extra_clusters())}")
    if not ray.is_initialized():
        return

    def cpus_free() -> bool:
        return ray.available_resources().get("CPU", 0) >= ray.cluster_resources().get("CPU", 0)

    try:
        wait_until(cpus_free, 30, "every CPU to be free", interval=0.2)
    except AssertionError:
        from ray.util.state import list_actors, list_placement_groups

        alive = [
            (a.class_name, a.name, a.required_resources)
            for a in list_actors(filters=[("state", "=", "ALIVE")])
        ]
        groups = [
            (g.name, g.state, g.bundles)
            for g in list_placement_groups(filters=[("state", "!=", "REMOVED")])
        ]
        pytest.fail(
            f"{request.module.__name__} left {ray.available_resources().get('CPU', 0)} of "
            f"{ray.cluster_resources().get('CPU')} CPUs free: actors {alive}, "
            f"placement groups {groups}"
        )


def _cmdlines(procs) -> list[str]:
    import psutil

    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append(" ".join(p.cmdline())[:300])
    return out
