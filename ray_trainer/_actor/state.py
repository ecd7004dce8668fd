"""In the callback actor: its callbacks' state, written beside each checkpoint, restored.

Runs in the callback actor process. The state goes into ``<checkpoint>/actor_state.pt``
(``ACTOR_STATE_FILE``) on the run's storage, written after every other actor callback handled
that ``on_save``; the actor finds the newest complete checkpoint holding one after a restart.
It is plain data (tensors, numbers, strings, lists, dicts), written with ``torch.save`` and read
weights-only (``_checkpoint/safe.py``): reading it runs no code. A callback state that is not
plain data is left out of it, recorded as that callback's error.

A checkpoint holds the file only where there is something to restore: a stateful actor
callback or a non-empty ``user_state``, or a state saved or restored earlier in the run (an
empty one then replaces it, so that a restart does not bring the older one back). A run
without either writes none, and its actor never imports torch: 1 CPU-second and about a second
at the end of a run on the 2-core test machine, when the last save is the actor's first.
"""

from __future__ import annotations

import logging
from typing import Any

from callbacks import CallbackManager, TrainingContext
from ray_trainer._checkpoint import CheckpointError, complete_checkpoints, safe
from ray_trainer._checkpoint.names import ACTOR_STATE_FILE
from ray_trainer._storage import Location

logger = logging.getLogger("ray_trainer")


class ActorStateWriter:
    """The last `on_save` callback on the actor: writes the actor callbacks' state beside the
    checkpoint, and remembers the newest checkpoint announced."""

    runs_on = "actor"

    def __init__(self, run: Location) -> None:
        self.manager: CallbackManager | None = None
        self.run = run
        self.last_checkpoint: str | None = None
        self.stored = False  # whether a state of this run is on its storage (saved or restored)

    def restore(self) -> str | None:
        """Load the newest saved state into the manager; its checkpoint's path, or None."""
        found = restore(self.manager, self.run)
        self.stored = found is not None
        return found

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        path = context.checkpoint_path
        if not path:
            return
        self.last_checkpoint = path
        checkpoint = self.run.child(path.rstrip("/").rsplit("/", 1)[-1])  # one of the run's
        if not checkpoint.is_dir():
            return
        callbacks = {}
        for key, value in self.manager.state_dict().items():
            value = safe.plain(value)
            try:
                safe.check_state(key, value)
            except safe.UnsafeStateError as e:  # the run goes on; this state is not kept
                logger.error("actor state not saved in %s: %s", checkpoint.name, e)
                continue
            callbacks[key] = value
        user_state = safe.plain(dict(self.manager.user_state))
        problem = safe.unsafe_path(user_state, "user_state")
        if problem is not None:
            logger.error("actor user_state not saved in %s: %s", checkpoint.name, problem)
            user_state = {}
        if not callbacks and not user_state and not self.stored:
            return  # nothing to restore, and nothing older that a restart would bring back
        state = {"callbacks": callbacks, "user_state": user_state}
        checkpoint.child(ACTOR_STATE_FILE).write_bytes(safe.dumps(state))
        self.stored = True


def restore(manager: CallbackManager, run: Location) -> str | None:
    """Load the actor callbacks' state from the newest complete checkpoint that has it; the
    checkpoint's path, or None."""
    for checkpoint in complete_checkpoints(run, holding=ACTOR_STATE_FILE):
        try:
            file = checkpoint.child(ACTOR_STATE_FILE)
            state = safe.loads(file.read_bytes(), file.name)  # weights-only: runs nothing
            if not isinstance(state, dict) or not {"callbacks", "user_state"} <= set(state):
                raise CheckpointError(f"{file.name}: not the actor's state")
        except (OSError, CheckpointError) as e:
            logger.warning("skipping actor state in %s: %s", checkpoint.name, e)
            continue
        manager.load_state_dict(state["callbacks"])
        manager.user_state.update(state["user_state"])
        return checkpoint.name
    return None
