"""Driver and the user's terminal: TrainingArgs fields from config files and ``--set``.

Runs where a config is read: the driver (``ray-trainer run``, ``demo``) and the user's terminal
(``ray-trainer submit`` validates a config before submitting it). ``--set key=value`` values are
parsed as YAML; callbacks given as import strings or ``{class: ..., arguments}`` mappings are
imported and built here, and any failure is one ``TrainingArgsError`` naming the file (or
``--set``) and the entry.

A config file names code: importing a module runs it, and a ``{class: ...}`` entry calls a
constructor. It is as trusted as a script (docs/api.md, "Config files"). What an entry may
call is narrow all the same: only a `TrainerCallback` subclass is ever constructed, checked
after the import and before any call, so that an entry naming another callable (``{class:
"subprocess:call", args: ...}``) is refused without running it. ``ray-trainer submit`` checks
the entries' shape only (``build=False``): nothing of the config is imported or called on the
user's machine; the job builds the callbacks on the cluster.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from callbacks import ALIASES, EVENTS, TrainerCallback
from ray_trainer._errors import TrainingArgsError


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set key=value`` items as fields (values parsed as YAML; ``null`` unsets a field).

    Raises ``TrainingArgsError`` for an item without ``=`` or with an empty value (``max_steps=``
    would silently mean ``None``: write ``max_steps=null`` to mean that).
    """
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise TrainingArgsError(f"--set {item!r}: expected key=value, e.g. max_steps=100")
        if not value.strip():
            raise TrainingArgsError(
                f"--set {item!r}: the value is empty; give one (e.g. {key}=100), or {key}=null "
                "to unset the field"
            )
        try:
            fields[key] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise TrainingArgsError(f"--set {item!r}: the value is not valid YAML ({e})") from None
    return fields


def import_entries(raw: dict[str, Any], source: str, build: bool = True) -> dict[str, Any]:
    """Fields from a config file or ``--set`` with their callbacks imported: ``callbacks``
    entries (``"module:Name"`` or ``{class: "module:Name", ...arguments}``) built, ``on_<event>``
    import strings resolved. Errors name ``source`` (the file, or ``--set``) and the entry.

    With ``build=False`` (``ray-trainer submit``) each entry's shape is checked and nothing is
    imported or called: the callback fields are left out of what is returned, for the other
    fields to be validated alone.
    """
    raw = dict(raw)
    callbacks = raw.get("callbacks") or []
    if not isinstance(callbacks, list):
        callbacks = [callbacks]
    load_callback = _import_callback if build else _callback_shape
    raw["callbacks"] = [
        _load(source, f"callbacks[{i}]", spec, load_callback) for i, spec in enumerate(callbacks)
    ]
    for name in EVENTS | set(ALIASES):
        if isinstance(raw.get(name), (str, list)):
            specs = raw[name] if isinstance(raw[name], list) else [raw[name]]
            load_hook = _import_object if build else _import_string
            raw[name] = [_load(source, name, spec, load_hook) for spec in specs]
    if not build:
        for name in ["callbacks", *EVENTS, *ALIASES]:
            raw.pop(name, None)
    return raw


def _load(path: Path | str, entry: str, spec: Any, load: Callable[[Any], Any]) -> Any:
    """Import (and build) one callback entry of a config file; any failure becomes one
    `TrainingArgsError` naming the file, the entry and what went wrong."""
    try:
        return load(spec)
    except _EntryError as e:
        raise TrainingArgsError(f"{path}: {entry} {_shown(spec)}: {e}") from None


class _EntryError(ValueError):
    """A callback entry of a config file that cannot be loaded; the message says why."""


def _shown(spec: Any) -> str:
    text = repr(spec)
    return f"({text if len(text) <= 80 else text[:77] + '...'})"


def _import_string(spec: Any) -> tuple[str, str]:
    """``(module, attribute path)`` of an import string; nothing is imported."""
    if not isinstance(spec, str):
        raise _EntryError("expected an import string like 'package.module:Name'")
    module, sep, attr = spec.partition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise _EntryError("not an import string like 'package.module:Name'")
    return module, attr


def _import_object(spec: Any) -> Any:
    module, attr = _import_string(spec)
    try:
        obj: Any = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise _EntryError(
            f"no module named {e.name!r} (is it installed, or on PYTHONPATH?)"
        ) from None
    except Exception as e:  # the user's module raised while being imported
        raise _EntryError(f"importing {module!r} raised {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise _EntryError(f"{module!r} has no attribute {part!r}")
        obj = getattr(obj, part)
    return obj


def _import_callback(spec: Any) -> Any:
    """A callback entry built: a `TrainerCallback` subclass constructed (with the mapping's
    arguments), or a function returned as it is (a function callback; nothing calls it here)."""
    _callback_shape(spec)
    if isinstance(spec, str):
        obj = _import_object(spec)
        return _construct(obj, {}, spec) if isinstance(obj, type) else obj
    kwargs = {k: v for k, v in spec.items() if k != "class"}
    return _construct(_import_object(spec["class"]), kwargs, spec["class"])


def _callback_shape(spec: Any) -> None:
    """An import string, or a mapping whose ``class`` is one; nothing is imported."""
    if isinstance(spec, str):
        _import_string(spec)
        return
    if isinstance(spec, dict) and "class" in spec:
        _import_string(spec["class"])
        return
    raise _EntryError(
        "use an import string 'module:Name' or a mapping with a 'class' key and the "
        "constructor arguments"
    )


def _construct(cls: Any, kwargs: dict[str, Any], name: str) -> Any:
    """``cls(**kwargs)``, for a `TrainerCallback` subclass only: checked before the call
    (``name`` is the import string that named it)."""
    if not (isinstance(cls, type) and issubclass(cls, TrainerCallback)):
        kind = "a class" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise _EntryError(
            f"{name!r} is {kind}, not a TrainerCallback subclass, and only those are "
            "constructed from a config (nothing was called); name a TrainerCallback subclass, "
            "or, for a plain function callback, give its import string without 'class:'"
        )
    try:
        return cls(**kwargs)
    except Exception as e:  # the user's constructor raised
        name = getattr(cls, "__qualname__", repr(cls))
        raise _EntryError(f"{name}({', '.join(kwargs)}) raised {type(e).__name__}: {e}") from None
