"""Reading a checkpoint runs no code from it (issue 48, part 1): every file replaced by a pickle
whose ``__reduce__`` would create a marker file, its manifest's size and SHA-256 updated to
match, is refused (or read as plain data) by every read path, and the marker never appears;
a changed file is named; a callback state that is not plain data is refused at the save;
a model spec is data (a factory by ``module:qualname``, or given to ``load_model(model=)``)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pickle

import pytest
import torch

from ray_trainer import _checkpoint as ckpt
from ray_trainer._actor.evaluation import _run_eval
from ray_trainer._actor.state import restore
from ray_trainer._checkpoint.names import ACTOR_STATE_FILE
from ray_trainer._checkpoint.safe import UnsafeStateError, dumps, sha256_file
from ray_trainer._model.spec import ModelLoadError, ModelSpec
from ray_trainer._storage import locate
from ray_trainer._worker.checkpoints.resume import load_shards
from ray_trainer._worker.checkpoints.saving import write_state


def make_model() -> torch.nn.Module:
    """A model factory that ``module:qualname`` names."""
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


class _Evil:
    """A pickle that creates `marker` when it is unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _Whole:
    """What a run that trains every weight saves (`Adaptation.trainable`)."""

    @staticmethod
    def trainable(model, state):
        return state


def _write(folder, *, sharded=False, factory=make_model, world=2, actor_state=True):
    """A complete checkpoint of `factory`'s model (DDP: model.pt and optimizer.pt; sharded:
    DCP shards), two ranks, a scheduler, callback state, the model spec and the actor's state."""
    os.makedirs(folder, exist_ok=True)
    model = factory()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    if sharded:
        from ray_trainer._worker.checkpoints.saving import sharded_state

        files = write_state(str(folder), sharded_state(model, optimizer, _Whole), 0, True)
    else:
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        files = write_state(str(folder), state, 0, False)
    trainer = ckpt.TrainerState(global_step=5, strategy="fsdp" if sharded else "ddp")
    for rank in range(world):
        ckpt.write_rank_part(
            str(folder),
            rank=rank,
            world_size=world,
            callback_state={"Counter": {"n": rank, "seen": torch.ones(2), "at": (1, 2.5)}},
            user_state={"note": "hi"},
            save_id="launch.0",
            **(
                dict(
                    extra_files=files,
                    scheduler={"last_epoch": 5, "lr_lambdas": [None]},
                    trainer_state=trainer,
                    model_spec=ModelSpec(model=factory).record(),
                )
                if rank == 0
                else {}
            ),
        )
    if actor_state:
        state = {"callbacks": {"Stopper": {"best": 1.0}}, "user_state": {}}
        (folder / ACTOR_STATE_FILE).write_bytes(dumps(state))
    return model


def _files(folder):
    """Every file of a checkpoint but its manifests, relative to `folder`."""
    found = []
    for root, _, names in os.walk(folder):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), folder)
            if not rel.endswith(".complete"):
                found.append(rel)
    return sorted(found)


def _poison(folder, names, marker):
    """Replace `names` by the marker pickle, then update every manifest that lists them."""
    evil = pickle.dumps(_Evil(str(marker)))
    for name in names:
        (folder / name).write_bytes(evil)
    for manifest in folder.glob("rank*.complete"):
        content = json.loads(manifest.read_text())
        for name in content["files"]:
            if name in names:
                content["files"][name] = ckpt.file_entry(str(folder), name)
        manifest.write_text(json.dumps(content))


def _read_every_way(folder):
    """Every path that reads a checkpoint: load_model, load_model_state, the worker's resume
    read (its rank part, model, optimizer, scheduler; FSDP shards), the actor's restore, and
    EvalOnSave's copy handed to a function that loads it. The errors they raised."""
    path = str(folder)
    errors = []

    def attempt(fn):
        try:
            fn()
        except Exception as e:  # refused: what matters here is that nothing ran
            errors.append(e)

    attempt(lambda: ckpt.load_model(path, model=make_model))
    attempt(lambda: ckpt.load_model(path))
    attempt(lambda: ckpt.load_model_state(path))
    for rank in (0, 1, 3):
        attempt(lambda rank=rank: ckpt.load(locate(path), rank))

    def shards():
        with ckpt.open_checkpoint(locate(path)) as checkpoint:
            model = make_model()
            optimizer = torch.optim.AdamW(model.parameters())
            load_shards(model, optimizer, _Whole, checkpoint.shards_dir)

    if (folder / ckpt.SHARDS_DIR).is_dir():
        attempt(shards)
    from callbacks import CallbackManager

    def actor():  # the actor skips a checkpoint whose state it cannot read
        if restore(CallbackManager([], global_callbacks=[]), locate(str(folder.parent))) is None:
            raise LookupError("the actor restored no state")

    attempt(actor)
    attempt(lambda: _run_eval(lambda local, step: ckpt.load_model(local), path, 5))
    return errors


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_checkpoint_of_malicious_pickles_runs_nothing(tmp_path, sharded):
    folder = tmp_path / "run" / "checkpoint_00000005"
    _write(folder, sharded=sharded)
    # The sound checkpoint reads back through every path first (so that the refusals below
    # come from the pickles, not from a path that cannot read this checkpoint at all).
    assert _read_every_way(folder) == []
    names = _files(folder)
    assert {"rank0.pt", "rank1.pt", "scheduler.pt", ckpt.MODEL_SPEC_FILE, ACTOR_STATE_FILE} <= set(
        names
    )
    assert (ckpt.SHARDS_DIR + "/.metadata" in names) == sharded
    marker = tmp_path / "pwned"
    for name in names:  # one file at a time: each read path meets each file poisoned
        copy = tmp_path / f"one_{name.replace('/', '_')}" / "checkpoint_00000005"
        _write(copy, sharded=sharded)
        _poison(copy, [name], marker)
        for listed, entry in ckpt.listed_files(locate(str(copy))).items():
            assert entry["sha256"] == sha256_file(str(copy / listed))  # the hashes match
        errors = _read_every_way(copy)
        assert not marker.exists(), name
        assert errors, name  # the poisoned file is refused somewhere
    _poison(folder, names, marker)  # then every file at once
    errors = _read_every_way(folder)
    assert not marker.exists()
    assert len(errors) >= 6 and all(not isinstance(e, AttributeError) for e in errors)


