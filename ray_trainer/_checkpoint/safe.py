"""Every process: reading a checkpoint's files without running code from them.

Runs wherever a checkpoint is written or read: the training workers (their rank parts), the
callback actor (its callbacks' state), the driver, evaluation tasks and notebooks. Nothing in a
checkpoint goes through a full unpickler: state is plain data (tensors, numbers, strings, bools,
None, lists, tuples and dicts with string keys), written with ``torch.save`` and read with
``torch.load(weights_only=True)``, whose unpickler builds nothing else; the one pickle that
torch.distributed.checkpoint writes for FSDP shards (``.metadata``) is read by an unpickler
that builds only DCP's own metadata records, and DCP's entries that are not tensors are read
weights-only too (``dcp_reader``). Every file's SHA-256 is in its rank's manifest
(``format.py``) and checked before the file is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

from ray_trainer._errors import CheckpointError

_PLAIN = (str, int, float, bool, type(None))  # exact types: a subclass needs code to build
_HASH_BLOCK = 1 << 20


class UnsafeStateError(TypeError):
    """A callback's ``state_dict()`` holds what a weights-only checkpoint cannot hold."""


def unsafe_path(value: Any, path: str = "state_dict()") -> str | None:
    """Where inside `value` something other than plain data is (``"state_dict()['a'][0] is a
    Foo"``), or None when all of it is plain: tensors, numbers, strings, bools, None, lists,
    tuples and dicts with string keys (not their subclasses: a named tuple or an enum would
    need its class to be built)."""
    if type(value) in _PLAIN or _is_tensor(value):
        return None
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            found = unsafe_path(item, f"{path}[{i}]")
            if found:
                return found
        return None
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) is not str:
                return f"{path} has the key {key!r}, a {type(key).__name__}, not a str"
            found = unsafe_path(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    kind = type(value)
    return f"{path} is a {kind.__module__}.{kind.__qualname__}"


def plain(value: Any) -> Any:
    """`value` with numpy scalars (a metric, often) turned into Python numbers; the rest as is."""
    kind = type(value)
    if kind in (dict, OrderedDict):
        return kind((k, plain(v)) for k, v in value.items())
    if kind in (list, tuple):
        return kind(plain(v) for v in value)
    if kind.__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def check_state(callback_key: str, state: Any) -> None:
    """Refuse a callback's ``state_dict()`` result that is not plain data, naming the callback
    and the key (`UnsafeStateError`)."""
    found = unsafe_path(state)
    if found is not None:
        raise UnsafeStateError(
            f"callback {callback_key!r}: {found}; a checkpoint holds only tensors, numbers, "
            "strings, bools, None, lists and dicts with str keys (it is read without running "
            "code): return those from state_dict() (e.g. a dataclass as its fields' dict, a "
            "datetime as an ISO string) and rebuild the objects in load_state_dict()"
        )


def dumps(value: Any) -> bytes:
    """Plain data as bytes that `loads` reads back without running code."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def loads(data: bytes, name: str) -> Any:
    """Plain data written by `dumps` (or by ``torch.save`` of tensors and state dicts), read
    weights-only: a file that holds anything else is refused (`CheckpointError` naming
    `name`), nothing in it is run."""
    import torch

    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        said = [line for line in lines if "Unsupported" in line or "GLOBAL" in line]
        first = (said or lines or [type(e).__name__])[0]
        raise CheckpointError(
            f"{name}: refused: it holds objects other than tensors and plain data, which "
            f"reading would have to run code to build ({first[:200]}); it was not written by "
            "this version of ray-trainer, or it was tampered with"
        ) from None
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"{name}: unreadable ({type(e).__name__}: {e})") from None


def load_file(path: str, name: str) -> Any:
    """`loads` of a local file."""
    with open(path, "rb") as f:
        return loads(f.read(), name)


def sha256_file(path: str) -> str:
    """The SHA-256 of a local file, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _is_tensor(value: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # a tensor exists only where torch is imported
    return torch is not None and isinstance(value, torch.Tensor)


# ---- FSDP's DCP metadata ---------------------------------------------------------------------

#: What a ``.metadata`` that DCP wrote names: its metadata records, where each item's bytes
#: are, tensor sizes, dtypes and layouts; nothing else is built.
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records, torch sizes, dtypes and layouts; refuses any other
    global (a ``.metadata`` that names one was not written by DCP)."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"global {module}.{name} is not DCP metadata")


def dcp_reader(shards_dir: str, name: str) -> Any:
    """A ``FileSystemReader`` for FSDP shards that runs no code from them: its ``.metadata`` is
    read by an unpickler that builds DCP's metadata and nothing else (DCP's own reader unpickles
    it whole), a model entry that is not a tensor is refused, and the entries that are not
    tensors (an optimizer's settings: DCP stores them as pickles, "bytes") are read
    weights-only (DCP's own planner reads them with a full unpickler)."""
    import torch.distributed.checkpoint as dcp

    class _Reader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta

            if kwargs.get("rank") is not None:  # DCP's fallback: our saves write one .metadata
                raise CheckpointError(f"{name}: no readable .metadata")
            path = self._get_metadata_path()
            with self.fs.create_stream(path, "rb") as f:
                try:
                    metadata = _MetadataUnpickler(f).load()
                except (pickle.UnpicklingError, AttributeError, TypeError, EOFError) as e:
                    raise CheckpointError(f"{name}: refused shard metadata ({e})") from None
            _check_entries(metadata, name)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            return super().read_data(plan, _WeightsOnlyBytes(planner, name))

    return _Reader(shards_dir)


#: The top-level key of DCP's state that holds the model's weights: tensors, every one.
_MODEL_KEY = "model"


def _check_entries(metadata: Any, name: str) -> None:
    """Refuse DCP metadata that is not DCP's records, or whose model entry is not a tensor
    (a pickle in the shards: what a weight never is)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(metadata, Metadata) or not isinstance(entries, dict):
        raise CheckpointError(f"{name}: refused shard metadata (not DCP's metadata)")
    for key, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata) and str(key).split(".")[0] == _MODEL_KEY:
            raise CheckpointError(
                f"{name}: refused: its model entry {key!r} is not a tensor but a pickle, "
                "which no save of a model writes (it was tampered with)"
            )


class _WeightsOnlyBytes:
    """A DCP load planner, `planner` but for its entries that are not tensors ("bytes"),
    which are read weights-only (`loads`: plain data, nothing run) and put where `planner`
    would put them."""

    def __init__(self, planner: Any, name: str) -> None:
        self._planner = planner
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._planner, attr)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        fqn = read_item.dest_index.fqn
        if str(fqn).split(".")[0] == _MODEL_KEY:
            raise CheckpointError(f"{self._name}: refused: its model entry {fqn!r} is not a tensor")
        item = loads(value.getvalue(), f"{self._name}: entry {fqn!r}")
        planner = self._planner
        if getattr(planner, "flatten_state_dict", False):  # as DefaultLoadPlanner.load_bytes
            set_element(planner.original_state_dict, planner.mappings[fqn], item)
        else:
            planner.state_dict[fqn] = item


@contextlib.contextmanager
def shard_errors(name: str) -> Iterator[None]:
    """DCP's ``CheckpointException`` (a ``BaseException``: an ``except Exception`` misses it)
    raised as a `CheckpointError` naming `name` and what each rank met (e.g. a refused
    ``.metadata``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for _, f in sorted(e.failures.items())]
        refused = [f for f in failures if isinstance(f, CheckpointError)]
        if refused:  # ours, raised inside DCP (a refused entry): it says it all
            raise CheckpointError(str(refused[0])) from None
        met = "; ".join(
            f"rank {rank}: {_first_line(failure[0] if isinstance(failure, tuple) else failure)}"
            for rank, failure in sorted(e.failures.items())
        )
        raise CheckpointError(f"{name}: its shards could not be read ({met})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text[:400]}"
