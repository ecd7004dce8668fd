"""Driver: what a run trains, in one line, so that a later run under the same name must match it.

Runs in the driver, before ``ray.init()``: `fingerprint` is recorded in the run folder's
``run.json`` and compared by ``checks/inputs.py``'s ``check_storage``. Names are not enough: two
``lambda``s, or two torch Datasets of one class, share a name. So:

* a string (a model name, a data path or URI) and None stand for themselves;
* a model factory or data factory (a function, a class, a ``functools.partial``, a callable
  object) by its code: the bytecode, constants and names of each function, its defaults and
  closure values, the plain values (numbers, strings, containers) of the globals it reads, and
  the functions and classes of its own module that it calls, recursively.
  Line numbers and comments do not count, so editing the script elsewhere does not change it;
* a ``datasets.Dataset`` by its content fingerprint (what ``datasets`` keeps, else a digest of
  its table);
* a ``ray.data.Dataset`` by its plan (`ray_dataset_digest`): each operator by its kind and
  parameters, each function it applies by its code (as a factory above), and what the plan
  reads: the files' names, sizes and modification times (as a file source's token cache is
  fingerprinted), or the content of blocks it holds in memory (``from_items``, a materialized
  dataset), digested by Ray tasks where the blocks are. Nothing reads the dataset itself: a
  second run on the same files reuses the token cache with no pass over the data. A plan that
  reads neither files nor blocks (a database, a custom ``Datasource``) is fingerprinted by its
  parameters alone, so its token cache is built again at every start (``Source.stable``);
* another Dataset (torch's) by its class's code, its length and a digest of a few sampled items
  (the first, the last and evenly spaced ones between; `SAMPLED_ITEMS` in all).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pickle
import re
import types
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._config.rules import is_ray_dataset
from ray_trainer._data.sources import table_digest

#: How many items of a map-style Dataset its fingerprint reads.
SAMPLED_ITEMS = 8
_DIGITS = 16  # of the sha256 shown in run.json
_DEPTH = 8  # how deep nested values and the code they call are followed
_LONG = 256  # a longer list of plain values is hashed whole, through pickle (C speed)
_PLAIN = (str, bytes, int, float, bool, complex, type(None), list, tuple, dict, set, frozenset)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a default repr's memory address: not content


def fingerprint(args: TrainingArgs) -> str:
    """What a run trains, in one line: a later run under the same name must match it."""
    demo = sorted(args.demo.items())
    return f"model={describe(args.model)};data={describe(args.data)};demo={demo}"


def same_run(recorded: str | None, args: TrainingArgs) -> bool:
    """True when `recorded` (a ``run.json`` fingerprint) is what `args` train. A record written
    before factories were fingerprinted by code (names only, no ``#``) matches by name, so that
    such a run can still be continued; the next launch records the full fingerprint."""
    if recorded == fingerprint(args):
        return True
    if recorded is None or "#" in recorded:
        return False
    return recorded == _by_name(args)


def _by_name(args: TrainingArgs) -> str:
    """The fingerprint as it was before: factories and Datasets by name."""

    def name(v: Any) -> str:
        if v is None or isinstance(v, str):
            return str(v)
        return getattr(v, "__qualname__", type(v).__qualname__)

    return f"model={name(args.model)};data={name(args.data)};demo={sorted(args.demo.items())}"


def describe(value: Any) -> str:
    """A string or None as itself; anything else as its name and a digest of its code and
    content."""
    if value is None or isinstance(value, str):
        return str(value)
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    if is_ray_dataset(value):
        return f"{name}#{ray_dataset_digest(value)[0]}"
    return f"{name}#{content_digest(value)}"


def content_digest(value: Any) -> str:
    """The sha256 (first `_DIGITS` hex digits) of `value`'s code and content."""
    h = hashlib.sha256()
    _feed(value, h, {}, depth=0)
    return h.hexdigest()[:_DIGITS]


def _feed(value: Any, h: Any, seen: dict[int, Any], depth: int) -> None:
    """Feed what identifies `value` into the hash `h` (`seen` stops cycles)."""
    if isinstance(value, (str, bytes, int, float, bool, complex, type(None))):
        h.update(f"{type(value).__name__}:{value!r};".encode())
        return
    if id(value) in seen or depth > _DEPTH:
        h.update(b"<seen>;")
        return
    seen[id(value)] = value  # kept alive: a freed item's id may be reused by the next one
    if isinstance(value, types.ModuleType):  # e.g. `torch` in a local class's closure: by name
        h.update(f"module:{value.__name__};".encode())
    elif isinstance(value, (list, tuple)) and len(value) > _LONG and _plain_items(value):
        h.update(f"{type(value).__name__}[{len(value)}]:".encode() + pickle.dumps(value, 4))
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        h.update(f"{type(value).__name__}[{len(items)}];".encode())
        for item in items:
            _feed(item, h, seen, depth + 1)
    elif isinstance(value, dict):
        h.update(f"dict[{len(value)}];".encode())
        for key in sorted(value, key=repr):
            _feed(key, h, seen, depth + 1)
            _feed(value[key], h, seen, depth + 1)
    elif isinstance(value, types.CodeType):
        _feed_code(value, h, seen, depth)
    elif isinstance(value, (types.FunctionType, types.MethodType)):
        _feed_function(getattr(value, "__func__", value), h, seen, depth)
    elif isinstance(value, functools.partial):
        h.update(b"partial;")
        for part in (value.func, value.args, value.keywords):
            _feed(part, h, seen, depth + 1)
    elif isinstance(value, type):
        _feed_class(value, h, seen, depth)
    elif type(value).__module__.startswith("datasets") and hasattr(value, "with_format"):
        _feed_hf_dataset(value, h)
    elif _is_tensor_like(value):
        _feed_tensor(value, h)
    elif _is_map_dataset(value):
        _feed_class(type(value), h, seen, depth)
        _feed_items(value, h, seen, depth)
    else:  # a callable object or another value: its class's code and its attributes
        _feed_class(type(value), h, seen, depth)
        state = getattr(value, "__dict__", None)
        if isinstance(state, dict):
            _feed(state, h, seen, depth + 1)
        else:
            h.update(f"repr:{_ADDRESS.sub('', repr(value))};".encode())


def _feed_code(code: types.CodeType, h: Any, seen: dict[int, Any], depth: int) -> None:
    # The bytecode and what it names, never line numbers or the file name.
    h.update(f"code:{code.co_name}:{code.co_argcount}:".encode() + code.co_code + b";")
    h.update(repr((code.co_names, code.co_varnames, code.co_freevars)).encode())
    for const in code.co_consts:
        _feed(const, h, seen, depth + 1)


def _feed_function(fn: types.FunctionType, h: Any, seen: dict[int, Any], depth: int) -> None:
    h.update(f"fn:{fn.__module__}.{fn.__qualname__};".encode())
    _feed_code(fn.__code__, h, seen, depth)
    _feed(fn.__defaults__, h, seen, depth + 1)
    _feed(fn.__kwdefaults__, h, seen, depth + 1)
    for cell in fn.__closure__ or ():
        try:
            _feed(cell.cell_contents, h, seen, depth + 1)
        except ValueError:  # an empty cell
            h.update(b"<empty>;")
    # What it calls from its own module (a class it builds, a helper): their code too; and the
    # plain values of the globals it reads (a width, a path). Modules and other objects: by name.
    for name in sorted(set(_names(fn.__code__))):
        if name not in fn.__globals__:
            continue
        target = fn.__globals__[name]
        if _same_module(target, fn.__module__) or isinstance(target, _PLAIN):
            h.update(f"global:{name};".encode())
            _feed(target, h, seen, depth + 1)


def _feed_class(cls: type, h: Any, seen: dict[int, Any], depth: int) -> None:
    h.update(f"class:{cls.__module__}.{cls.__qualname__};".encode())
    if cls.__module__ == "builtins" or depth > _DEPTH:
        return
    for base in cls.__mro__[1:]:
        if _same_module(base, cls.__module__):
            _feed_class(base, h, seen, depth + 1)
        else:
            h.update(f"base:{base.__module__}.{base.__qualname__};".encode())
    for name in sorted(vars(cls)):
        attr = inspect.getattr_static(cls, name)
        attr = getattr(attr, "__func__", attr)  # staticmethod, classmethod
        if isinstance(attr, property):
            attr = attr.fget
        if isinstance(attr, types.FunctionType):
            h.update(f"attr:{name};".encode())
            _feed_function(attr, h, seen, depth + 1)


def _feed_hf_dataset(dataset: Any, h: Any) -> None:
    fp = getattr(dataset, "_fingerprint", None)
    if fp:
        h.update(f"hf:{fp};".encode())
        return
    table = dataset.with_format("arrow")[:]
    h.update(f"hf-rows:{len(table)};".encode())
    for batch in table.to_batches():
        for column in batch.columns:
            for buffer in column.buffers():
                if buffer is not None:
                    h.update(buffer)


def _feed_items(dataset: Any, h: Any, seen: dict[int, Any], depth: int) -> None:
    n = len(dataset)
    h.update(f"len:{n};".encode())
    if n <= 0:
        return
    count = min(n, SAMPLED_ITEMS)
    picks = sorted({round(i * (n - 1) / max(count - 1, 1)) for i in range(count)})
    for index in picks:
        h.update(f"item:{index};".encode())
        _feed(dataset[index], h, seen, depth + 1)


def _feed_tensor(value: Any, h: Any) -> None:
    array = value.detach().cpu().numpy() if hasattr(value, "detach") else value
    h.update(f"tensor:{array.dtype}:{array.shape};".encode() + array.tobytes())


def _is_tensor_like(value: Any) -> bool:
    return type(value).__module__ in ("torch", "numpy") and hasattr(value, "shape")


def _is_map_dataset(value: Any) -> bool:
    # The class's own methods, not its metaclass's (an Enum member's class has both there).
    own = {name for k in type(value).__mro__ for name in vars(k)}
    return "__getitem__" in own and "__len__" in own and not callable(value)


def _plain_items(items: list | tuple) -> bool:
    return all(isinstance(v, (str, bytes, int, float, bool, type(None))) for v in items)


def _names(code: types.CodeType) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.extend(_names(const))
    return names


def _same_module(target: Any, module: str) -> bool:
    return isinstance(target, (type, types.FunctionType)) and target.__module__ == module


# ---- a ray.data.Dataset ---------------------------------------------------------------------

#: Attributes of a Ray Data operator that say how it runs (its resources, its parallelism), not
#: what it yields, named without their leading underscore: left out, so that a run given more
#: CPUs is still the same run.
_RAY_RUNTIME = frozenset(
    {
        "input_dependencies",
        "output_dependencies",
        "ray_remote_args",
        "ray_remote_args_fn",
        "compute",
        "concurrency",
        "parallelism",
        "num_outputs",
        "min_rows_per_bundled_input",
        "target_num_rows_per_block",
    }
)
_HOLDERS = ("_datasource", "datasource")
_BLOCKS_PER_TASK = 256  # blocks in memory digested by one task  # where a read keeps its paths in other Ray versions


def ray_dataset_digest(dataset: Any) -> tuple[str, bool]:
    """The digest of a ``ray.data.Dataset``'s plan (`_DIGITS` hex digits), and whether it covers
    the records' content: True when every source the plan reads is files (their names, sizes
    and modification times) or blocks in memory (their content). Runs in the driver, with Ray
    initialised; reads no record (a block held in memory is digested where it is, by a task).
    A Ray version whose Dataset has no logical plan is digested by the plan's text: not
    covered."""
    plan = getattr(dataset, "_logical_plan", None)
    if plan is None or not hasattr(plan, "dag"):
        return hashlib.sha256(repr(dataset).encode()).hexdigest()[:_DIGITS], False
    h = hashlib.sha256()
    covered = True
    for op in _operators(plan.dag):
        h.update(f"op:{type(op).__module__}.{type(op).__qualname__};".encode())
        state = vars(op)
        for name in sorted(state):
            if name.lstrip("_") not in _RAY_RUNTIME:
                h.update(f"{name}=".encode())
                _feed_ray_value(state[name], h)
        if not op.input_dependencies:
            content = _leaf_content(op)
            covered = covered and content is not None
            h.update(f"leaf:{content};".encode())
    return h.hexdigest()[:_DIGITS], covered


def _operators(sink: Any) -> list[Any]:
    """The plan's operators, each once, inputs before their users (depth first, in order)."""
    ordered: list[Any] = []
    seen: set[int] = set()

    def visit(op: Any) -> None:
        if id(op) in seen:
            return
        seen.add(id(op))
        for parent in op.input_dependencies:
            visit(parent)
        ordered.append(op)

    visit(sink)
    return ordered


def _feed_ray_value(value: Any, h: Any, depth: int = 0) -> None:
    """An operator's parameter: plain values as they are, functions (the UDFs) by their code,
    blocks held in memory left to `_leaf_content`, anything else by its text (a scanner's
    columns and filters, a schema, an expression), without memory addresses, and where that
    text is only its class (a datasource's), by its attributes that are plain values too (not
    deeper: a datasource's context holds a name unique to each dataset)."""
    if _block_refs(value):
        h.update(b"<blocks>;")
    elif isinstance(value, (str, bytes, int, float, bool, complex, type(None))) or depth > _DEPTH:
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, (list, tuple)):
        h.update(f"{type(value).__name__}[{len(value)}];".encode())
        for item in value:
            _feed_ray_value(item, h, depth + 1)
    elif isinstance(value, dict):
        h.update(f"dict[{len(value)}];".encode())
        for key in sorted(value, key=repr):
            h.update(f"{key!r}:".encode())
            _feed_ray_value(value[key], h, depth + 1)
    elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial, type)) or (
        callable(value) and not type(value).__module__.startswith(("ray.", "pyarrow"))
    ):
        h.update(f"code:{content_digest(value)};".encode())
    else:
        text = _ADDRESS.sub("", repr(value))
        h.update(f"repr:{text};".encode())
        state = getattr(value, "__dict__", None)
        if text.startswith("<") and isinstance(state, dict):  # "<module.Class object>"
            for name in sorted(state):
                if _plain(state[name]):
                    h.update(f"{name}=".encode())
                    _feed_ray_value(state[name], h, depth + 1)


