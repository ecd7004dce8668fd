"""Training worker: a GRPO run's rollout engines as the ranks share them (create, sync, restart).

Runs in each training worker. Rank 0 creates ``rollout_workers`` engines, each a Ray actor
(``_rollout/actor.py``) named after the run, the worker-group start and a generation counter;
the other ranks find them by name. Rank ``r`` samples from engine ``r % rollout_workers``. The
actors are owned by rank 0's process, so they end with the worker group (a restart creates
new ones, which get the restored weights at their first sync).

Every function here is entered by every rank at the same point of the step: a weight sync
gathers each parameter under FSDP (a collective), and a barrier after it keeps any rank from
sampling before the engines hold the new weights.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ray_trainer._rollout.actor import RemoteEngine, RolloutEngineDied
from ray_trainer._rollout.engine import EngineSpec
from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
from ray_trainer._rollout.weights import full_tensors


def _barrier(world: int) -> None:
    if world > 1:  # all ranks must reach this collective
        dist.barrier()


def agree_any(flag: bool, world: int) -> bool:
    """Whether `flag` is set on any rank (a collective: every rank calls it)."""
    if world == 1:
        return flag
    value = torch.tensor([1.0 if flag else 0.0])
    if dist.get_backend() == "nccl":
        value = value.cuda()
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def engine_name(actor_name: str, attempt: int, generation: int, index: int) -> str:
    """The Ray actor name of engine `index` of a worker-group start (its `attempt`)."""
    return f"{actor_name}:rollout:{attempt}:{generation}:{index}"


def create_engines(
    args: Any,
    spec: EngineSpec,
    actor_name: str,
    attempt: int,
    namespace: str,
    generation: int = 0,
    only: Any = None,
) -> dict[int, RemoteEngine]:
    """Rank 0: the engines `only` (default: all ``rollout_workers``) of a worker-group start,
    created (Ray starts each actor and returns at once: its model loads in the background)."""
    engines = {}
    for i in range(args.rollout_workers) if only is None else only:
        name = engine_name(actor_name, attempt, generation, i)
        engines[i] = RemoteEngine(
            args.rollout_backend, spec, args.rollout_resources, name=name, namespace=namespace
        )
    return engines


def starts_early(resources: dict[str, float] | None) -> bool:
    """Whether an engine may start loading while the ranks load their model: not when it
    shares a GPU with them (a fraction of one): vLLM sizes its memory from what is free when
    it starts, which the ranks' load would change under it."""
    gpus = (resources or {}).get("GPU", 0)
    return not 0 < gpus < 1


class Engines:
    """The run's rollout engines, as one rank sees them.

    Args:
        state: the rank's ``WorkerState`` (its spec, args, rank, world and model).
        spec: how each engine builds its model (the run's model, its LoRA fields).
        probe: the fixed completion both sides score after each sync.
    """

    def __init__(self, state: Any, spec: EngineSpec, probe: Probe) -> None:
        self.s = state
        self.spec = spec
        self.probe = probe
        self.generation = 0
        self.restarts = 0  # engines created again after they died
        self.names: list[str] = []
        self.engines: list[RemoteEngine] = []
        self.version: int | None = None  # the policy version the engines hold (None: none)
        self.last_sync: dict[str, float] = {}

    # ---- creating --------------------------------------------------------------------------

    def start(
        self, only: list[int] | None = None, started: dict[int, RemoteEngine] | None = None
    ) -> None:
        """Rank 0 creates the engines (`only`: those indices again, under a new generation;
        `started`: those it created already, `create_engines` at the worker-group start);
        then every rank finds them by name (every rank computes the same names)."""
        import ray

        s, args = self.s, self.s.args
        count = args.rollout_workers
        if not self.names:
            self.names = [""] * count
        todo = range(count) if only is None else only
        for i in todo:
            self.names[i] = engine_name(s.spec.actor_name, s.ctx.attempt, self.generation, i)
        if s.rank == 0:
            engines = list(self.engines) or [None] * count
            made = started or create_engines(
                args, self.spec, s.spec.actor_name, s.ctx.attempt, s.spec.actor_namespace,
                self.generation, todo,
            )  # fmt: skip
            for i in todo:
                engines[i] = made[i]
            self.engines = engines
        _barrier(s.world_size)  # every engine's name is registered before the others look
        if s.rank != 0:
            self.engines = [
                RemoteEngine.attach(ray.get_actor(name, namespace=s.spec.actor_namespace))
                for name in self.names
            ]

    def of_rank(self) -> RemoteEngine:
        return self.engines[self.s.rank % len(self.engines)]

    # ---- weights ---------------------------------------------------------------------------

    def _named(self) -> Iterator[tuple[str, Any]]:
        module = self.s.parallel.module()
        lora = self.s.args.lora is not None
        for name, param in module.named_parameters():
            if not lora or ".lora_" in name:
                yield name, param

    def sync(self, again: bool = False) -> None:
        """Every engine takes the trainer's weights as policy version ``global_step`` (the
        adapter alone under LoRA), then the probe: ``rollout/logprob_diff``. Every rank. An
        engine found dead is restarted and the sync done again, once (`again`)."""
        s = self.s
        version = s.progress.global_step
        started = time.perf_counter()
        sent = 0.0
        dead = False
        sharded = s.args.strategy == "fsdp"
        for engine in self.engines:
            named = full_tensors(self._named())  # under FSDP a gather per parameter
            if s.rank == 0 and not dead:
                try:
                    sent += engine.sync(named, version).bytes
                except RolloutEngineDied:
                    dead = True
            if s.rank != 0 and not sharded:
                continue
            for _ in named:  # this rank's part of each gather (rank 0: what a death left)
                pass
        diff = None
        if sharded or s.rank == 0:  # the trainer's forward (a collective under FSDP)
            mine = trainer_logprobs(s.parallel.module(), self.probe)
            if s.rank == 0 and not dead:
                try:
                    diff = logprob_diff(self.engines[0].probe(self.probe), mine)
                except RolloutEngineDied:
                    dead = True
        if agree_any(dead, s.world_size):  # every rank: restart, then this sync again
            if again:
                raise RolloutEngineDied(
                    f"grpo: a rollout engine died during the weight sync of version {version}, "
                    "was restarted and died again; check rollout_resources and its log"
                )
            self.restart_dead(resync=False)
            self.sync(again=True)
            return
        _barrier(s.world_size)  # no rank samples before every engine holds `version`
        self.version = version
        self.last_sync = {"sync/seconds": time.perf_counter() - started, "sync/bytes": sent}
        if diff is not None:
            self.last_sync["rollout/logprob_diff"] = diff

    def due(self, every: int) -> bool:
        return self.version is None or self.s.progress.global_step - self.version >= every

    # ---- faults ----------------------------------------------------------------------------

    def restart_dead(self, resync: bool = True) -> None:
        """After a rollout found an engine dead (agreed by every rank): rank 0 creates the dead
        ones again, every rank finds them, and every engine is synced again."""
        s = self.s
        dead = [i for i, e in enumerate(self.engines) if not e.alive()] if s.rank == 0 else []
        if s.world_size > 1:  # every rank must name the same engines
            box = [dead]
            dist.broadcast_object_list(box, src=0)
            dead = box[0]
        self.generation += 1
        self.restarts += len(dead)
        self.start(only=dead)
        if resync:
            self.sync()


__all__ = [
    "Engines",
    "RolloutEngineDied",
    "agree_any",
    "create_engines",
    "engine_name",
    "starts_early",
]
