"""Every process (driver, workers, callback actor): the objectives a run can train with, registered once.

The registry maps ``TrainingArgs.objective`` to its :class:`Objective` (``base.py``): SFT
(``sft.py``), DPO (``dpo.py``) and GRPO (``grpo.py``) register here; another objective adds a module beside them,
one worker-side module in ``ray_trainer/_worker/objectives/`` and one :func:`register` call. The
rest of the code asks the objective (``objective_of(args.objective)``), never its name.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._objectives.base import Beside, Objective
from ray_trainer._objectives.dpo import DPO
from ray_trainer._objectives.grpo import GRPO
from ray_trainer._objectives.sft import SFT

__all__ = [
    "Beside",
    "Objective",
    "check_fields",
    "names",
    "objective_of",
    "register",
    "resume_error",
    "unregister",
]

#: The registered objectives, by name, in registration order (SFT first: the default).
_REGISTRY: dict[str, Objective] = {}


def register(objective: Objective) -> Objective:
    """Add `objective` to the registry (in the process that calls it: a test, or a module
    imported by every process that runs the objective); refuses a name already taken."""
    taken = _REGISTRY.get(objective.name)
    if taken is not None and taken is not objective:
        raise ValueError(f"an objective named {objective.name!r} is already registered")
    _REGISTRY[objective.name] = objective
    return objective


def unregister(name: str) -> None:
    """Remove the objective `name` (a test's toy objective); the built-in ones stay."""
    if _REGISTRY.get(name) in (SFT, DPO, GRPO):
        raise ValueError(f"objective {name!r} is built in and stays registered")
    _REGISTRY.pop(name, None)


def names() -> tuple[str, ...]:
    """The registered objectives' names."""
    return tuple(_REGISTRY)


def objective_of(name: str) -> Objective:
    """The registered objective `name`; the error lists the registered ones."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        known = ", ".join(repr(n) for n in _REGISTRY)
        raise ValueError(f"objective={name!r} is not an objective; one of {known}") from None


def check_fields(args: Any) -> None:
    """The fields other objectives own are left at their defaults, then the objective's own
    checks. `args` is a ``TrainingArgs`` (told by value, not by ``model_fields_set``: a
    TrainingArgs passed whole has every field set)."""
    objective = objective_of(args.objective)
    defaults = type(args).model_fields
    stray = [
        f
        for f in dict.fromkeys(f for o in _REGISTRY.values() for f in o.fields)
        if f not in objective.fields and getattr(args, f) != defaults[f].default
    ]
    if stray:
        owners = [o for o in _REGISTRY.values() if set(o.fields) & set(stray)]
        raise ValueError(
            f"{', '.join(stray)} set with objective={objective.name!r}: they configure "
            f"{' or '.join(o.summary for o in owners)}; set "
            f"{' or '.join(f'objective={o.name!r}' for o in owners)} too, or drop them"
        )
    objective.check(args)


def resume_error(trained: str | None, current: str, checkpoint: str) -> str | None:
    """Why a run of objective `current` cannot continue `checkpoint`, trained with `trained`
    (None: written before objectives were recorded, an SFT one), or None when it can: it would
    take the other run's optimizer and schedule, and its adapters' base would not be what the
    new objective starts from. It starts from the checkpoint's export instead."""
    trained = trained or SFT.name
    if trained == current:
        return None
    return (
        f"objective: {checkpoint} was trained with objective={trained!r}, this run has "
        f"objective={current!r}; continue it with objective={trained!r}, or start "
        f"{current} from it as model={checkpoint + '/hf'!r} (its Hugging Face export; a LoRA "
        "run's with lora_export='merged' or 'both') in a new run_name"
    )


register(SFT)
register(DPO)
register(GRPO)