def _plain(value: Any) -> bool:
    """A number, a string, None, or a list, tuple or dict of them."""
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, (str, bytes, int, float, bool, type(None)))


def _leaf_content(op: Any) -> str | None:
    """What a source operator of the plan reads: its blocks in memory (digested by Ray tasks
    where they are) or its files (names, sizes, modification times); None for anything else."""
    import ray

    refs = [ref for value in vars(op).values() for ref in _block_refs(value)]
    if refs:
        # A few tasks, each digesting a run of blocks one at a time: a task per block would
        # start a worker process for each of the hundreds of one-row blocks `from_items` makes.
        digest = ray.remote(_block_digests).options(num_cpus=1, max_retries=1)
        runs = [refs[i : i + _BLOCKS_PER_TASK] for i in range(0, len(refs), _BLOCKS_PER_TASK)]
        return "blocks:" + ",".join(
            d for run in ray.get([digest.remote(r) for r in runs]) for d in run
        )
    for holder in (op, *(getattr(op, name, None) for name in _HOLDERS)):
        paths = _first_attr(holder, ("paths", "_paths"))
        if callable(paths):  # a file datasource's expanded paths, kept in the object store
            paths = paths()
        filesystem = _first_attr(holder, ("filesystem", "_filesystem"))
        if isinstance(paths, str):
            paths = [paths]
        if isinstance(paths, (list, tuple)) and paths and hasattr(filesystem, "get_file_info"):
            listed = _listed(filesystem, list(paths))
            return "files:" + ";".join(listed)
    return None


