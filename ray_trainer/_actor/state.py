"""In the callback actor: its callbacks' state, written beside each checkpoint, restored.

Runs in the callback actor process. The state goes into ``<checkpoint>/actor_state.pkl``
(``ACTOR_STATE_FILE``), written after every other actor callback handled that ``on_save``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import cloudpickle

from callbacks import CallbackManager, TrainingContext
from ray_trainer._checkpoint import CheckpointError, verify
from ray_trainer._contract import ACTOR_STATE_FILE, CHECKPOINT_PREFIX

logger = logging.getLogger("ray_trainer")


class ActorStateWriter:
    """The last `on_save` callback on the actor: writes the actor callbacks' state beside the
    checkpoint, and remembers the newest checkpoint announced."""

    runs_on = "actor"

    def __init__(self) -> None:
        self.manager: CallbackManager | None = None
        self.last_checkpoint: str | None = None

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        path = context.checkpoint_path
        if not path:
            return
        self.last_checkpoint = path
        if not os.path.isdir(path):
            return
        state = {
            "callbacks": self.manager.state_dict(),
            "user_state": dict(self.manager.user_state),
        }
        tmp = os.path.join(path, f".{ACTOR_STATE_FILE}.tmp")
        with open(tmp, "wb") as f:
            cloudpickle.dump(state, f)
        os.replace(tmp, os.path.join(path, ACTOR_STATE_FILE))


def restore(manager: CallbackManager, run_dir: str) -> str | None:
    """Load the actor callbacks' state from the newest complete checkpoint that has it; the
    checkpoint's path, or None."""
    if not os.path.isdir(run_dir):
        return None
    for name in sorted(os.listdir(run_dir), reverse=True):
        path = os.path.join(run_dir, name)
        state_file = os.path.join(path, ACTOR_STATE_FILE)
        if not name.startswith(CHECKPOINT_PREFIX) or not os.path.exists(state_file):
            continue
        try:
            verify(path)
            with open(state_file, "rb") as f:
                state = cloudpickle.load(f)
        except (CheckpointError, OSError, EOFError) as e:
            logger.warning("skipping actor state in %s: %s", path, e)
            continue
        manager.load_state_dict(state["callbacks"])
        manager.user_state.update(state["user_state"])
        return path
    return None
