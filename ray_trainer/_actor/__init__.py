"""The callback actor: runs in its own Ray actor process on the head node, one per run.

``actor.CallbackActor`` receives rank 0's event batches and runs the actor-side callbacks in
order; ``evaluation.EvalTracker`` launches and watches ``EvalOnSave``'s Ray tasks from it;
``state`` writes its callbacks' state beside each checkpoint and restores it after a restart.
The driver starts it (``start_actor``); nothing here imports ``ray_trainer._worker``.
"""
