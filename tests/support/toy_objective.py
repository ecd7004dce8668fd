"""A toy third objective for the tests: SFT with a label-smoothed loss, described for the registry.

What adding an objective takes, and nothing more: this description (one registry entry, made by
:func:`registered`) and its worker-side module, ``toy_objective_worker`` (named here by its
dotted name, imported by the workers through the registry). It owns ``label_smoothing``, which
DPO owns too (conservative DPO): refused under SFT, accepted under either of them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ray_trainer._objectives import Objective, register, unregister

SMOOTHED_SFT = Objective(
    name="smoothed_sft",
    summary="label-smoothed SFT (a test's toy objective)",
    worker="toy_objective_worker",
    data_formats=("messages", "conversational", "prompt_completion", "text"),
    data_noun="'messages', prompt/completion or text records",
    fields=("label_smoothing",),
)


@contextlib.contextmanager
def registered() -> Iterator[Objective]:
    """The toy objective in the registry for the block (this process only)."""
    register(SMOOTHED_SFT)
    try:
        yield SMOOTHED_SFT
    finally:
        unregister(SMOOTHED_SFT.name)