def _first_attr(holder: Any, names: tuple[str, ...]) -> Any:
    if holder is None:
        return None
    return next((v for n in names if (v := getattr(holder, n, None)) is not None), None)


def _listed(filesystem: Any, paths: list[str]) -> list[str]:
    """Every file at or under `paths` (a folder is listed whole, recursively): ``name|size|mtime``,
    sorted; a missing path is listed as such."""
    import pyarrow.fs as pafs

    found = []
    for path in paths:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.Directory:
            infos = filesystem.get_file_info(pafs.FileSelector(path, recursive=True))
        elif info.type == pafs.FileType.NotFound:
            found.append(f"{path}|missing")
            continue
        else:
            infos = [info]
        found += [f"{i.path}|{i.size}|{i.mtime_ns}" for i in infos if i.type == pafs.FileType.File]
    return sorted(found)


def _block_refs(value: Any, depth: int = 0) -> list[Any]:
    """The object references of blocks inside an operator's parameter (a list of Ray Data's
    ``RefBundle`` s: ``from_items``, a materialized dataset), in order; none elsewhere."""
    import ray

    if isinstance(value, ray.ObjectRef):
        return [value]
    if depth > 3 or isinstance(value, (str, bytes, dict)):
        return []
    if isinstance(value, (list, tuple)):
        return [ref for item in value for ref in _block_refs(item, depth + 1)]
    for name in ("blocks", "ref"):  # a RefBundle's blocks; a block entry's reference
        inner = getattr(value, name, None)
        if isinstance(inner, (list, tuple, ray.ObjectRef)):
            return _block_refs(inner, depth + 1)
    return []


def _block_digests(refs: list[Any]) -> list[str]:
    """A Ray task: the digest of each block's rows (a pyarrow Table, or a pandas DataFrame as
    some sources make), the blocks fetched one at a time (a task holds one block at once)."""
    import pyarrow as pa
    import ray

    found = []
    for ref in refs:
        block = ray.get(ref)
        if not isinstance(block, pa.Table):
            block = pa.Table.from_pandas(block, preserve_index=False)
        found.append(table_digest(block))
        del block
    return found
