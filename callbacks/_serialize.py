"""Shipping callbacks between processes with cloudpickle.

The driver validates and pickles the callback list once (``validate_picklable``); workers and
the callback actor unpickle it (``loads_callbacks``). cloudpickle keeps constructor arguments,
instance state, closures, lambdas, and classes defined in ``__main__`` or inside a function
(those are pickled by value).
"""

from __future__ import annotations

import types
from typing import Any

import cloudpickle

from callbacks._hooks import callback_name, is_function

__all__ = [
    "CallbackPicklingError",
    "dumps_callbacks",
    "loads_callbacks",
    "unpicklable_state",
    "validate_picklable",
]

_MAX_DEPTH = 8  # how deep to look for the value that cannot be pickled
_MAX_CHILDREN = 200  # per container, to keep the search bounded


class CallbackPicklingError(TypeError):
    """A callback cannot be sent to the workers or the callback actor.

    Raised in the driver before anything starts; the message names the callback (its name and
    position) and the attribute or closure variable that cannot be pickled.
    """


def dumps_callbacks(callbacks: list[Any]) -> bytes:
    """Pickle a list of callbacks (objects and functions) with cloudpickle."""
    return cloudpickle.dumps(list(callbacks))


def loads_callbacks(data: bytes) -> list[Any]:
    """Unpickle what ``dumps_callbacks`` produced (in a worker or on the callback actor)."""
    callbacks = cloudpickle.loads(data)
    if not isinstance(callbacks, list):
        raise TypeError(f"expected a pickled list of callbacks, got {type(callbacks).__name__}")
    return callbacks


def validate_picklable(callbacks: Any, labels: list[str] | None = None) -> bytes:
    """Check that the callbacks survive a cloudpickle round trip; return the pickled bytes.

    ``labels`` name where each callback was given (``"callbacks[0]"``, ``"on_save"``...);
    by default its position in ``callbacks``.

    Raises:
        CallbackPicklingError: naming the callback and the attribute that cannot be pickled,
            or the callback that pickles but cannot be unpickled.
    """
    cbs = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    labels = labels or [f"callbacks[{i}]" for i in range(len(cbs))]
    try:
        data = dumps_callbacks(cbs)
    except Exception as exc:
        raise CallbackPicklingError(_explain_dumps(cbs, labels, exc)) from exc
    try:
        loads_callbacks(data)
    except Exception as exc:
        raise CallbackPicklingError(_explain_loads(cbs, labels, exc)) from exc
    return data


def unpicklable_state(key: str, state: Any) -> None:
    """Raise ``CallbackPicklingError`` when a callback's ``state_dict()`` result cannot be
    pickled, naming the callback (its ``state_key``) and the value inside the state."""
    error = _pickle_error(state)
    if error is None:
        return
    found = _culprit(state, [("value", "state_dict()")], _MAX_DEPTH)
    where = ""
    if found is not None:
        path, value, error = found
        where = f": {' -> '.join(f'{kind} {expr}' for kind, expr in path)} is a {_type_name(value)}"
    raise CallbackPicklingError(
        f"the state_dict() of callback {key!r} cannot be pickled{where} ({_describe(error)}); "
        "return plain values (numbers, strings, lists, dicts, tensors) from state_dict()"
    )


def _explain_dumps(cbs: list[Any], labels: list[str], exc: Exception) -> str:
    for cb, where in zip(cbs, labels, strict=True):
        if _pickle_error(cb) is None:
            continue
        label = f"callback {callback_name(cb)!r} ({where}) cannot be pickled"
        is_fn = is_function(cb)
        root = [] if is_fn else [("attribute", "self")]
        found = _culprit(cb, root, _MAX_DEPTH)
        hint = (
            "create it inside the function instead of closing over it"
            if is_fn
            else "create it lazily in on_train_begin, or drop it in __getstate__"
        )
        if found is None or not found[0]:
            return f"{label} ({_describe(_pickle_error(cb))}); {hint}"
        path, value, error = found
        where = " -> ".join(f"{kind} '{expr}'" for kind, expr in path)
        return f"{label}: {where} holds a {_type_name(value)} ({_describe(error)}); {hint}"
    return f"the callbacks cannot be pickled together ({_describe(exc)})"


def _explain_loads(cbs: list[Any], labels: list[str], exc: Exception) -> str:
    for cb, where in zip(cbs, labels, strict=True):
        try:
            cloudpickle.loads(cloudpickle.dumps(cb))
        except Exception as error:
            return (
                f"callback {callback_name(cb)!r} ({where}) pickles but cannot be "
                f"unpickled ({_describe(error)}); check its __reduce__/__setstate__ and what "
                "its class needs at import time"
            )
    return f"the callbacks pickle but cannot be unpickled ({_describe(exc)})"


def _culprit(value: Any, path: list[tuple[str, str]], depth: int):
    """The deepest (path, value, error) under ``value`` that fails to pickle, or None."""
    error = _pickle_error(value)
    if error is None:
        return None
    if depth > 0:
        for child_path, child in _children(value, path):
            found = _culprit(child, child_path, depth - 1)
            if found is not None:
                return found
    return path, value, error


def _children(value: Any, path: list[tuple[str, str]]):
    head, (kind, expr) = path[:-1], (path[-1] if path else ("", ""))
    if isinstance(value, types.FunctionType):
        code = value.__code__
        for name, cell in zip(code.co_freevars, value.__closure__ or (), strict=False):
            try:
                yield [*path, ("closure variable", name)], cell.cell_contents
            except ValueError:  # empty cell
                continue
        for name in code.co_names:
            if name in value.__globals__ and not isinstance(
                value.__globals__[name], types.ModuleType
            ):
                yield [*path, ("global", name)], value.__globals__[name]
    elif isinstance(value, dict):
        for key in list(value)[:_MAX_CHILDREN]:
            yield [*head, (kind, f"{expr}[{key!r}]")], value[key]
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, item in enumerate(list(value)[:_MAX_CHILDREN]):
            yield [*head, (kind, f"{expr}[{i}]")], item
    elif not isinstance(value, (type, types.ModuleType)) and hasattr(value, "__dict__"):
        for name, item in list(vars(value).items())[:_MAX_CHILDREN]:
            yield [*head, (kind or "attribute", f"{expr}.{name}" if expr else name)], item
        cls = type(value)
        if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:  # pickled by value
            for name, item in list(vars(cls).items())[:_MAX_CHILDREN]:
                if not name.startswith("__"):
                    yield [*head, ("class attribute", f"{cls.__name__}.{name}")], item


def _pickle_error(value: Any) -> Exception | None:
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        return exc
    return None


def _describe(error: BaseException | None) -> str:
    return f"{type(error).__name__}: {error}" if error is not None else "unknown error"


def _type_name(value: Any) -> str:
    cls = type(value)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )
