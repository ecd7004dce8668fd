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
from support_paths import pythonpath
from waiting import wait_until

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    # 4 logical CPUs on 2 cores: two training workers plus evaluation tasks.
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath(str(HERE))}},
        log_to_driver=True,
    )
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


@pytest.fixture(scope="module", autouse=True)
def _no_resources_left_behind(request):
    """After each module: no Ray cluster it started is still up, and every logical CPU of the
    shared session is free again, within 30 s each (a cluster, task, actor or placement group a
    test left behind takes the cores or the resources of the tests after it)."""
    import psutil

    before = {p.pid for p in psutil.process_iter() if _is_gcs(p)}
    yield
    import ray

    def extra_clusters() -> list:  # another cluster (`ray start`, an embedded Ray) still up
        return [p for p in psutil.process_iter() if _is_gcs(p) and p.pid not in before]

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


def _is_gcs(proc) -> bool:
    import psutil

    try:
        return proc.name() == "gcs_server"
    except psutil.Error:
        return False


def _cmdlines(procs) -> list[str]:
    import psutil

    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out.append(" ".join(p.cmdline())[:300])
    return out
