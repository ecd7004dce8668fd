"""Requests the cluster can never fit fail at once with what was asked and what there is."""

from __future__ import annotations

import os

import pytest
from rt_support import TinyDataset, TinyRegressor


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"num_workers": 64}, "room for"),
        ({"use_gpu": True}, "GPU=0"),
        ({"resources_per_worker": {"CPU": 8}}, "CPU=4"),
    ],
)
def test_impossible_request_is_refused_before_any_worker_starts(
    ray_session, tmp_path, fields, needle
):
    from ray_trainer import ResourceRequestError, run_training

    with pytest.raises(ResourceRequestError) as info:
        run_training(
            model=TinyRegressor,
            data=TinyDataset,
            max_steps=1,
            storage_path=str(tmp_path),
            run_name="too-big",
            **fields,
        )
    assert needle in str(info.value)
    assert "num_workers=" in str(info.value)
    assert not os.path.exists(tmp_path / "too-big")  # nothing written for the run
