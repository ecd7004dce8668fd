"""Every process: the description of SFT, the default objective (the next-token loss).

Trains on chat (``messages``, prompt/completion) and text records and on a user's own torch
``Dataset``; owns no field, needs no reference, logs no metric of its own. Its worker side:
``ray_trainer/_worker/objectives/sft.py``.
"""

from __future__ import annotations

from ray_trainer._objectives.base import Objective

SFT = Objective(
    name="sft",
    summary="supervised fine-tuning (the next-token loss)",
    worker="ray_trainer._worker.objectives.sft",
    data_formats=("messages", "conversational", "prompt_completion", "text"),
    data_noun="'messages', prompt/completion or text records",
    takes_datasets=True,
    names_cache=False,
)