def test_a_poisoned_part_is_refused_naming_it(tmp_path):
    folder = tmp_path / "run" / "checkpoint_00000005"
    _write(folder)
    marker = tmp_path / "pwned"
    _poison(folder, ["rank1.pt"], marker)
    with pytest.raises(ckpt.CheckpointError, match=r"rank1\.pt: refused: it holds objects other"):
        ckpt.load(locate(str(folder)), 1)
    assert not marker.exists()


def test_a_changed_file_is_named(tmp_path):
    folder = tmp_path / "run" / "checkpoint_00000005"
    _write(folder)
    data = bytearray((folder / ckpt.OPTIMIZER_FILE).read_bytes())
    data[-30] ^= 0xFF  # same size: only the hash tells
    (folder / ckpt.OPTIMIZER_FILE).write_bytes(bytes(data))
    ckpt.check_complete(locate(str(folder)))  # sizes alone pass
    for read in (
        lambda: ckpt.verify(str(folder)),
        lambda: ckpt.verify_location(next(ckpt.complete_checkpoints(locate(str(folder.parent))))),
        lambda: ckpt.load(locate(str(folder)), 0),
        lambda: ckpt.load_model(str(folder)),
    ):
        with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.pt differs from what its"):
            read()
    # The driver checks a resume_from checkpoint's content before Ray starts.
    from ray_trainer._driver.checks.inputs import _check_resume_from
    from ray_trainer._errors import TrainingArgsError

    with pytest.raises(TrainingArgsError, match=r"resume_from: .*optimizer\.pt differs"):
        _check_resume_from(str(folder))
    # load_model_state reads model.pt alone, in place: that file is checked too.
    model = bytearray((folder / ckpt.MODEL_FILE).read_bytes())
    model[-30] ^= 0xFF
    (folder / ckpt.MODEL_FILE).write_bytes(bytes(model))
    with pytest.raises(ckpt.CheckpointError, match=r"model\.pt differs"):
        ckpt.load_model_state(str(folder))


@dataclasses.dataclass
class _Best:
    score: float


@pytest.mark.parametrize(
    ("state", "where"),
    [
        ({"best": _Best(1.0)}, r"state_dict\(\)\['best'\] is a .*_Best"),
        (
            {"history": [1, {"at": datetime.date(2026, 1, 1)}]},
            r"state_dict\(\)\['history'\]\[1\]\['at'\] is a datetime",
        ),
        ({3: "x"}, r"state_dict\(\) has the key 3, a int"),
    ],
)
def test_a_callback_state_that_is_not_plain_data_is_refused_at_the_save(tmp_path, state, where):
    with pytest.raises(UnsafeStateError, match=r"callback 'Tracker': " + where):
        ckpt.write_rank_part(
            str(tmp_path), rank=1, world_size=2, callback_state={"Tracker": state}, user_state={}
        )
    assert os.listdir(tmp_path) == []  # refused before anything is written


def test_plain_state_round_trips_and_a_look_alike_is_refused(tmp_path):
    import collections

    import numpy as np

    state = {"best": np.float32(0.5), "seen": [1, (2, "x")], "w": torch.ones(2), "none": None}
    ckpt.write_rank_part(
        str(tmp_path), rank=1, world_size=2, callback_state={"Tracker": state}, user_state={}
    )
    with open(tmp_path / "rank1.pt", "rb") as f:
        read = torch.load(f, weights_only=True)["callbacks"]["Tracker"]
    assert read["best"] == 0.5 and type(read["best"]) is float  # a numpy scalar: a number
    assert read["seen"] == [1, (2, "x")] and torch.equal(read["w"], torch.ones(2))
    point = collections.namedtuple("Point", "x y")
    with pytest.raises(UnsafeStateError, match=r"state_dict\(\)\['at'\] is a .*Point"):
        ckpt.write_rank_part(
            str(tmp_path / "x"), rank=1, world_size=2, callback_state={"T": {"at": point(1, 2)}},
            user_state={},
        )  # fmt: skip


