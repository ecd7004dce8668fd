"""Every process: the checkpoint format, written by the workers, complete or refused.

Every rank writes its own part into its own temporary folder: its RNG state and the state of its
stateful callbacks, and under ``strategy="fsdp"`` its shards of the model and optimizer
(``shards/``, written with torch.distributed.checkpoint); rank 0 also writes the trainer state,
the scheduler, how to build the model (``model_spec.json``), under DDP the whole model and
optimizer (``model.pt``, ``optimizer.pt``), and for a Hugging Face model the ``hf/`` export.
Nothing in a checkpoint needs code to be read (``safe.py``): JSON, and tensors and plain data
read weights-only; a callback state that is not plain data is refused at the save.
Ray Train uploads the folders of all ranks into one checkpoint on the run's storage (with
``async_checkpoint`` each rank writes its files there itself, in the background). Each rank
writes ``rank<r>.complete`` last: a JSON manifest of its files, their sizes and SHA-256, and of
the save it belongs to (the run's launch and attempt). A checkpoint is complete only when rank
0's manifest is there, names the world size, and the manifest of every rank names the same save
and matches the sizes of the files in storage (`check_complete`, cheap); it is read only after
the content of every file matches its hash too (`check_content`), and when no file that a reader
opens is there unlisted (`unlisted_readable`). Checkpoints of the older
format (1: pickled state, ``model_spec.pkl``) are refused, never unpickled. A sharded checkpoint holds a tied weight
once; ``TrainerState.extra["tied_weights"]`` names its other names. Reads go through the storage
layer (``_storage.py``): a checkpoint path may be a local path or a URI.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow.fs as pafs

from ray_trainer._checkpoint import safe
from ray_trainer._checkpoint.names import checkpoint_names
from ray_trainer._errors import CheckpointError
from ray_trainer._storage import Location, locate

if TYPE_CHECKING:
    import torch  # noqa: F401  (imported lazily: the callback actor reads manifests without torch)

logger = logging.getLogger("ray_trainer")

FORMAT_VERSION = 2  # 1: pickled callback state and model spec, no hashes (refused)
MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
STATE_FILE = "trainer_state.json"
MODEL_SPEC_FILE = "model_spec.json"
#: Format 1's model spec, a pickle: named when such a checkpoint is refused.
OLD_MODEL_SPEC_FILE = "model_spec.pkl"
SHARDS_DIR = "shards"  # FSDP: every rank's DCP shards of model and optimizer, and .metadata
#: The DCP metadata of a sharded checkpoint (it names the shard files DCP reads).
SHARD_METADATA = f"{SHARDS_DIR}/.metadata"
HF_DIR = "hf"  # a Hugging Face model's export: config, safetensors, tokenizer
#: With ``lora_export="both"``: the PEFT adapter (the merged model is in ``hf/``).
HF_ADAPTER_DIR = "hf_adapter"


class OldCheckpointError(CheckpointError):
    """A checkpoint of the older format (pickled state): refused, never unpickled."""


@dataclass
class TrainerState:
    """Where training stands; enough to resume at the same step and data position."""

    global_step: int = 0
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps already taken in `epoch`
    samples_seen: int = 0
    tokens_seen: int = 0
    world_size: int = 1  # the workers a step's samples were counted for (elastic: its max)
    stop_reason: str | None = None
    strategy: str = "ddp"  # how the model and optimizer are stored: "ddp" whole, "fsdp" sharded
    extra: dict[str, Any] = field(default_factory=dict)


#: ``TrainerState.extra`` key: a sharded checkpoint's tied weights, each stored once under the
#: first of its names; the other names map to it ({"lm_head.weight": "transformer.wte.weight"}).
TIED_WEIGHTS = "tied_weights"


def shared_storage_aliases(state: dict[str, Any]) -> dict[str, str]:
    """The tied names of a state dict of whole tensors: a tensor sharing another's storage."""
    first: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        if not hasattr(t, "data_ptr") or t.numel() == 0:
            continue
        key = (t.device, t.data_ptr(), tuple(t.shape), t.dtype)
        if key in first:
            aliases[name] = first[key]
        else:
            first[key] = name
    return aliases


def rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_rank_part(
    folder: str,
    *,
    rank: int,
    world_size: int,
    callback_state: dict[str, Any],
    user_state: dict[str, Any],
    scheduler: dict[str, Any] | None = None,
    trainer_state: TrainerState | None = None,
    model_spec: Any = None,
    extra_files: list[str] = (),
    save_id: str | None = None,
    complete: bool = True,
) -> dict[str, dict[str, Any]]:
    """Write this rank's files into `folder`, the completion manifest last (unless `complete`
    is False: the caller writes it, with `manifest`, once its other files are written too).
    `extra_files` are paths relative to `folder` that this rank already wrote there (the model
    and optimizer, ``_worker/checkpoints/saving.write_state``; the HF export): they go into its
    manifest too. `model_spec` is a `ModelSpec` or its ``record()``. `save_id` names this save: a
    checkpoint whose ranks' manifests name different saves is incomplete. A callback state or
    user_state that is not plain data is refused (`safe.UnsafeStateError`, naming the callback
    and the key) before anything is written. Returns the files (relative name -> `file_entry`)."""
    callback_state = {key: safe.plain(state) for key, state in callback_state.items()}
    user_state = safe.plain(user_state)
    for key, state in callback_state.items():
        safe.check_state(key, state)
    safe.check_state("user_state", user_state)
    files = {name: file_entry(folder, name) for name in extra_files}

    def put(name: str, data: bytes) -> None:
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
        files[name] = file_entry(folder, name)

    if rank == 0:
        assert trainer_state is not None
        if scheduler is not None:
            put(SCHEDULER_FILE, safe.dumps(scheduler))
        put(STATE_FILE, json.dumps({"format": FORMAT_VERSION, **trainer_state.__dict__}).encode())
        if model_spec is not None:  # how to build the model again, as data
            if hasattr(model_spec, "record"):
                model_spec = model_spec.record()
            put(MODEL_SPEC_FILE, json.dumps(model_spec, indent=1).encode())
    # Plain data only (checked above): read back weights-only, nothing in it runs.
    put(
        f"rank{rank}.pt",
        safe.dumps({"rng": rng_state(), "callbacks": callback_state, "user_state": user_state}),
    )
    if not complete:
        return files
    tmp = os.path.join(folder, f".rank{rank}.complete.tmp")
    with open(tmp, "wb") as f:
        f.write(manifest(rank, world_size, files, save_id))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, manifest_name(rank)))
    return files


def file_entry(folder: str, name: str) -> dict[str, Any]:
    """A manifest's record of the file `name` under `folder`: its size and SHA-256."""
    path = os.path.join(folder, name)
    return {"size": os.path.getsize(path), "sha256": safe.sha256_file(path)}


def manifest_name(rank: int) -> str:
    """The file whose presence says that `rank`'s part of a checkpoint is written."""
    return f"rank{rank}.complete"


def manifest(
    rank: int, world_size: int, files: dict[str, dict[str, Any]], save_id: str | None
) -> bytes:
    """The content of `rank`'s completion manifest: its files, their sizes and SHA-256."""
    content = {"format": FORMAT_VERSION, "rank": rank, "world_size": world_size, "files": files}
    if save_id is not None:
        content["save"] = save_id
    return json.dumps(content).encode()


def verify(path: str, filesystem: Any = None) -> TrainerState:
    """Check that every rank's part of the checkpoint at `path` (a local path or a URI, or a
    path on `filesystem`) is there and whole, and that every file's content matches its hash
    (each file is read once, where it is); its trainer state."""
    return verify_location(locate(path, filesystem))


def verify_location(location: Location) -> TrainerState:
    """`verify` of a `Location` (e.g. one that `complete_checkpoints` found)."""
    state = check_complete(location)
    files = listed_files(location)
    check_unlisted(location, files)
    for name, entry in files.items():
        if _sha256(location.child(name)) != entry["sha256"]:
            raise differs(location.name, name)
    return state


def check_complete(location: Location) -> TrainerState:
    """Check that every rank's part of the checkpoint at `location` is there and whole, reading
    only the manifests and the file sizes; its trainer state, or `CheckpointError`."""
    if not location.is_dir():
        raise CheckpointError(f"{location.name}: checkpoint folder does not exist")
    for name, entry in listed_files(location).items():
        if location.child(name).size() != entry["size"]:
            raise CheckpointError(
                f"{location.name}: incomplete checkpoint: {name} is missing or truncated; "
                "resume from an earlier checkpoint"
            )
    return _trainer_state(_read(location.child(STATE_FILE)), f"{location.name}/{STATE_FILE}")


#: `TrainerState`'s counters: whole numbers, none negative (``world_size`` at least 1).
_COUNTERS = ("global_step", "epoch", "step_in_epoch", "samples_seen", "tokens_seen", "world_size")
STRATEGIES = ("ddp", "fsdp")


