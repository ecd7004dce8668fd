"""The callbacks of the job that `tests/integration/test_multinode.py` submits, as a user's own
module: copied into the job's working dir (with `waiting.py`), named by the job's config, and
imported from there by the job's driver (on the head), the callback actor (on the head), the
training workers and the evaluation tasks (on the worker nodes).

Runs in whichever of those processes imports it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from callbacks import EvalOnSave, TrainerCallback

#: The score of each checkpoint: the best is a middle one, so keeping "the best and the newest"
#: must delete the one in between.
SCORES = {4: 0.9, 8: 0.2, 12: 0.5}


def score_checkpoint(checkpoint_path: str, step: int) -> dict[str, float]:
    """An evaluation task (on a worker node): the checkpoint's score by step, and what the task
    found in its local copy of the checkpoint (the LoRA adapter export)."""
    import ray

    adapter = os.path.join(checkpoint_path, "hf", "adapter_config.json")
    return {
        "score": SCORES[step],
        "has_adapter": float(os.path.isfile(adapter)),
        "on_head": float(ray.get_runtime_context().get_node_id() == _head_node_id()),
    }


def _head_node_id() -> str:
    import ray

    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node["Resources"]:
            return node["NodeID"]
    return ""


#: The job's `EvalOnSave` (a config names it: "multinode_job:EVALUATE"): on CPU.
EVALUATE = EvalOnSave(score_checkpoint, num_gpus=0, num_cpus=1, timeout_s=300)


class HoldAt(TrainerCallback):
    """Rank 0, in the training process: at the end of `step` it writes ``held`` into `folder`
    and waits (10 minutes at most) for the test to write ``release`` there, so that the run is
    live, past step 0, while the test asks for its status."""

    runs_on = "rank0"

    def __init__(self, folder: str, step: int) -> None:
        self.folder, self.step = folder, step

    def on_step_end(self, context: Any, **kwargs: Any) -> None:
        """Called at the end of every step: holds the one at `step`."""
        if context.global_step != self.step or context.attempt:
            return
        from waiting import wait_until

        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, "held"), "w") as f:
            f.write(str(context.global_step))
        release = os.path.join(self.folder, "release")
        wait_until(lambda: os.path.exists(release), 600, "the test to release the run")


class WhereAndWhat(TrainerCallback):
    """Every rank, in the training process: one line per micro-batch with the rank's node and
    whether the batch was packed (position ids, no attention mask), into `folder`."""

    runs_on = "all_ranks"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_before_forward(self, context: Any, batch: Any = None, **kwargs: Any) -> None:
        """Called before each micro-batch's forward pass."""
        import ray

        record = {
            "rank": context.rank,
            "step": context.global_step + 1,
            "node": ray.util.get_node_ip_address(),
            "packed": "position_ids" in batch and "attention_mask" not in batch,
        }
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, f"rank-{context.rank}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")


# ---- the GRPO job --------------------------------------------------------------------------


def odd_first_token(prompts, completions, completion_ids, **kwargs):
    """The GRPO job's reward function (a Ray task on a worker node, named in the config as
    "multinode_job:odd_first_token"): 1 for a completion whose first token id is odd."""
    return [float(ids[0] % 2) if ids else 0.0 for ids in completion_ids]


class EnginesWhere(TrainerCallback):
    """Rank 0, end of step 1: the node of this worker and of every live rollout engine actor
    (``RolloutActor``, from Ray's state API), into ``<folder>/engines.json``."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_step_end(self, context: Any, **kwargs: Any) -> None:
        """Called at the end of every step: records step 1's placement."""
        if context.global_step != 1 or context.attempt:
            return
        import ray
        from ray.util.state import list_actors

        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
        engines = list_actors(
            filters=[("class_name", "=", "RolloutActor"), ("state", "=", "ALIVE")]
        )
        record = {
            "worker": ray.util.get_node_ip_address(),
            "engines": sorted(ips.get(a.node_id, a.node_id) for a in engines),
        }
        os.makedirs(self.folder, exist_ok=True)
        with open(os.path.join(self.folder, "engines.json"), "w") as f:
            json.dump(record, f)