def test_the_driver_refuses_a_state_that_is_not_plain_data_before_ray():
    from callbacks import CallbackPicklingError, TrainerCallback
    from ray_trainer import TrainingArgs
    from ray_trainer._driver.checks.inputs import collect_callbacks

    class Tracker(TrainerCallback):
        def on_log(self, context, **kwargs):
            pass

        def state_dict(self):
            return {"best": _Best(0.5)}

        def load_state_dict(self, state):
            pass

    with pytest.raises(
        CallbackPicklingError, match=r"callback '.*Tracker': state_dict\(\)\['best'\] is a"
    ):
        collect_callbacks(TrainingArgs(callbacks=[Tracker()]))


def test_a_factory_is_recorded_by_name_and_a_lambda_is_asked_for(tmp_path):
    named = tmp_path / "named" / "checkpoint_00000005"
    trained = _write(named, actor_state=False)
    record = json.loads((named / ckpt.MODEL_SPEC_FILE).read_text())
    assert record["factory"].endswith("test_checkpoint_safety:make_model")
    loaded = ckpt.load_model(str(named))  # imported from this environment by its name
    assert torch.equal(loaded.weight, trained.weight)

    def local_factory():
        return torch.nn.Linear(3, 2)

    for factory in (lambda: torch.nn.Linear(3, 2), local_factory):
        folder = tmp_path / factory.__name__.strip("<>") / "checkpoint_00000005"
        trained = _write(folder, factory=factory, actor_state=False)
        assert json.loads((folder / ckpt.MODEL_SPEC_FILE).read_text())["factory"] is None
        with pytest.raises(ModelLoadError, match=r"load_model\(path, model=factory\)"):
            ckpt.load_model(str(folder))
        loaded = ckpt.load_model(str(folder), model=factory)
        assert torch.equal(loaded.weight, trained.weight) and not loaded.training


def test_a_recorded_factory_that_cannot_be_imported_names_it(tmp_path):
    folder = tmp_path / "run" / "checkpoint_00000005"
    _write(folder, actor_state=False)
    spec = folder / ckpt.MODEL_SPEC_FILE
    record = json.loads(spec.read_text())
    spec.write_text(json.dumps({**record, "factory": "no_such_module_xyz:build"}))
    content = json.loads((folder / "rank0.complete").read_text())
    content["files"][ckpt.MODEL_SPEC_FILE] = ckpt.file_entry(str(folder), ckpt.MODEL_SPEC_FILE)
    (folder / "rank0.complete").write_text(json.dumps(content))
    with pytest.raises(ModelLoadError, match=r"'no_such_module_xyz:build' cannot be imported"):
        ckpt.load_model(str(folder))
    assert ckpt.load_model(str(folder), model=make_model) is not None


def test_a_checkpoint_of_the_older_pickled_format_is_refused_unread(tmp_path):
    run = tmp_path / "run"
    folder = run / "checkpoint_00000005"
    folder.mkdir(parents=True)
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(str(marker)))
    files = {}
    for name in (ckpt.OLD_MODEL_SPEC_FILE, "rank0.pt", ckpt.MODEL_FILE):
        (folder / name).write_bytes(evil)
        files[name] = len(evil)
    (folder / ckpt.STATE_FILE).write_text(json.dumps({"format": 1, "global_step": 5}))
    files[ckpt.STATE_FILE] = (folder / ckpt.STATE_FILE).stat().st_size
    manifest = {"format": 1, "rank": 0, "world_size": 1, "files": files}
    (folder / "rank0.complete").write_text(json.dumps(manifest))
    for read in (
        lambda: ckpt.load_model(str(folder)),
        lambda: ckpt.load(locate(str(folder)), 0),
        lambda: ckpt.verify(str(folder)),
        lambda: ckpt.latest_checkpoint(str(run)),  # not skipped: a resume would start over
    ):
        with pytest.raises(ckpt.OldCheckpointError, match=r"model_spec\.pkl and rank\*\.pt are"):
            read()
    assert not marker.exists()


def test_manifests_list_a_sha256_per_file(tmp_path):
    folder = tmp_path / "checkpoint_00000005"
    _write(folder, sharded=True, actor_state=False)
    listed = ckpt.listed_files(locate(str(folder)))
    assert set(listed) == set(_files(folder))
    for name, entry in listed.items():
        assert entry == {
            "size": (folder / name).stat().st_size,
            "sha256": sha256_file(str(folder / name)),
        }
