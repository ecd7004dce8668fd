"""Reading a checkpoint runs no code from it (issue 48, part 1; issue 70, part 1): every file
replaced by a pickle whose ``__reduce__`` would create a marker file, its manifest's size and
SHA-256 updated to match, is refused (or read as plain data) by every reader, and the marker
never appears; a file that a reader would open but no manifest lists (an unlisted ``shards/``
beside a DDP checkpoint: the attack of issue 70) is refused by every reader, naming it, and
harmless extra files are not; the strategy is the trainer state's word, not what the folder
holds; a DCP model entry that is not a tensor is refused and other non-tensor entries are read
weights-only; a changed file is named; a callback state that is not plain data is refused at
the save; a model spec is data, and a factory it names is imported and called only with
``trust_factory=True`` (or replaced by ``model=``), refused before any import otherwise.
The checkpoints and the readers: ``tests/support/checkpoint_trees.py``."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys

import pytest
import torch
from checkpoint_trees import (
    Evil,
    evil_bytes,
    files_of,
    make_model,
    poison,
    read_every_way,
    readers,
    relist,
    resume_read,
    set_spec,
    write_checkpoint,
)

from ray_trainer import _checkpoint as ckpt
from ray_trainer._actor.evaluation import _run_eval
from ray_trainer._checkpoint.names import ACTOR_STATE_FILE
from ray_trainer._checkpoint.safe import UnsafeStateError, sha256_file
from ray_trainer._errors import TrainingArgsError
from ray_trainer._model.spec import ModelLoadError
from ray_trainer._storage import locate

STEP = "checkpoint_00000005"


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_checkpoint_of_malicious_pickles_runs_nothing(tmp_path, sharded):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, sharded=sharded)
    # The sound checkpoint reads back through every path first (so that the refusals below
    # come from the pickles, not from a path that cannot read this checkpoint at all).
    assert read_every_way(folder) == {}
    names = files_of(folder)
    assert {"rank0.pt", "rank1.pt", "scheduler.pt", ckpt.MODEL_SPEC_FILE, ACTOR_STATE_FILE} <= set(
        names
    )
    assert (ckpt.SHARD_METADATA in names) == sharded
    marker = tmp_path / "pwned"
    for name in names:  # one file at a time: each read path meets each file poisoned
        copy = tmp_path / f"one_{name.replace('/', '_')}" / STEP
        write_checkpoint(copy, sharded=sharded)
        poison(copy, [name], marker)
        for listed, entry in ckpt.listed_files(locate(str(copy))).items():
            assert entry["sha256"] == sha256_file(str(copy / listed))  # the hashes match
        errors = read_every_way(copy)
        assert not marker.exists(), name
        assert errors, name  # the poisoned file is refused somewhere
    poison(folder, names, marker)  # then every file at once
    errors = read_every_way(folder)
    assert not marker.exists()
    assert len(errors) >= 6 and all(not isinstance(e, AttributeError) for e in errors.values())


def _dcp_save(target, state) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(target)), no_dist=True)


def test_an_unlisted_dcp_save_beside_a_ddp_checkpoint_runs_nothing(tmp_path):
    # Issue 70's attack: a DCP save that no manifest lists, whose model entries are pickles
    # whose __reduce__ creates the marker, beside a DDP checkpoint. load_model ran them: the
    # format was decided by shards/ being there, and DCP's planner unpickles "bytes" whole.
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
    marker = tmp_path / "pwned"
    _dcp_save(
        folder / ckpt.SHARDS_DIR,
        {"model": {"weight": Evil(str(marker)), "bias": Evil(str(marker))}},
    )
    errors = read_every_way(folder)
    assert not marker.exists()
    refused = set(readers(folder)) - {"actor restore"}  # the actor reads its own file alone
    assert set(errors) == refused, sorted(errors)
    for reader, error in errors.items():
        assert isinstance(error, (ckpt.CheckpointError, TrainingArgsError)), (reader, error)
        assert "shards/.metadata" in str(error) and "no manifest of it lists" in str(error)
    assert "load_model(trust_factory)" in errors  # the exact call of the report
    # Even listed, with the manifests updated to match and the trainer state saying FSDP, the
    # model entries are refused: they are not tensors.
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    (folder / ckpt.STATE_FILE).write_text(json.dumps({**state, "strategy": "fsdp"}))
    relist(folder, add=[f"{ckpt.SHARDS_DIR}/{n}" for n in os.listdir(folder / ckpt.SHARDS_DIR)])
    for reader in ("load_model(model=)", "load_model_state", "open_checkpoint", "resume rank 0"):
        with pytest.raises(
            ckpt.CheckpointError, match=r"model entry 'model\.weight' is not a tensor"
        ):
            readers(folder)[reader]()
    assert not marker.exists()


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
@pytest.mark.parametrize(
    "extra",
    [
        "shards/.metadata",
        "shards/__0_0.distcp",
        "shards/__7_0.distcp",
        "model.pt",
        "optimizer.pt",
        "scheduler.pt",
        "rank7.pt",
        "model_spec.pkl",
        "hf/pytorch_model.bin",
        "hf_adapter/adapter_model.bin",
        "elsewhere/.metadata",
        "elsewhere/__0_0.distcp",
    ],
)
def test_an_unlisted_file_that_a_reader_opens_is_refused_by_every_reader(tmp_path, sharded, extra):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, sharded=sharded)
    target = folder / extra
    if target.exists():  # listed in this strategy's checkpoint: not an extra one
        return
    marker = tmp_path / "pwned"
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(evil_bytes(marker))
    errors = read_every_way(folder)
    assert not marker.exists()
    assert set(errors) == set(readers(folder)) - {"actor restore"}, sorted(errors)
    for error in errors.values():
        assert f"it holds {extra}, which no manifest of it lists" in str(error)


def test_an_unlisted_file_on_remote_storage_is_refused_before_and_after_the_download(tmp_path):
    # A filesystem object that is not this machine's (a bucket's stand-in): load_model_state
    # lists the checkpoint where it is, load_model checks the downloaded copy.
    import pyarrow.fs as pafs

    disk = tmp_path / "bucket"
    folder = disk / "runs" / "r" / STEP
    trained = write_checkpoint(folder, sharded=True)
    custom = pafs.SubTreeFileSystem(str(disk), pafs.LocalFileSystem())
    path = f"runs/r/{STEP}"
    assert torch.equal(
        ckpt.load_model(path, filesystem=custom, model=make_model).weight, trained.weight
    )
    (folder / ckpt.SHARDS_DIR / "__3_0.distcp").write_bytes(evil_bytes(tmp_path / "pwned"))
    for read in (
        lambda: ckpt.load_model(path, filesystem=custom, model=make_model),
        lambda: ckpt.load_model_state(path, filesystem=custom),
        lambda: ckpt.verify(path, custom),
    ):
        with pytest.raises(ckpt.CheckpointError, match=rf"{path}: refused: it holds shards/__3_0"):
            read()
    assert not (tmp_path / "pwned").exists()


def test_an_unlisted_model_spec_is_refused_and_a_listed_one_is_read(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, spec=False)  # a checkpoint that records no model spec
    with pytest.raises(ckpt.CheckpointError, match="does not record how to build its model"):
        ckpt.load_model(str(folder), trust_factory=True)
    (folder / ckpt.MODEL_SPEC_FILE).write_text(
        json.dumps({"model": None, "factory": "os:getcwd", "demo": {}, "on_jsonl": False,
                    "max_length": 8, "tokenizer": None})
    )  # fmt: skip
    with pytest.raises(ckpt.CheckpointError, match=r"it holds model_spec\.json, which no"):
        ckpt.load_model(str(folder), trust_factory=True)
    with pytest.raises(ckpt.CheckpointError, match=r"model_spec\.json"):
        ckpt.load_model(str(folder), model=make_model)


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_files_no_reader_opens_are_left_alone(tmp_path, sharded):
    # The actor's state (it writes it beside the checkpoint after the save), GenerationEval's
    # samples, a manifest of a rank the save did not have, a writer's temporary file, a note.
    folder = tmp_path / "run" / STEP
    trained = write_checkpoint(folder, sharded=sharded)
    for name in ("eval/gen.jsonl", "rank5.complete", ".rank1.complete.tmp", "NOTES.md",
                 "mine/ema.pt", ".metadata.json"):  # fmt: skip
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text("{}")
    assert read_every_way(folder) == {}
    loaded = ckpt.load_model(str(folder), model=make_model)
    assert torch.equal(loaded.weight, trained.weight)


def test_an_fsdp_checkpoint_with_an_unlisted_shard_or_metadata_is_refused(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, sharded=True)
    shards = folder / ckpt.SHARDS_DIR
    # Another DCP save's shard files beside the listed ones: what a crashed save of a larger
    # group leaves (a restart removes it: test_checkpoints_resume.py), or a forger.
    _dcp_save(tmp_path / "other", {"model": {"weight": torch.ones(2, 3)}})
    (shards / "__1_0.distcp").write_bytes((tmp_path / "other" / "__0_0.distcp").read_bytes())
    for reader in ("load_model(model=)", "open_checkpoint", "resume rank 0", "EvalOnSave export"):
        with pytest.raises(ckpt.CheckpointError, match=r"holds shards/__1_0\.distcp, which no"):
            readers(folder)[reader]()
    os.remove(shards / "__1_0.distcp")
    (shards / "old").mkdir()
    (shards / "old" / ".metadata").write_bytes((shards / ".metadata").read_bytes())
    with pytest.raises(ckpt.CheckpointError, match=r"holds shards/old/\.metadata, which no"):
        ckpt.load_model(str(folder), model=make_model)
    os.remove(shards / "old" / ".metadata")
    assert ckpt.load_model(str(folder), model=make_model) is not None


def test_the_format_is_the_trainer_states_word_not_the_folders(tmp_path):
    # A DDP checkpoint whose manifests (updated) list a DCP save too reads model.pt: the
    # shards, though listed, are never opened (their model entry would run the marker).
    folder = tmp_path / "run" / STEP
    trained = write_checkpoint(folder)
    marker = tmp_path / "pwned"
    _dcp_save(folder / ckpt.SHARDS_DIR, {"model": {"weight": Evil(str(marker))}})
    relist(folder, add=[f"{ckpt.SHARDS_DIR}/{n}" for n in os.listdir(folder / ckpt.SHARDS_DIR)])
    for read in (
        lambda: ckpt.load_model(str(folder), model=make_model),
        lambda: ckpt.load_model_state(str(folder)),
        lambda: resume_read(folder, 0),
    ):
        read()
    assert not marker.exists()
    assert torch.equal(ckpt.load_model_state(str(folder))["weight"], trained.weight)
    # An FSDP trainer state over a folder whose manifests list no .metadata: refused, named.
    state = json.loads((folder / ckpt.STATE_FILE).read_text())
    (folder / ckpt.STATE_FILE).write_text(json.dumps({**state, "strategy": "fsdp"}))
    relist(folder, drop=[f"{ckpt.SHARDS_DIR}/{n}" for n in os.listdir(folder / ckpt.SHARDS_DIR)])
    import shutil

    shutil.rmtree(folder / ckpt.SHARDS_DIR)
    for read in (lambda: ckpt.load_model(str(folder), model=make_model),
                 lambda: ckpt.load_model_state(str(folder)), lambda: resume_read(folder, 0)):  # fmt: skip
        with pytest.raises(ckpt.CheckpointError, match=r"do not list shards/\.metadata"):
            read()
    # A strategy this version does not know is refused by every reader.
    (folder / ckpt.STATE_FILE).write_text(json.dumps({**state, "strategy": "zero3"}))
    relist(folder)
    with pytest.raises(ckpt.CheckpointError, match=r"strategy 'zero3' is none of ddp, fsdp"):
        ckpt.load_model(str(folder), model=make_model)


def test_a_non_tensor_optimizer_entry_is_read_weights_only(tmp_path):
    # FSDP's optimizer settings (lr, betas, ...) are DCP "bytes" entries: the sound checkpoint
    # reads them (resume above); a pickle there is refused, the marker never made.
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, sharded=True)
    model, marker = make_model(), tmp_path / "pwned"
    optimizer = torch.optim.AdamW(model.parameters())
    from checkpoint_trees import Whole, scheduler_of

    scheduler_of(optimizer)  # as the run's: the saved groups hold initial_lr

    from ray_trainer._worker.checkpoints.saving import sharded_state

    state = sharded_state(model, optimizer, Whole)
    state["optim"]["param_groups"][0]["lr"] = Evil(str(marker))
    import shutil

    shutil.rmtree(folder / ckpt.SHARDS_DIR)
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(str(folder / ckpt.SHARDS_DIR)), no_dist=True
    )
    relist(folder, add=[f"{ckpt.SHARDS_DIR}/{n}" for n in os.listdir(folder / ckpt.SHARDS_DIR)])
    with pytest.raises(
        ckpt.CheckpointError, match=r"'optim\.param_groups.*refused: it holds objects"
    ):
        resume_read(folder, 0)
    assert not marker.exists()
    assert ckpt.load_model(str(folder), model=make_model) is not None  # the model alone: fine


def test_a_poisoned_part_is_refused_naming_it(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
    marker = tmp_path / "pwned"
    poison(folder, ["rank1.pt"], marker)
    with pytest.raises(ckpt.CheckpointError, match=r"rank1\.pt: refused: it holds objects other"):
        ckpt.load(locate(str(folder)), 1)
    assert not marker.exists()


def test_a_changed_file_is_named(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
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


def test_a_factory_is_recorded_by_name_and_called_only_when_trusted(tmp_path):
    named = tmp_path / "named" / STEP
    trained = write_checkpoint(named, actor_state=False)
    record = json.loads((named / ckpt.MODEL_SPEC_FILE).read_text())
    assert record["factory"] == "checkpoint_trees:make_model"
    with pytest.raises(
        ModelLoadError,
        match=r"built by the factory 'checkpoint_trees:make_model'.*model=<your factory>.*"
        r"trust_factory=True",
    ):
        ckpt.load_model(str(named))
    for loaded in (
        ckpt.load_model(str(named), trust_factory=True),  # imported from this environment
        ckpt.load_model(str(named), model=make_model),
    ):
        assert torch.equal(loaded.weight, trained.weight) and not loaded.training

    def local_factory():
        return torch.nn.Linear(3, 2)

    for factory in (lambda: torch.nn.Linear(3, 2), local_factory):
        folder = tmp_path / factory.__name__.strip("<>") / STEP
        trained = write_checkpoint(folder, factory=factory, actor_state=False)
        assert json.loads((folder / ckpt.MODEL_SPEC_FILE).read_text())["factory"] is None
        with pytest.raises(ModelLoadError, match=r"load_model\(path, model=factory\)"):
            ckpt.load_model(str(folder), trust_factory=True)
        loaded = ckpt.load_model(str(folder), model=factory)
        assert torch.equal(loaded.weight, trained.weight) and not loaded.training


@pytest.mark.parametrize("factory", ["tempfile:mkdtemp", "os:getcwd", "ckpt_marker_mod:build"])
def test_a_named_factory_is_neither_imported_nor_called_without_trust(
    tmp_path, monkeypatch, factory
):
    # Issue 70's second way: a model_spec.json naming an importable callable, its manifest
    # updated. Every reader that builds the model refuses it, naming it and the flag, before
    # importing or calling anything; with the flag, what it returns that is not a module is a
    # clear error (it was a raw TypeError after the call).
    import tempfile

    module_marker = tmp_path / "imported"
    (tmp_path / "ckpt_marker_mod.py").write_text(
        f"open({str(module_marker)!r}, 'w').close()\n\ndef build():\n    return 'not a model'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    calls = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: calls.append(a) or real_mkdtemp())
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
    set_spec(folder, factory=factory, factory_name=factory.rpartition(":")[2])
    untrusted = [
        lambda: ckpt.load_model(str(folder)),
        lambda: _run_eval(lambda local, step: ckpt.load_model(local), str(folder), 5),
    ]
    for read in untrusted:
        with pytest.raises(ModelLoadError, match=rf"factory '{factory}'.*trust_factory=True"):
            read()
    assert calls == [] and not module_marker.exists() and "ckpt_marker_mod" not in sys.modules
    # The run's own reads never build from the spec: resume reads weights into its own model.
    resume_read(folder, 0)
    assert ckpt.load_model(str(folder), model=make_model) is not None
    with pytest.raises(ModelLoadError, match=rf"factory '{factory}' returned str, not an nn.Mod"):
        ckpt.load_model(str(folder), trust_factory=True)
    assert len(calls) == (factory == "tempfile:mkdtemp")  # trusted: imported and called
    assert module_marker.exists() == (factory == "ckpt_marker_mod:build")
    sys.modules.pop("ckpt_marker_mod", None)


def test_a_factory_of_yours_that_returns_no_module_is_a_clear_error(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
    with pytest.raises(ModelLoadError, match=r"returned int, not an nn\.Module") as caught:
        ckpt.load_model(str(folder), model=lambda: 3)
    assert isinstance(caught.value, TypeError)  # what the driver's check of a factory catches
    with pytest.raises(ModelLoadError, match=r"model= must be a factory"):
        ckpt.load_model(str(folder), model="checkpoint_trees:make_model")


def test_the_demo_loads_without_a_flag_and_an_eval_passes_one(tmp_path):
    from ray_trainer._model.spec import ModelSpec

    # The built-in demo (what the README's evaluation loads): no factory, no flag.
    folder = tmp_path / "demo" / STEP
    folder.mkdir(parents=True)
    spec = ModelSpec(demo={"n_train": 64, "n_val": 8, "d_model": 32, "n_heads": 2})
    model = spec.build_model()
    torch.save(model.state_dict(), folder / ckpt.MODEL_FILE)
    ckpt.write_rank_part(
        str(folder), rank=0, world_size=1, callback_state={}, user_state={},
        extra_files=[ckpt.MODEL_FILE], trainer_state=ckpt.TrainerState(global_step=5),
        model_spec=spec,
    )  # fmt: skip
    assert _run_eval(lambda local, step: type(ckpt.load_model(local)).__name__, str(folder), 5) == (
        "TinyCausalLM"
    )
    # A factory run's evaluation says which factory it trusts: its own, or the flag.
    factory_run = tmp_path / "factory" / STEP
    trained = write_checkpoint(factory_run)
    for kwargs in ({"model": make_model}, {"trust_factory": True}):
        loaded = _run_eval(lambda local, step, kw=kwargs: ckpt.load_model(local, **kw),
                           str(factory_run), 5)  # fmt: skip
        assert torch.equal(loaded.weight, trained.weight)


def test_evalonsaves_copy_is_verified_once(tmp_path, monkeypatch):
    from ray_trainer._checkpoint import format as checkpoint_format

    folder = tmp_path / "run" / STEP
    write_checkpoint(folder)
    hashed = []
    real = checkpoint_format.safe.sha256_file
    monkeypatch.setattr(
        checkpoint_format.safe, "sha256_file", lambda p: hashed.append(p) or real(p)
    )
    _run_eval(lambda local, step: ckpt.load_model(local, model=make_model), str(folder), 5)
    listed = ckpt.listed_files(locate(str(folder)))
    assert sorted(hashed) == sorted(str(folder / n) for n in listed)  # each file once
    # Changed after the copy was verified: a new block hashes again.
    (folder / ckpt.OPTIMIZER_FILE).write_bytes(b"x" * (folder / ckpt.OPTIMIZER_FILE).stat().st_size)
    with pytest.raises(ckpt.CheckpointError, match=r"optimizer\.pt differs"):
        _run_eval(lambda local, step: None, str(folder), 5)


def test_a_recorded_factory_that_cannot_be_imported_names_it(tmp_path):
    folder = tmp_path / "run" / STEP
    write_checkpoint(folder, actor_state=False)
    set_spec(folder, factory="no_such_module_xyz:build")
    with pytest.raises(ModelLoadError, match=r"'no_such_module_xyz:build' cannot be imported"):
        ckpt.load_model(str(folder), trust_factory=True)
    assert ckpt.load_model(str(folder), model=make_model) is not None


def test_a_checkpoint_of_the_older_pickled_format_is_refused_unread(tmp_path):
    run = tmp_path / "run"
    folder = run / STEP
    folder.mkdir(parents=True)
    marker = tmp_path / "pwned"
    evil = evil_bytes(marker)
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
    folder = tmp_path / STEP
    write_checkpoint(folder, sharded=True, actor_state=False)
    listed = ckpt.listed_files(locate(str(folder)))
    assert set(listed) == set(files_of(folder))
    for name, entry in listed.items():
        assert entry == {
            "size": (folder / name).stat().st_size,
            "sha256": sha256_file(str(folder / name)),
        }


@pytest.mark.parametrize(
    "device, said",
    [
        ("CPU:0", "device='CPU:0' is not a torch device; give one as torch names it"),
        ("cuda:7", "device='cuda:7' does not exist on this machine (cuda devices: "),
        (3.5, "device=3.5 is not a torch device"),
    ],
)
def test_a_device_that_does_not_exist_is_refused_before_the_checkpoint_is_read(
    tmp_path, monkeypatch, device, said
):
    """`load_model(path, device=...)` (issue 74, point 5): a device torch does not name, or one
    this machine lacks (cuda:7 with fewer GPUs: none here, or up to 7 on a GPU host), is a
    ValueError naming `device`, raised before the checkpoint is opened or its model built."""
    from ray_trainer._checkpoint import reading

    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    folder = tmp_path / STEP
    write_checkpoint(folder)
    opened = []
    monkeypatch.setattr(reading, "open_checkpoint", lambda *a, **k: opened.append(a))
    with pytest.raises(ValueError, match=r"^load_model: ") as info:
        ckpt.load_model(str(folder), device=device, model=make_model)
    assert said in str(info.value) and opened == []
    monkeypatch.undo()
    assert ckpt.load_model(str(folder), device="cpu", model=make_model).weight.device.type == "cpu"