def _trainer_state(data: bytes | None, name: str) -> TrainerState:
    """The trainer state in `data` (``trainer_state.json``), its fields checked: the counters
    are whole numbers, the strategy one this version reads."""
    try:
        raw = json.loads(data if data is not None else b"")
        raw.pop("format", None)
        state = TrainerState(**raw)
    except (ValueError, TypeError, AttributeError) as e:  # not JSON, or not its fields
        raise CheckpointError(f"{name}: not a trainer state ({e})") from None
    for key in _COUNTERS:
        value = getattr(state, key)
        if type(value) is not int or value < (1 if key == "world_size" else 0):
            raise CheckpointError(f"{name}: not a trainer state ({key} is {value!r})")
    if state.strategy not in STRATEGIES:
        raise CheckpointError(
            f"{name}: strategy {state.strategy!r} is none of {', '.join(STRATEGIES)}"
        )
    if not isinstance(state.extra, dict) or not isinstance(state.stop_reason, (str, type(None))):
        raise CheckpointError(f"{name}: not a trainer state (extra, stop_reason)")
    return state


def listed_files(location: Location) -> dict[str, dict[str, Any]]:
    """Every file that the manifests of the checkpoint at `location` list (relative name ->
    size and SHA-256), after checking that every rank's manifest is there and names the same
    save."""
    manifest0 = _read_manifest(location, 0)
    files: dict[str, dict[str, Any]] = {}
    for rank in range(manifest0["world_size"]):
        manifest = manifest0 if rank == 0 else _read_manifest(location, rank)
        if manifest.get("save") != manifest0.get("save"):  # a rank's part of another save
            raise CheckpointError(
                f"{location.name}: incomplete checkpoint: rank{rank}.complete belongs to "
                "another save of this step; resume from an earlier checkpoint"
            )
        for name, entry in manifest["files"].items():
            if (
                not isinstance(entry, dict)
                or not isinstance(entry.get("sha256"), str)
                or type(entry.get("size")) is not int
            ):
                raise CheckpointError(f"{location.name}: rank{rank}.complete: bad entry {name!r}")
            parts = name.replace("\\", "/").split("/")
            if name.startswith(("/", "\\")) or any(p in ("", ".", "..") for p in parts):
                raise CheckpointError(f"{location.name}: rank{rank}.complete names {name!r}")
            files[name] = entry
    if STATE_FILE not in files:
        raise CheckpointError(f"{location.name}: rank0.complete does not list {STATE_FILE}")
    return files


def check_content(folder: str, location: Location) -> dict[str, dict[str, Any]]:
    """Check that the files of the checkpoint at `location`, as copied into the local `folder`
    (the checkpoint itself on local storage), match the hashes its manifests list (read from
    `folder`, the copy that will be read), and that no file a reader opens is there unlisted
    (`check_unlisted`); `CheckpointError` names the first that differs. The files listed."""
    local = locate(folder)
    files = listed_files(local)
    check_unlisted(local, files, location.name)
    for name, entry in files.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or safe.sha256_file(path) != entry["sha256"]:
            raise differs(location.name, name)
    return files


# ---- the files a reader opens ----------------------------------------------------------------

#: The format's own files at the top of a checkpoint, each opened by some reader (``model_spec.pkl``
#: by none now, but by ray-trainer before format 2).
_READ_AT_TOP = frozenset(
    {MODEL_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, STATE_FILE, MODEL_SPEC_FILE, OLD_MODEL_SPEC_FILE}
)
_RANK_PART = re.compile(r"rank\d+\.pt")
#: Folders whose every file some reader opens: DCP reads ``.metadata`` and the shard files it
#: names; ``from_pretrained``, vLLM and lm-evaluation-harness open the export folder whole.
_READ_FOLDERS = (SHARDS_DIR, HF_DIR, HF_ADAPTER_DIR)


def read_by_a_reader(name: str) -> bool:
    """Whether some reader of checkpoints opens the file `name` (relative to the checkpoint):
    the format's files at the top (``model.pt``, ``optimizer.pt``, ``scheduler.pt``,
    ``trainer_state.json``, ``model_spec.json``, ``rank<r>.pt``...), every file under ``shards/``,
    ``hf/`` and ``hf_adapter/``, and a DCP file (``.metadata``, ``*.distcp``) anywhere.

    Not so, and so harmless when no manifest lists them: the manifests (``rank<r>.complete``:
    one of a rank the save did not have is never read), the callback actor's
    ``actor_state.pt`` (written beside the checkpoint after its save; the actor alone reads it,
    weights-only), ``GenerationEval``'s samples (``eval/``), writers' temporary files, and Ray
    Train's or a user's own files: no reader of ray-trainer opens them."""
    parts = name.replace("\\", "/").split("/")
    if parts[-1] == ".metadata" or parts[-1].endswith(".distcp"):
        return True
    if len(parts) > 1:
        return parts[0] in _READ_FOLDERS
    return name in _READ_AT_TOP or _RANK_PART.fullmatch(name) is not None


