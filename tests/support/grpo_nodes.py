"""The multi-node GRPO fault run (issue 51, section 3) of the `lost_nodes` cluster: its fields,
its reward function and its callbacks, and its uninterrupted twin.

The run: two training workers on the head (a ``grpo`` resource only the head offers) and two
``hf`` rollout engines (``rollout_workers=(1, 2)``), one on each of two engine nodes (an
``engine`` resource, one per node), the LoRA adapter crossing to them through the object store
at every step; synchronous rollouts (``max_staleness=0``). Rank 0 holds at the end of step
`LOSE_AT` until the test has killed `ENGINE_B`'s raylet; `SHORT` steps go on with the engine
left; at the end of step `LOSE_AT + SHORT` rank 0 holds until the replacement (the lost slot's
generation 1), placeable again once the test has brought the node back, answers; it joins at
the next step point. The twin: the same run on two engines throughout, in the test session's
own Ray.

Runs in whichever process imports it: the test process (fields, the twin), the run's driver
(`grpo_node_driver.py`), the training workers (the callbacks) and the reward tasks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from callbacks import TrainerCallback

ENGINE_A, ENGINE_B = "127.0.0.7", "127.0.0.8"  # an engine each; B lost, then back
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
PROMPTS, PER_STEP, STEPS, SEED = 12, 4, 7, 3  # 2 workers x 2 prompts; 3 steps an epoch
LOSE_AT, SHORT = 2, 2  # B lost after step 2; steps 3 and 4 on one engine; the joiner at 5
RUN = "grpo-nodes"  # the run's name, which its engines' actor names start with


def write_data(root: Path) -> tuple[str, str]:
    """The tiny chat model and the prompts (each with its ``id``), written once for both runs."""
    from ray_trainer._demo.chat import make_tiny_chat_model

    model = str(make_tiny_chat_model(root / "model", style="chatml"))
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for i in range(PROMPTS):
            prompt = [{"role": "user", "content": f"Count to {i % 5}."}]
            f.write(json.dumps({"prompt": prompt, "id": i}) + "\n")
    return model, str(prompts)


def run_fields(model: str, data: str, storage: Path, name: str) -> dict[str, Any]:
    """The fields both runs share: what decides the samples, the rewards and the updates."""
    return {
        "objective": "grpo", "model": model, "data": data, "run_name": name, "seed": SEED,
        "lora": LORA, "max_staleness": 0, "rollout_backend": "hf",
        "grpo": {"num_generations": 2, "max_completion_length": 6, "log_completions": True},
        "max_length": 48, "num_workers": 2, "batch_size": 2, "max_steps": STEPS,
        "learning_rate": 1e-3, "log_every_steps": 1, "save_every_steps": 1000,
        "storage_path": str(storage), "dashboard": False,
    }  # fmt: skip


def cluster_fields(model: str, data: str, tmp: Path) -> dict[str, Any]:
    """The cluster's run: workers and reward tasks on the head, an engine on each engine node
    (a whole node each, so that nothing else of the run is lost with one), and the driver's
    test-only fields (``_records``, ``_hold``)."""
    return {
        **run_fields(model, data, tmp / "storage", RUN),
        "rollout_workers": [1, 2],
        "rollout_resources": {"CPU": 1, "engine": 1},
        "resources_per_worker": {"CPU": 1, "grpo": 1},
        # A reward task is not retried: one on a lost node would fail its step.
        "reward_resources": {"CPU": 0.25, "grpo": 0.25},
        "_records": str(tmp / "records"),
        "_hold": str(tmp / "hold"),
    }


def twin(tmp: Path, model: str, data: str) -> Any:
    """The uninterrupted twin, in this process's Ray session: two engines throughout, the same
    seed (neither the resources nor the placement changes a sample: each engine and worker
    computes on one thread, as on the cluster)."""
    from ray_trainer import run_training

    records = tmp / "twin-records"
    records.mkdir()
    return run_training(
        **run_fields(model, data, tmp / "twin-storage", "grpo-twin"),
        rollout_workers=2,
        rollout_resources={"CPU": 0.5},
        reward_resources={"CPU": 0.25},
        reward_fns=[scored_to(str(records))],
        callbacks=[StepLogs(str(records))],
    )


def scored_to(folder: str):
    """A reward function (a Ray task per step and worker) that records each prompt it scores,
    by step: its completions' token ids, and the node it ran on; 1 for a completion whose
    first token id is odd."""

    def scored(prompts, completions, completion_ids, trainer_state, id, **kwargs):
        import ray

        node = ray.util.get_node_ip_address()
        with open(os.path.join(folder, f"scored-{os.getpid()}.jsonl"), "a") as f:
            for i in sorted(set(id)):
                ids = sorted(list(c) for c, of in zip(completion_ids, id, strict=True) if of == i)
                record = {"step": trainer_state.global_step, "id": i, "node": node, "ids": ids}
                f.write(json.dumps(record) + "\n")
        return [float(c[0] % 2) if c else 0.0 for c in completion_ids]

    return scored


class StepLogs(TrainerCallback):
    """Rank 0, in the training process: every log's metrics, with the attempt."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_log(self, context: Any, **kwargs: Any) -> None:
        """Called at each log: one line with the step's metrics."""
        record = {"step": context.global_step, "attempt": context.attempt, "loss": context.loss}
        with open(os.path.join(self.folder, f"logs-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({**record, **(context.batch_metrics or {})}) + "\n")


def _alive_ips() -> set[str]:
    """The ips of the nodes the head holds alive."""
    import ray

    return {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}


def _engines() -> list[dict[str, Any]]:
    """The run's live rollout engines (Ray's state API): name, slot, generation, node's ip
    (another run's on the same cluster left out)."""
    import ray
    from ray.util.state import list_actors

    from ray_trainer._contract import actor_name

    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    found = list_actors(filters=[("class_name", "=", "RolloutActor"), ("state", "=", "ALIVE")])
    out = []
    for a in found:
        if not a.name.startswith(f"{actor_name(RUN)}:rollout:"):
            continue
        generation, slot = a.name.split(":")[-2:]
        out.append({"slot": int(slot), "generation": int(generation),
                    "node": ips.get(a.node_id, a.node_id)})  # fmt: skip
    return sorted(out, key=lambda e: (e["slot"], e["generation"]))


def _info(slot: int, generation: int) -> dict[str, Any] | None:
    """The engine's ``info`` (None: dead, or not started yet)."""
    import ray

    from ray_trainer._contract import actor_name

    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"] == f"{actor_name(RUN)}:rollout:0:{generation}:{slot}":
            try:
                handle = ray.get_actor(a["name"], namespace=a["namespace"])
                return ray.get(handle.info.remote(), timeout=30)
            except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                return None
    return None


class LoseEngineNode(TrainerCallback):
    """Every rank, in the training process, first attempt: rank 0 waits before step 1 until
    both engines answer (so that both serve from step 1), then records the engines' nodes and
    the slot of the one on `lost` (the node the test kills); each rank records its node at
    step 1 (``where``); then rank 0 holds at the fault's steps, each until a file or an engine
    says so (``wait_until``, bounded):

    * end of step `lose_at`: writes ``held`` into `folder` and waits for the test's
      ``release`` (written once `lost`'s raylet is killed), then until the head holds `lost`
      dead (so that the lost engine's replacement waits for a node, not dies with this one);
    * end of step `lose_at + short`: writes ``short`` and waits until the lost slot's
      replacement (generation 1) answers (it can start once the test has added the node
      back), so that it joins at the next step point;
    * end of that next step: the replacement's ``info`` (the version it holds, the version of
      its first request, the requests answered), the engine left's, and the engines' nodes
      (``joiner``).
    """

    runs_on = "all_ranks"

    def __init__(self, folder: str, records: str, lost: str = ENGINE_B, lose_at: int = LOSE_AT,
                 short: int = SHORT) -> None:  # fmt: skip
        self.folder, self.records, self.lost = folder, records, lost
        self.lose_at, self.short = lose_at, short
        self.slot = -1  # the slot of the engine on `lost` (rank 0)

    def _write(self, prefix: str, record: dict[str, Any]) -> None:
        with open(os.path.join(self.records, f"{prefix}-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_train_begin(self, context: Any, **kwargs: Any) -> None:
        """Called before the first step: rank 0 waits for both engines and finds the lost's."""
        from waiting import wait_until

        if context.rank != 0 or context.attempt:
            return
        for slot in (0, 1):
            wait_until(lambda s=slot: _info(s, 0), 600, f"rollout engine {slot} up", interval=0.5)
        engines = _engines()
        self.slot = next(e["slot"] for e in engines if e["node"] == self.lost)

    def on_step_end(self, context: Any, **kwargs: Any) -> None:
        """Called at the end of every step: records placement and holds at the fault's steps."""
        import ray
        from waiting import wait_until

        step = context.global_step
        if context.attempt:
            return
        if step == 1:
            import ray_trainer

            record = {"rank": context.rank, "node": ray.util.get_node_ip_address(),
                      "code": os.path.dirname(ray_trainer.__file__)}  # fmt: skip
            if context.rank == 0:
                record.update(engines=_engines(), lost_slot=self.slot)
            self._write("where", record)
        if context.rank != 0:
            return
        os.makedirs(self.folder, exist_ok=True)
        if step == self.lose_at:
            Path(self.folder, "held").write_text(str(step))
            release = os.path.join(self.folder, "release")
            wait_until(lambda: os.path.exists(release), 600, "the test to lose the engine node")
            # Until the head has seen the node die: a replacement started before then may be
            # placed on the dying node and die with it (seen here: `make test-faults` hung), and
            # its next generation is only started at rank 0's next step point, which the hold
            # below (waiting for generation 1) would never reach.
            wait_until(lambda: self.lost not in _alive_ips(), 120, "the head to see the node die",
                       interval=0.2)  # fmt: skip
        elif step == self.lose_at + self.short:
            Path(self.folder, "short").write_text(str(step))
            started = time.monotonic()
            wait_until(lambda: _info(self.slot, 1), 600, "the replacement up", interval=0.5)
            self._write("waited", {"step": step, "seconds": time.monotonic() - started})
        elif step == self.lose_at + self.short + 1:
            record = {"step": step, "slot": self.slot, "joiner": _info(self.slot, 1),
                      "left": _info(1 - self.slot, 0), "engines": _engines()}  # fmt: skip
            self._write("joiner", record)
