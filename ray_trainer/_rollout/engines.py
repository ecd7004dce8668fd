"""In the rollout actor and the driver: the rollout engines' backends, registered in one place.

A backend is a `RolloutEngine` subclass under a name: ``"hf"`` (transformers' ``generate`` in the
engine's own process) and ``"vllm"`` (vLLM in the generation child, as ``GenerationEval`` runs
it, its weights through shared memory). ``"auto"`` is ``"vllm"`` where a vLLM environment is
configured (`EngineSpec.python`, ``RAY_TRAINER_VLLM_PYTHON``, or vLLM importable in this
process), as ``GenerationEval``'s ``"auto"`` picks it, else ``"hf"``.
"""

from __future__ import annotations

from typing import Any

from ray_trainer._rollout.engine import EngineSpec, RolloutEngine
from ray_trainer._rollout.engine_hf import HfEngine
from ray_trainer._rollout.engine_vllm import VllmEngine, vllm_python

#: The rollout backends by name.
BACKENDS: dict[str, type[RolloutEngine]] = {"hf": HfEngine, "vllm": VllmEngine}


def resolve_backend(name: str, spec: EngineSpec | None = None) -> str:
    """The backend `name` asks for: itself, or for ``"auto"`` the best one for `spec` here:
    ``"vllm"`` where a vLLM environment is configured, else ``"hf"``."""
    if name == "auto":
        return "vllm" if vllm_python(spec or EngineSpec()) is not None else "hf"
    if name not in BACKENDS:
        known = ", ".join(["auto", *BACKENDS])
        raise ValueError(f"unknown rollout backend {name!r}; the backends are {known}")
    return name


def build_engine(
    backend: str, spec: EngineSpec, state_dict: dict[str, Any] | None = None
) -> RolloutEngine:
    """The rollout engine of `backend` for `spec`, in this process."""
    return BACKENDS[resolve_backend(backend, spec)].build(spec, state_dict)
