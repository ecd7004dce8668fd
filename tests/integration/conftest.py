"""Integration fixtures: one real local Ray session shared by every test in this folder.

Starting Ray costs ~3 s and a TorchTrainer.fit ~11 s here, so the session is shared and the
number of full training runs is kept small. Workers import this folder's modules (the recorder
callbacks and the tiny model) through PYTHONPATH, as a user's own package would be imported.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items):
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    # 4 logical CPUs on 2 cores: two training workers plus evaluation tasks.
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}},
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
