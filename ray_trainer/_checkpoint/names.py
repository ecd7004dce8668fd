"""Every process: the names of a run's checkpoint folders and of the run files beside them.

The workers name each checkpoint folder, the callback actor writes its state into it and its
ranking beside it, and the driver lists them to resume: one place says what they are called.
"""

from __future__ import annotations

import re

CHECKPOINT_PREFIX = "checkpoint_"
#: The actor-side callbacks' state, written by the actor into each checkpoint folder (plain
#: data, read weights-only; the older ``actor_state.pkl``, a pickle, is never read).
ACTOR_STATE_FILE = "actor_state.pt"
#: The checkpoint ranking (scores, evaluations per checkpoint), in the run folder.
RANKING_FILE = "ranking.json"
#: Ray Train's own list of the checkpoints it was given, in the run folder: not used to resume.
RAY_CHECKPOINT_LIST = "checkpoint_manager_snapshot.json"

_CHECKPOINT_NAME = re.compile(re.escape(CHECKPOINT_PREFIX) + r"\d+")


def checkpoint_dir_name(step: int) -> str:
    """The folder name of the checkpoint taken after ``step`` optimizer steps."""
    return f"{CHECKPOINT_PREFIX}{step:08d}"


def checkpoint_names(names: list[str]) -> list[str]:
    """The checkpoint folders among a run folder's ``names``, oldest first (Ray Train keeps files
    of its own there, such as ``checkpoint_manager_snapshot.json``)."""
    return sorted(n for n in names if _CHECKPOINT_NAME.fullmatch(n))
