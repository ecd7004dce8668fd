"""Every process: a callable named by a ``"module:attribute"`` string (a YAML config's form).

Reward functions (``reward_fns``), tools (``tools``) and environment factories
(``environment_factory``) may each be given as the object itself or as its import path; this
module resolves the string once, with an error that names the field, the module and the fix.
"""

from __future__ import annotations

import importlib
from typing import Any

from ray_trainer._errors import TrainingArgsError


def import_named(spec: Any, where: str, example: str, expects: str, kind: str = "function") -> Any:
    """The callable `spec` names: `spec` itself when callable, else the attribute of a
    ``"module:attribute"`` string (dotted attributes allowed).

    Args:
        spec: a callable, or its ``"module:attribute"`` path.
        where: how errors name the field (``"reward_fns[0]"``).
        example: a path shown in the fix (``"my_rewards:exact_match"``).
        expects: what the object must be, for the error when it is not callable
            (``"a function that takes (prompts, completions, completion_ids, **kwargs)"``).
        kind: the kind of object, in the errors' ``'module:<kind>'`` (``"function"``,
            ``"Class"``).

    Raises:
        TrainingArgsError: not a callable nor a string, not of the form, the module does not
            import (or raises while importing), no such attribute, or not callable.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise TrainingArgsError(
            f"{where}: got a {type(spec).__name__}; give a {kind.lower()} or a "
            f"'module:{kind}' string (e.g. {example!r})"
        )
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise TrainingArgsError(
            f"{where}={spec!r} is not a 'module:{kind}' string; write the module's dotted "
            f"name, a colon, and the {kind.lower()}'s name (e.g. {example!r})"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise TrainingArgsError(
            f"{where}={spec!r}: module {module_name!r} does not import ({e}); put it on the "
            "Python path of the driver and of the Ray workers (e.g. in runtime_env's "
            "working_dir or py_modules)"
        ) from None
    except Exception as e:  # the user's module raised while being imported
        raise TrainingArgsError(
            f"{where}={spec!r}: importing module {module_name!r} raised "
            f"{type(e).__name__}: {e}; fix the module"
        ) from None
    found: Any = module
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise TrainingArgsError(
                f"{where}={spec!r}: module {module_name!r} has no {attr!r}; check the "
                f"{kind.lower()}'s name"
            )
    if not callable(found):
        raise TrainingArgsError(
            f"{where}={spec!r} names a {type(found).__name__}, not a {kind.lower()}; name {expects}"
        )
    return found
