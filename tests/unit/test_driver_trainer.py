"""Driver: the trainer class a run is launched with leaves out Ray Train's Ray Data callback
without a Ray Dataset, and its placement group cleaner without a dashboard (whose state API the
cleaner polls). Built, not fitted: no Ray starts; whether a dashboard runs is what Ray's
`get_dashboard_url` answers. On a real Ray without a dashboard, the integration test
`test_plain_torch.py::test_on_a_ray_without_a_dashboard_no_placement_group_cleaner_starts`
checks that a run starts no cleaner."""

import pytest
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback

from ray_trainer._driver.trainer import dashboard_running, torch_trainer_class


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
    assert not dashboard_running()
    ours = torch_trainer_class()(_noop, scaling_config=ScalingConfig(num_workers=2))
    plain = TorchTrainer(_noop, scaling_config=ScalingConfig(num_workers=2))
    left_out = {DatasetsCallback.__name__, "PlacementGroupCleanerCallback"}
    assert "PlacementGroupCleanerCallback" in _callbacks(plain)
    assert _callbacks(ours) == [n for n in _callbacks(plain) if n not in left_out]


def test_with_a_dashboard_or_unknown_the_cleaner_is_kept(monkeypatch):
    monkeypatch.setattr("ray._private.worker.get_dashboard_url", lambda: "127.0.0.1:8265")
    assert dashboard_running()
    ours = torch_trainer_class()(_noop, scaling_config=ScalingConfig(num_workers=1))
    assert "PlacementGroupCleanerCallback" in _callbacks(ours)

    def not_connected():
        raise RuntimeError("Ray has not been started yet.")

    monkeypatch.setattr("ray._private.worker.get_dashboard_url", not_connected)
    assert dashboard_running()
