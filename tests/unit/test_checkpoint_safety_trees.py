"""Generated checkpoint trees: whatever is done to a checkpoint's files, no reader runs code from
it and none raises anything but a clear checkpoint error (issue 70, part 1).

Hypothesis changes a sound DDP or FSDP checkpoint (each written once per module,
`tests/support/checkpoint_trees.py`) by one to four steps: a file added (at a name a reader
opens, or one none does), removed, renamed, overwritten with random bytes, truncated, replaced
by a pickle whose ``__reduce__`` creates a marker file, a DCP save of such pickles put in
``shards/``, the model spec's fields or the trainer state's strategy changed; after each step
the manifests are brought up to date with the files (as a forger would) or left as they were.
Then every reader reads it: ``load_model`` (no flag, and with ``model=``), ``load_model_state``,
``open_checkpoint``, ``verify``, the driver's ``resume_from`` check, the worker's resume read,
the actor's restore and ``EvalOnSave``'s copy. The marker never appears, no module the spec
names is imported, and every error is a `CheckpointError` or a `ModelLoadError` (the driver's
check: a `TrainingArgsError`) whose message names the checkpoint. (``load_model(...,
trust_factory=True)`` is left out: trusting the checkpoint, it imports and calls the factory
it names, by design.) Derandomized and bounded: 40 examples per strategy, about 20 s here.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import sys

import pytest

hypothesis = pytest.importorskip("hypothesis")
from checkpoint_trees import (  # noqa: E402
    Evil,
    evil_bytes,
    read_every_way,
    relist,
    write_checkpoint,
)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ray_trainer import _checkpoint as ckpt  # noqa: E402
from ray_trainer._errors import TrainingArgsError  # noqa: E402
from ray_trainer._model.spec import ModelLoadError  # noqa: E402

STEP = "checkpoint_00000005"
#: A module that marks its import: a model spec may name it; no reader may import it.
MARKER_MODULE = "ckpt_trees_marker_mod"
EXAMPLES = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
#: Names a step may add or rename a file to: ones a reader opens, and ones none does.
NAMES = [
    "model.pt", "optimizer.pt", "scheduler.pt", "model_spec.json", "trainer_state.json",
    "rank0.pt", "rank1.pt", "rank3.pt", "rank0.complete", "rank1.complete", "rank4.complete",
    "shards/.metadata", "shards/__0_0.distcp", "shards/__1_0.distcp", "shards/x/.metadata",
    "hf/pytorch_model.bin", "hf/config.json", "hf_adapter/adapter_model.bin", "a.distcp",
    "actor_state.pt", "eval/gen.jsonl", "notes.txt", "mine/ema.pt", "model_spec.pkl",
]  # fmt: skip
FACTORIES = ["os:getcwd", "tempfile:mkdtemp", f"{MARKER_MODULE}:build", "no_such_mod:x", ""]
#: A model spec's fields, the factory thrice as often: the one that names code.
SPEC_FIELDS = ["factory"] * 3 + ["model", "demo", "max_length", "on_jsonl", "tokenizer"]
SPEC_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 10**6), st.text(max_size=8),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.sampled_from(["d_model", "n_heads", "bogus", "n_layers"]),
                    st.integers(-1, 8) | st.text(max_size=3), max_size=2),
)  # fmt: skip
STEPS = st.sampled_from(
    ["add", "remove", "rename", "bytes", "truncate", "poison", "dcp", "spec", "strategy"]
)


def _other_weights() -> bytes:
    """The weights of another model (shapes and names this checkpoint's model does not have)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(torch.nn.Linear(4, 2).state_dict(), buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The sound checkpoints, written once; each example works on a copy. A module on
    ``sys.path`` whose import creates a marker file (a model spec may name it)."""
    root = tmp_path_factory.mktemp("trees")
    for kind in ("ddp", "fsdp"):
        write_checkpoint(root / "base" / kind / STEP, sharded=kind == "fsdp")
    marker = root / "module-imported"
    (root / "modules").mkdir()
    (root / "modules" / f"{MARKER_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n\ndef build():\n    return 'not a model'\n"
    )
    sys.path.insert(0, str(root / "modules"))
    yield {"root": root, "module_marker": marker, "count": itertools.count()}
    sys.path.remove(str(root / "modules"))


def _files(folder):
    return sorted(
        os.path.relpath(os.path.join(top, n), folder)
        for top, _, names in os.walk(folder)
        for n in names
    )


def _put(folder, name, data):
    """Write `data` at `name` under `folder`, unless a folder of that name is in the way."""
    target = folder / name
    if target.is_dir() or any(p.is_file() for p in target.parents if folder in p.parents):
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _apply(data, folder, marker, step):
    """One change to the checkpoint at `folder` (`step`, its details drawn from `data`)."""
    files = _files(folder)
    pick = (lambda: data.draw(st.sampled_from(files))) if files else (lambda: None)
    content = st.one_of(
        st.binary(max_size=64),
        st.just(evil_bytes(marker)),
        st.just(_other_weights()),
        st.sampled_from(files or ["x"]),
    )
    if step == "add":
        blob = data.draw(content)
        if isinstance(blob, str):  # a copy of one of its files
            blob = (folder / blob).read_bytes() if (folder / blob).is_file() else b""
        _put(folder, data.draw(st.sampled_from(NAMES)), blob)
    elif step == "remove" and files:
        os.remove(folder / pick())
    elif step == "rename" and files:
        source, target = pick(), data.draw(st.sampled_from(NAMES))
        blob = (folder / source).read_bytes()
        os.remove(folder / source)
        _put(folder, target, blob)
    elif step == "bytes" and files:
        blob = data.draw(st.one_of(st.binary(max_size=256), st.just(_other_weights())))
        (folder / pick()).write_bytes(blob)
    elif step == "truncate" and files:
        name = pick()
        blob = (folder / name).read_bytes()
        (folder / name).write_bytes(blob[: data.draw(st.integers(0, max(len(blob) - 1, 0)))])
    elif step == "poison" and files:
        (folder / pick()).write_bytes(evil_bytes(marker))
    elif step == "dcp":
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(folder / ckpt.SHARDS_DIR, ignore_errors=True)
        import torch

        key = data.draw(st.sampled_from(["model", "optim"]))
        evil = data.draw(st.booleans())  # pickles, or tensors of other shapes
        value = (lambda: Evil(str(marker))) if evil else (lambda: torch.ones(4, 4))
        state = {key: {"weight": value(), "bias": value()}}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder / ckpt.SHARDS_DIR)),
                 no_dist=True)  # fmt: skip
    elif step == "spec" and (folder / ckpt.MODEL_SPEC_FILE).is_file():
        try:
            record = json.loads((folder / ckpt.MODEL_SPEC_FILE).read_text())
        except ValueError:
            record = {}
        if isinstance(record, dict):
            field = data.draw(st.sampled_from(SPEC_FIELDS))
            values = st.sampled_from(FACTORIES) if field == "factory" else SPEC_VALUES
            record[field] = data.draw(values)
            (folder / ckpt.MODEL_SPEC_FILE).write_text(json.dumps(record))
    elif step == "strategy" and (folder / ckpt.STATE_FILE).is_file():
        try:
            state = json.loads((folder / ckpt.STATE_FILE).read_text())
        except ValueError:
            return
        if isinstance(state, dict):
            state["strategy"] = data.draw(st.sampled_from(["ddp", "fsdp", "zero", 3]))
            (folder / ckpt.STATE_FILE).write_text(json.dumps(state))
    if data.draw(st.booleans()):  # a forger: the manifests made to match (what they can)
        _relist(folder)


def _relist(folder):
    """Every manifest that is still JSON brought up to the files as they are (`relist`), the
    DCP files under shards/ added to rank 0's."""
    shards = [f"{ckpt.SHARDS_DIR}/{n}" for n in _files(folder / ckpt.SHARDS_DIR)] if (
        folder / ckpt.SHARDS_DIR
    ).is_dir() else []  # fmt: skip
    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
        relist(folder, add=[n for n in shards if (folder / n).is_file()])  # JSON manifests


def _check(trees, kind, data):
    n = next(trees["count"])
    folder = trees["root"] / f"ex{n}" / "run" / STEP
    shutil.copytree(trees["root"] / "base" / kind / STEP, folder)
    marker = trees["root"] / f"ex{n}" / "pwned"
    for step in data.draw(st.lists(STEPS, min_size=1, max_size=4)):
        _apply(data, folder, marker, step)
    errors = read_every_way(folder, trust=False)
    hypothesis.event(f"{len(errors)} readers refused")
    for error in errors.values():
        hypothesis.event(f"{type(error).__name__}: {str(error).split(': ', 2)[-1][:40]}")
    assert not marker.exists(), sorted(errors)
    assert not trees["module_marker"].exists() and MARKER_MODULE not in sys.modules
    for reader, error in errors.items():
        allowed = (ckpt.CheckpointError, ModelLoadError)
        if reader == "resume_from check":
            allowed = (TrainingArgsError,)
        elif reader == "actor restore":
            allowed = (LookupError,)  # it skips what it cannot read: it restored nothing
        assert isinstance(error, allowed), (reader, repr(error))
        if reader != "actor restore":
            assert STEP in str(error), (reader, repr(error))  # it names the checkpoint
    shutil.rmtree(trees["root"] / f"ex{n}")


@given(data=st.data())
@EXAMPLES
def test_a_changed_ddp_checkpoint_runs_nothing_and_raises_only_checkpoint_errors(trees, data):
    _check(trees, "ddp", data)


@given(data=st.data())
@EXAMPLES
def test_a_changed_fsdp_checkpoint_runs_nothing_and_raises_only_checkpoint_errors(trees, data):
    _check(trees, "fsdp", data)
