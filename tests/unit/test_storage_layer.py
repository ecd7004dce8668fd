"""The storage layer and what reads through it, on this machine's disk and on a custom pyarrow
filesystem (a `SubTreeFileSystem`: paths on it are not paths on the disk), and the driver's
decision of which data files travel with a run. S3 itself is in tests/integration/test_multinode.py
(a run in a bucket, on its cluster).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from pyarrow import fs as pafs

from ray_trainer import _checkpoint as ckpt
from ray_trainer import load_model
from ray_trainer._model.spec import ModelSpec
from ray_trainer._storage import local_copy, locate


def _checkpoint(folder, step=3):
    """A complete 1-rank checkpoint of the demo's model, written as a worker writes it."""
    folder.mkdir(parents=True)
    spec = ModelSpec(demo={"n_train": 64, "n_val": 8, "d_model": 32, "n_heads": 2})
    model = spec.build_model()
    torch.save(model.state_dict(), folder / ckpt.MODEL_FILE)  # as a DDP save writes it
    ckpt.write_rank_part(
        str(folder),
        rank=0,
        world_size=1,
        callback_state={},
        user_state={},
        extra_files=[ckpt.MODEL_FILE],
        trainer_state=ckpt.TrainerState(global_step=step),
        model_spec=spec,
    )
    return model


def test_locations_on_the_local_disk(tmp_path):
    run = locate(str(tmp_path / "runs" / "r1"))
    assert run.is_local and run.name == str(tmp_path / "runs" / "r1")
    record = run.child("run.json")
    assert record.read_text() is None and not record.exists()
    record.write_text('{"a": 1}')  # creates the folders it needs
    assert json.loads(record.read_text()) == {"a": 1} and record.size() == 8
    assert run.listdir() == ["run.json"] and not list(tmp_path.rglob("*.tmp*"))
    with local_copy(run) as here:
        assert here == run.path  # local: no copy
    record.delete()
    assert not record.exists()


def test_two_threads_writing_one_file_never_see_each_others_half(tmp_path):
    # Two run_training calls in threads of one driver may write the same cache file: each
    # writer has a temporary file of its own, and the file is always one writer's whole text.
    target = locate(str(tmp_path / "cache" / "meta.json"))
    texts = {name: name * 500_000 for name in "ab"}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def write(name: str) -> None:
        start.wait()
        try:
            for _ in range(100):
                target.write_text(texts[name])
                assert target.read_text() in texts.values()
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(n,)) for n in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert target.read_text() in texts.values()
    assert not list(tmp_path.rglob("*.tmp*"))


def test_a_checkpoint_on_a_custom_filesystem_is_verified_found_and_loaded(tmp_path):
    disk = tmp_path / "bucket-root"
    model = _checkpoint(disk / "runs" / "r1" / "checkpoint_00000003")
    custom = pafs.SubTreeFileSystem(str(disk), pafs.LocalFileSystem())
    path = "runs/r1/checkpoint_00000003"  # a path on the custom filesystem only
    assert ckpt.verify(path, custom).global_step == 3
    assert ckpt.latest_checkpoint("runs/r1", custom) == path
    with local_copy(locate(path, custom)) as here:  # not local: downloaded into a temp dir
        assert here != path and (tmp_path / "bucket-root" / path).exists()
        copied = sorted(p.name for p in Path(here).iterdir())
        assert "rank0.complete" in copied and "model.pt" in copied
    loaded = load_model(path, filesystem=custom)
    assert isinstance(loaded, torch.nn.Module) and not loaded.training
    for a, b in zip(loaded.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ckpt.CheckpointError, match="does not exist"):
        ckpt.verify("runs/r1/checkpoint_00000009", custom)


def test_a_truncated_file_on_storage_makes_the_checkpoint_incomplete(tmp_path):
    _checkpoint(tmp_path / "c")
    (tmp_path / "c" / "model.pt").write_bytes(b"short")
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt is missing or truncated"):
        ckpt.verify(str(tmp_path / "c"))
    assert ckpt.latest_checkpoint(str(tmp_path)) is None
