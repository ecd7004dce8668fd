"""Driver: the trainer class a run is launched with leaves out Ray Train's Ray Data callback
without a Ray Dataset, and its placement group cleaner without a dashboard (whose state API the
cleaner polls). Built, not fitted: no Ray starts; whether a dashboard runs is what Ray's
`get_dashboard_url` answers. On a real Ray without a dashboard, the integration test
`test_plain_torch.py::test_on_a_ray_without_a_dashboard_no_placement_group_cleaner_starts`
checks that a run starts no cleaner.

And its backend config, `LeanTorchConfig` (`_driver/torch_backend.py`): `TorchConfig` field for
field, the process group started with Ray Train's own worker functions, Ray Train's config where
those differ. That its module loads no torch is `test_layout.py`'s probe; that a real run's
controller has none is `test_plain_torch.py::test_the_controller_never_imports_torch`."""

import pytest
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from ray_trainer._driver.console import cluster_has_dashboard
from ray_trainer._driver.trainer import torch_trainer_class


def _callbacks(trainer) -> list[str]:
    return [type(c).__name__ for c in trainer._create_default_callbacks()]


def _noop():
    pass


def test_without_a_dataset_every_callback_but_the_ray_data_one_is_kept():
    ours = torch_trainer_class()(_noop, scaling_config=ScalingConfig(num_workers=2))
    plain = TorchTrainer(_noop, scaling_config=ScalingConfig(num_workers=2))
    assert isinstance(ours, TorchTrainer)
    # This Ray Train still has the callback: were it renamed or gone, this fails here.
    assert DatasetsCallback.__name__ in _callbacks(plain)
    assert _callbacks(ours) == [n for n in _callbacks(plain) if n != DatasetsCallback.__name__]
    # Those a run relies on are still there: its gloo/nccl group, its placement group's cleaner.
    assert {"BackendSetupCallback", "PlacementGroupCleanerCallback"} <= set(_callbacks(ours))


def test_a_trainer_given_a_dataset_keeps_ray_datas_callback():
    ours = torch_trainer_class()(
        _noop, scaling_config=ScalingConfig(num_workers=1), datasets={"train": _noop}
    )
    assert DatasetsCallback.__name__ in _callbacks(ours)


def test_the_class_is_built_once():
    assert torch_trainer_class() is torch_trainer_class()


@pytest.mark.parametrize("url", ["", None])
def test_without_a_dashboard_the_placement_group_cleaner_is_left_out(monkeypatch, url):
    monkeypatch.setattr("ray._private.worker.get_dashboard_url", lambda: url)
    assert not cluster_has_dashboard()
    ours = torch_trainer_class()(_noop, scaling_config=ScalingConfig(num_workers=2))
    plain = TorchTrainer(_noop, scaling_config=ScalingConfig(num_workers=2))
    left_out = {DatasetsCallback.__name__, "PlacementGroupCleanerCallback"}
    assert "PlacementGroupCleanerCallback" in _callbacks(plain)
    assert _callbacks(ours) == [n for n in _callbacks(plain) if n not in left_out]


def test_with_a_dashboard_or_unknown_the_cleaner_is_kept(monkeypatch):
    monkeypatch.setattr("ray._private.worker.get_dashboard_url", lambda: "127.0.0.1:8265")
    assert cluster_has_dashboard()
    ours = torch_trainer_class()(_noop, scaling_config=ScalingConfig(num_workers=1))
    assert "PlacementGroupCleanerCallback" in _callbacks(ours)

    def not_connected():
        raise RuntimeError("Ray has not been started yet.")

    monkeypatch.setattr("ray._private.worker.get_dashboard_url", not_connected)
    assert cluster_has_dashboard()


# ---- the backend config: Ray Train's TorchConfig without torch in the controller ----------


def test_the_lean_config_is_torchconfig_field_for_field():
    import dataclasses

    from ray.train.torch.config import TorchConfig, TorchConfigContextManager, _TorchBackend

    from ray_trainer._driver.torch_backend import LeanTorchBackend, LeanTorchConfig

    def fields(cls):
        return [(f.name, f.default) for f in dataclasses.fields(cls)]

    assert fields(LeanTorchConfig) == fields(TorchConfig)
    lean, ray_own = LeanTorchConfig(), TorchConfig()
    assert lean.to_dict() == ray_own.to_dict()
    assert lean.framework == ray_own.framework
    assert lean.train_func_context is TorchConfigContextManager
    assert LeanTorchBackend.share_cuda_visible_devices == _TorchBackend.share_cuda_visible_devices


@pytest.mark.parametrize(("use_gpu", "backend"), [(False, "gloo"), (True, "nccl")])
def test_a_run_takes_the_lean_config_with_the_backend_torchtrainer_chooses(use_gpu, backend):
    from ray_trainer._driver.torch_backend import LeanTorchConfig

    scaling = ScalingConfig(num_workers=2, use_gpu=use_gpu)
    config = torch_trainer_class()(_noop, scaling_config=scaling).backend_config
    assert type(config) is LeanTorchConfig and config.backend == backend
    assert TorchTrainer(_noop, scaling_config=scaling).backend_config.backend == backend


def test_a_torch_config_given_is_kept():
    from ray.train.torch.config import TorchConfig

    given = TorchConfig(timeout_s=60)
    assert torch_trainer_class()(_noop, torch_config=given).backend_config is given


def test_where_ray_trains_worker_functions_differ_or_for_tpus_the_run_takes_torchconfig(
    monkeypatch,
):
    from ray_trainer._driver.torch_backend import lean_torch_config

    assert lean_torch_config(ScalingConfig(num_workers=1)) is not None

    class Tpu:
        use_tpu = True

    assert lean_torch_config(Tpu()) is None
    monkeypatch.setattr("ray.train.torch.config._shutdown_torch", lambda: None)
    assert lean_torch_config(ScalingConfig(num_workers=1)) is None
    monkeypatch.delattr("ray.train.torch.config._setup_torch_process_group")
    assert lean_torch_config(ScalingConfig(num_workers=1)) is None


class _Group:
    """Ray Train's worker group as a backend sees it, recording what it is asked to run."""

    def __init__(self, size: int, gpus: int = 0) -> None:
        self.size, self.gpus, self.calls = size, gpus, []

    def __len__(self) -> int:
        return self.size

    def get_resources_per_worker(self) -> dict:
        return {"CPU": 1, "GPU": self.gpus}

    def _record(self, ranks, func, args, kwargs):
        self.calls.append((ranks, func.__name__, args, kwargs))
        if func.__name__ == "get_address_and_port":
            return "10.0.0.7", 29500
        return None

    def execute(self, func, *args, **kwargs):
        return self._record("all", func, args, kwargs)

    execute_async = execute

    def execute_single(self, rank, func, *args, **kwargs):
        return self._record(rank, func, args, kwargs)

    execute_single_async = execute_single


@pytest.mark.parametrize(
    ("init_method", "url"), [("env", "env://"), ("tcp", "tcp://10.0.0.7:29500")]
)
def test_the_backend_starts_the_group_as_ray_trains_does(monkeypatch, init_method, url):
    from ray_trainer._driver import torch_backend

    monkeypatch.setattr(torch_backend.ray, "get", lambda refs, timeout=None: refs)
    group = _Group(2)
    config = torch_backend.LeanTorchConfig(init_method=init_method)
    torch_backend.LeanTorchBackend().on_start(group, config)
    master = [("all", "_set_master", (), {"addr": "10.0.0.7", "port": 29500})]
    setup = {"backend": "gloo", "world_size": 2, "init_method": url, "timeout_s": 1800}
    assert group.calls == [
        (0, "get_address_and_port", (), {}),
        *(master if init_method == "env" else []),
        ("all", "_prepare_worker", (), {}),
        *[
            (rank, "_on_worker", ("_setup_torch_process_group",), {**setup, "world_rank": rank})
            for rank in range(2)
        ],
    ]
    group = _Group(1)
    torch_backend.LeanTorchBackend().on_shutdown(group, config)
    assert group.calls == [
        ("all", "_on_worker", ("_shutdown_torch",), {"destroy_process_group": False})
    ]


def test_an_unknown_init_method_is_refused_naming_the_field(monkeypatch):
    from ray_trainer._driver import torch_backend

    with pytest.raises(ValueError, match=r"LeanTorchConfig.init_method='file'.*'env' or 'tcp'"):
        torch_backend.LeanTorchBackend().on_start(
            _Group(1), torch_backend.LeanTorchConfig(init_method="file")
        )


def test_the_functions_sent_to_the_workers_run_ray_trains_own(monkeypatch):
    """In the worker: `_on_worker` calls Ray Train's function by name; `_set_master` sets what
    init_method 'env' reads."""
    from ray_trainer._driver import torch_backend

    seen = []
    monkeypatch.setattr(
        "ray.train.torch.config._shutdown_torch", lambda **kw: seen.append(kw) or "done"
    )
    assert torch_backend._on_worker("_shutdown_torch", destroy_process_group=True) == "done"
    assert seen == [{"destroy_process_group": True}]
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    torch_backend._set_master(addr="10.0.0.7", port=29500)
    import os

    assert (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("10.0.0.7", "29500")


def test_a_prepared_worker_sends_torchs_version_as_a_plain_str(monkeypatch):
    """`_prepare_worker` sets torch.distributed's variables (Ray Train's function) and has Ray
    pickle `torch.__version__` as a `str`: what unpickles it (Ray Train's controller, asking rank
    0 for it when state tracking is on) does not import torch for it."""
    import subprocess
    import sys

    import torch
    from ray import cloudpickle
    from ray.util import deregister_serializer
    from torch.torch_version import TorchVersion

    from ray_trainer._driver import torch_backend

    seen = []
    monkeypatch.setattr(
        "ray.train.torch.config._set_torch_distributed_env_vars", lambda: seen.append("env")
    )
    assert b"torch_version" in cloudpickle.dumps(torch.__version__)  # Ray's default
    try:
        torch_backend._prepare_worker()
        data = cloudpickle.dumps({"torch": torch.__version__})
    finally:
        deregister_serializer(TorchVersion)
    assert seen == ["env"]
    load = (
        "import pickle, sys; v = pickle.load(sys.stdin.buffer)['torch'];"
        "print(type(v).__name__, v, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", load], input=data, capture_output=True, check=True
    ).stdout.decode()
    assert out.split() == ["str", str(torch.__version__), "False"]