def unlisted_readable(location: Location, files: dict[str, Any]) -> list[str]:
    """The files under the checkpoint folder `location` that a reader opens
    (`read_by_a_reader`) but that its manifests do not list (`files`), relative, sorted."""
    base = location.path.rstrip("/") + "/"
    selector = pafs.FileSelector(location.path, allow_not_found=True, recursive=True)
    found = [
        info.path[len(base) :] if info.path.startswith(base) else info.base_name
        for info in location.fs.get_file_info(selector)
        if info.type == pafs.FileType.File
    ]
    return sorted(n for n in found if n not in files and read_by_a_reader(n))


def check_unlisted(location: Location, files: dict[str, Any], where: str | None = None) -> None:
    """Refuse the checkpoint at `location` (`CheckpointError` naming `where`, its name by
    default, and the files) when it holds files that a reader opens but no manifest lists: a
    reader reads only listed, hashed files, and a checkpoint with others beside them is not the
    one its manifests describe (changed after it was written, or left so by a save that
    crashed, which a restart of the run removes)."""
    found = unlisted_readable(location, files)
    if not found:
        return
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    raise CheckpointError(
        f"{where or location.name}: refused: it holds {shown}, which no manifest of it lists "
        "(rank*.complete): readers open only the files a checkpoint's manifests list and hash, "
        "so files that a reader would open were added after its save (or left by a save that "
        "crashed); remove them if you know where they come from, else resume from or load an "
        "earlier checkpoint"
    )


def differs(where: str, name: str) -> CheckpointError:
    """The error for a checkpoint's file whose content does not match its manifest's hash."""
    return CheckpointError(
        f"{where}: {name} differs from what its manifest records (its SHA-256 does not match): "
        "the checkpoint was changed or damaged after it was written; resume from an earlier "
        "checkpoint"
    )


def _sha256(location: Location) -> str:
    import hashlib

    digest = hashlib.sha256()
    with location.fs.open_input_stream(location.path) as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def cut_off(folder: Location) -> bool:
    """True when a rank's manifest of the checkpoint `folder` is missing (rank 0's, or one of
    the ranks its manifest counts): a save cut off while writing. False when it is complete or
    its manifest is unreadable (an unknown format is left alone, never deleted)."""
    text = folder.child(manifest_name(0)).read_text()
    if text is None:
        return True
    try:
        world_size = int(json.loads(text)["world_size"])
    except (ValueError, KeyError, TypeError):
        return False
    return any(folder.child(manifest_name(r)).size() is None for r in range(1, world_size))


def complete_checkpoints(run: Location, holding: str | None = None) -> Iterator[Location]:
    """The complete checkpoints of a run folder, newest first, each checked as it is reached;
    with `holding`, only those that have that file (e.g. the actor's state)."""
    for name in reversed(checkpoint_names(run.listdir())):
        checkpoint = run.child(name)
        if holding is not None and checkpoint.child(holding).size() is None:
            continue
        try:
            check_complete(checkpoint)
        except OldCheckpointError:
            raise  # not skipped: the run would start again from scratch over its checkpoints
        except CheckpointError as e:
            logger.info("skipping %s", e)
            continue
        yield checkpoint


def latest_checkpoint(run_dir: str, filesystem: Any = None) -> str | None:
    """The newest complete checkpoint under a run folder (a local path or a URI), or None."""
    newest = next(complete_checkpoints(locate(run_dir, filesystem)), None)
    return newest.name if newest is not None else None


def _read_manifest(location: Location, rank: int) -> dict[str, Any]:
    file = location.child(manifest_name(rank))
    data = _read(file)
    if data is None:
        raise CheckpointError(
            f"{location.name}: incomplete checkpoint (no rank{rank}.complete): it was not fully "
            "written; resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads(data)
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{file.name}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{file.name}: corrupt manifest (not an object)")
    if manifest.get("format") == 1:
        raise OldCheckpointError(
            f"{location.name} was written by an older ray-trainer (checkpoint format 1): its "
            f"{OLD_MODEL_SPEC_FILE} and rank*.pt are pickles, which run code when they are read, "
            "so this version does not read them. If you trust it, take its weights alone: build "
            f"the model and load_state_dict(torch.load('{MODEL_FILE}', weights_only=True)) (DDP), "
            "then start a new run from that model"
        )
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{file.name}: unknown checkpoint format {manifest.get('format')!r}")
    world = manifest.get("world_size")
    if type(world) is not int or world < 1 or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{file.name}: corrupt manifest (world_size, files)")
    return manifest


def _read(file: Location) -> bytes | None:
    """A file's bytes, or None when there is no such file (a folder of its name is refused)."""
    try:
        return file.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        if file.is_dir():  # pyarrow's error for a folder is a plain OSError
            raise CheckpointError(f"{file.name} is a folder, not a file") from None
        raise
