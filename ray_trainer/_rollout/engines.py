"""In the rollout actor and the driver: the rollout engines' backends, registered in one place.

A backend is a `RolloutEngine` subclass under a name. ``"hf"`` (transformers' ``generate`` in the
engine's own process) is the one built; ``"vllm"`` (vLLM in the generation child, as
``GenerationEval`` runs it, its weights through shared memory) would be registered here beside
it, and ``"auto"`` would then pick it where vLLM is importable. Until then ``"auto"`` is ``"hf"``.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._rollout.engine import EngineSpec, RolloutEngine
from ray_trainer._rollout.engine_hf import HfEngine

#: The rollout backends by name.
BACKENDS: dict[str, type[RolloutEngine]] = {"hf": HfEngine}


def resolve_backend(name: str) -> str:
    """The backend `name` asks for: itself, or for ``"auto"`` the best one here (``"hf"``:
    no other is registered yet)."""
    if name == "auto":
        return "hf"
    if name not in BACKENDS:
        known = ", ".join(["auto", *BACKENDS])
        later = " (vLLM's rollout engine is not built yet)" if name == "vllm" else ""
        raise ValueError(f"unknown rollout backend {name!r}{later}; the backends are {known}")
    return name


def build_engine(
    backend: str, spec: EngineSpec, state_dict: dict[str, Any] | None = None
) -> RolloutEngine:
    """The rollout engine of `backend` for `spec`, in this process."""
    return BACKENDS[resolve_backend(backend)].build(spec, state_dict)
