"""Every process: the rules `TrainingArgs` checks its fields by, and how a refusal reads.

Runs in the driver, before any Ray resource is taken (and wherever args are built again from a
dict). Each rule takes a field's value (or the whole args, for the rules across fields) and
returns it, normalised, or raises ``ValueError`` with a message that names the value and the fix;
`TrainingArgs`'s validators call them, and `format_validation_error` turns pydantic's collection
of those messages into the one `TrainingArgsError` a user reads. The rules of an objective's own
fields live beside the objective (``ray_trainer/_objectives/``).
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterable
from typing import Any

from pydantic import ValidationError

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # the whole name: fullmatch
#: numpy's seed range (``set_seed`` seeds numpy, torch and random with the same number).
SEED_MAX = 2**32 - 1
#: ``data`` values that look like a dataset (they index) but are not one ray-trainer reads.
_NOT_DATA = (bytes, bytearray, list, tuple, dict, set, frozenset)


def no_bool_as_number(v: Any) -> Any:
    """``batch_size: true`` is not 1: a boolean is refused where a number is expected (in a
    number, or in the values of a dict or list of numbers)."""
    inner = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else [v]
    if any(isinstance(x, bool) for x in inner):
        raise ValueError(f"got {v!r}: a boolean where a number goes (true is not 1); give a number")
    return v


def seed(v: int) -> int:
    if not 0 <= v <= SEED_MAX:
        raise ValueError(
            f"seed={v} is outside 0..{SEED_MAX} (2**32 - 1, numpy's seed range, which every "
            "worker seeds); pick e.g. seed=42"
        )
    return v


def run_name(v: str | None) -> str | None:
    if v is not None and not _RUN_NAME.fullmatch(v):
        raise ValueError(
            f"run_name {v!r} must be 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit (it names a folder and a Ray actor)"
        )
    return v


#: A host name or IPv4 address (letters, digits, '.', '-', '_'), or an IPv6 one in brackets.
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")
#: What ``ray_address`` (and ``RAY_ADDRESS``) takes, as a refusal lists it.
RAY_ADDRESS_FORMS = (
    "'auto' (the Ray cluster this machine belongs to), 'local' (a new local Ray), "
    "'host:port' (a cluster's head node, its GCS port: e.g. '10.0.0.1:6379', as `ray start "
    "--head` prints it) or 'ray://host:port' (Ray Client, e.g. 'ray://10.0.0.1:10001')"
)


def ray_address(v: str | None, name: str = "ray_address") -> str | None:
    """``ray_address`` (or the ``RAY_ADDRESS`` variable, `name`): None, or one of the forms
    `ray.init` connects with (:data:`RAY_ADDRESS_FORMS`), checked before Ray is started or
    joined (``"CPU:0"`` made `ray.init` retry a GCS connection for minutes)."""
    if v is None or v in ("auto", "local") or address_host_port(v) is not None:
        return v
    raise ValueError(
        f"{name}={v!r} is not a Ray address; give {RAY_ADDRESS_FORMS}, or leave {name} unset "
        "to train on an embedded local Ray"
    )


def address_host_port(v: str) -> tuple[str, int] | None:
    """The host and port of a ``host:port`` or ``ray://host:port`` address (an IPv6 host
    without its brackets), or None when `v` is not of that form (a port is 1-65535)."""
    host, sep, port = v.removeprefix("ray://").rpartition(":")
    if not sep or not _HOST.fullmatch(host) or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host.strip("[]"), int(port)


def num_workers(v: Any) -> Any:
    """A number of workers, or ``(min, max)`` for an elastic group (``(n, n)`` is ``n``)."""
    if isinstance(v, list | tuple):
        if len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ValueError("num_workers takes a number or [min, max] (two whole numbers)")
        low, high = v
        if low < 1 or low > high:
            raise ValueError(
                f"num_workers=[{low}, {high}]: an elastic size needs 1 <= min <= max; "
                "e.g. num_workers=[1, 4] trains on 1 to 4 workers"
            )
        return (low, high) if low < high else low
    if isinstance(v, int) and not isinstance(v, bool) and v < 1:
        raise ValueError("num_workers must be at least 1")
    return v


def data(v: Any) -> Any:
    """``data`` and ``val_data``: a path (as a str), or an object that holds records."""
    if isinstance(v, (str, os.PathLike)):
        return os.fspath(v)
    if isinstance(v, _NOT_DATA):
        raise ValueError(
            f"got a {type(v).__name__}; pass a file path (JSONL, JSON or Parquet) or a glob, "
            "a save_to_disk folder, a datasets.Dataset, a ray.data.Dataset, a torch Dataset or "
            "a callable returning one (records in memory: datasets.Dataset.from_list(records))"
        )
    if v is None or callable(v) or hasattr(v, "__getitem__") or is_ray_dataset(v):
        return v
    raise ValueError(
        f"got {type(v).__name__}; pass a JSONL file path, a ray.data.Dataset, a torch Dataset, "
        "or a callable returning a Dataset"
    )


def is_ray_dataset(value: Any) -> bool:
    """True for a ``ray.data.Dataset`` (a ``MaterializedDataset`` too), told without importing
    Ray: a Dataset exists only in a process that has imported ``ray.data``."""
    module = sys.modules.get("ray.data")
    return module is not None and isinstance(value, module.Dataset)


def resources(v: dict[str, float] | None) -> dict[str, float] | None:
    """``resources_per_worker``: finite, non-negative amounts, at least one of them above 0."""
    if v is None:
        return v
    negative = {k: x for k, x in v.items() if not 0 <= x < float("inf")}
    if negative:
        raise ValueError(f"{negative}: a worker cannot ask for a negative or a non-finite amount")
    if v and not any(x > 0 for x in v.values()):
        raise ValueError(
            f"{v} asks for nothing, and Ray would place any number of workers on one node; "
            "give each worker a share of a resource, e.g. {'CPU': 1} or {'CPU': 0.5}"
        )
    return v


def filesystem(v: Any) -> Any:
    """``storage_filesystem``: None or a ``pyarrow.fs.FileSystem``."""
    if v is None:
        return v
    import pyarrow.fs

    if not isinstance(v, pyarrow.fs.FileSystem):
        raise ValueError(
            f"got {type(v).__name__}; pass a pyarrow.fs.FileSystem (e.g. "
            "pyarrow.fs.S3FileSystem(endpoint_override=...)), or None and a URI in storage_path"
        )
    return v


def hooks(v: Any) -> list[Any] | None:
    """An ``on_<event>`` field: a function, or a list of them, as a list."""
    if v is None:
        return None
    fns = list(v) if isinstance(v, (list, tuple)) else [v]
    for fn in fns:
        if not callable(fn) or isinstance(fn, type):
            raise ValueError(
                f"got {fn!r}; pass a function taking (context) or a list of such functions"
            )
    return fns


def combination(args: Any) -> None:
    """The rules across fields of a `TrainingArgs` (the objective's own come after, from the
    registry): fields that need another, or that cannot go together."""
    if args.val_data is not None and args.data is None:
        raise ValueError("val_data needs data: set data too, or drop val_data")
    if args.strategy == "fsdp" and args.mixed_precision == "fp16":
        raise ValueError(
            "mixed_precision='fp16' with strategy='fsdp': FSDP's mixed precision here is "
            "bf16 parameters with fp32 reduction; use mixed_precision='bf16' (or 'auto')"
        )
    if args.max_grad_norm is not None and args.max_grad_norm <= 0:
        raise ValueError("max_grad_norm must be positive, or None to turn clipping off")
    _packing(args)
    if args.elastic and args.placement_strategy.startswith("STRICT_"):
        raise ValueError(
            f"placement_strategy={args.placement_strategy!r} with an elastic num_workers="
            f"{list(args.num_workers)}: a strict placement cannot follow nodes that come "
            "and go (the group would wait for its exact shape); use 'PACK' or 'SPREAD', or "
            "a fixed num_workers"
        )
    if args.offload_activations and args.compile:
        raise ValueError(
            "offload_activations=True with compile=True: the offload hooks run in eager "
            "autograd and are not checked under torch.compile; drop one of them (with a "
            "compiled model, activation_checkpointing=True saves memory instead)"
        )
    _loss(args)
    _ranking(args)


def _packing(args: Any) -> None:
    if args.max_tokens_per_batch is not None and not args.packing:
        raise ValueError(
            "max_tokens_per_batch bounds packed micro-batches: set packing=True too, or drop it"
        )
    too_small = (args.max_tokens_per_batch or args.max_length) < args.max_length
    if args.packing and too_small:
        raise ValueError(
            f"max_tokens_per_batch={args.max_tokens_per_batch} is below max_length="
            f"{args.max_length}: a sample of max_length tokens would not fit; raise it "
            "(or lower max_length)"
        )


def _loss(args: Any) -> None:
    if args.liger_kernel and (args.loss_fn is not None or not args.chunked_loss):
        what = "loss_fn" if args.loss_fn is not None else "chunked_loss=False"
        raise ValueError(
            f"liger_kernel=True with {what}: liger-kernel computes the model's loss itself, "
            "without the full logits, in place of the chunked loss; drop one of them"
        )
    if args.loss_chunk_size is not None and not args.chunked_loss:
        raise ValueError(
            "loss_chunk_size sizes the chunked loss: drop it, or set chunked_loss=True"
        )


def _ranking(args: Any) -> None:
    """`checkpoint_score_attribute` ranks checkpoints: it needs a metric name and checkpoints."""
    name = args.checkpoint_score_attribute
    if name is None:
        return
    if not name.strip():
        raise ValueError(
            "checkpoint_score_attribute is empty; name a metric (e.g. 'val_loss' or an "
            "EvalOnSave metric), or None to keep checkpoints by age"
        )
    if args.save_every_steps is None and not args.save_at_end:
        raise ValueError(
            f"checkpoint_score_attribute={name!r} ranks checkpoints, but this run saves none "
            "(save_every_steps=None, save_at_end=False); set save_every_steps"
        )


def format_validation_error(e: ValidationError, fields: Iterable[str]) -> str:
    """pydantic's errors as one message, a line per problem naming the field (with a
    did-you-mean among `fields` for an unknown one) and the value given."""
    lines = [f"invalid TrainingArgs ({e.error_count()} problem(s)):"]
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(args)"
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(field, list(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"  - {field}: unknown field{hint}")
            continue
        value = err.get("input")
        shown = repr(value) if len(repr(value)) < 80 else repr(value)[:77] + "..."
        message = err["msg"].removeprefix("Value error, ")
        lines.append(f"  - {field}: {message} (got {shown})")
    return "\n".join(lines)
