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
    if isinstance(value, (list, tuple)) and len(value) > _LONG and _plain_items(value):
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
    kind = type(value)
    return hasattr(kind, "__getitem__") and hasattr(kind, "__len__") and not callable(value)


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
