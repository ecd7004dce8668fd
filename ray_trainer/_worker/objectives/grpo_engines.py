"""Training worker: a GRPO run's rollout engines as the ranks share them (create, sync, replace).

Runs in each training worker. Rank 0 creates ``max`` of ``rollout_workers=(min, max)`` engines,
each a Ray actor (``_rollout/actor.py``) placed by Ray wherever ``rollout_resources`` fit and
named after the run, the worker-group start, its slot's generation and the slot; the other
ranks find them by name. Which engines serve is the pool's (``grpo_pool.py``): the ranks agree
on it at each step point (:meth:`Engines.boundary`) and when a rollout found its engine dead
(:meth:`Engines.lost`); a lost engine's rank samples from another, a replacement starts in the
background and takes the latest weights before its first request. The actors are owned by
rank 0's process, so they end with the worker group (a restart creates new ones, which get the
restored weights at their first sync). So is the rollout queue's actor of an asynchronous run
(``_rollout/buffer.py``, :meth:`Engines.queue`).

Every method here is entered by every rank at the same point of the step: a weight sync
gathers each parameter under FSDP (a collective), and a barrier after it keeps any rank from
sampling before the engines hold the new weights. In an asynchronous run (``posted``) the sync
does not wait for the requests the engines are answering: the weights are put in the object
store once and posted to every engine, which takes them at its next request boundary (an idle
one at once); a request sent after the barrier samples on them (or on a newer version).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ray_trainer._rollout.actor import RemoteEngine, RolloutEngineDied
from ray_trainer._rollout.buffer import RemoteQueue, buffer_name
from ray_trainer._rollout.engine import EngineSpec
from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
from ray_trainer._rollout.transport import PostedWeights, post_weights
from ray_trainer._rollout.weights import full_tensors
from ray_trainer._worker.objectives.grpo_pool import EnginePool


def _barrier(world: int) -> None:
    if world > 1:  # all ranks must reach this collective
        dist.barrier()


def agree_max(values: list[float], world: int) -> list[float]:
    """Each of `values`' largest over the ranks (a collective: every rank calls it)."""
    if world == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def agree_any(flag: bool, world: int) -> bool:
    """Whether `flag` is set on any rank (a collective: every rank calls it)."""
    return agree_max([1.0 if flag else 0.0], world)[0] > 0


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
    """Rank 0: the engines `only` (default: ``max`` of ``rollout_workers``) of a worker-group
    start, created (Ray starts each actor and returns at once: its model loads in the
    background, and one that cannot be placed yet waits for a node)."""
    engines = {}
    for i in range(args.rollout_range[1]) if only is None else only:
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
        posted: sync without waiting for the engines' requests (an asynchronous run): the
            weights are posted, and taken at each engine's next request boundary (an idle
            engine takes them at once).
        wait_s: how long rank 0 waits for engines to come up (``grpo_pool.ENGINE_WAIT_S``).
    """

    def __init__(
        self, state: Any, spec: EngineSpec, probe: Probe, *, posted: bool = False, **pool: Any
    ) -> None:
        self.s = state
        self.spec = spec
        self.probe = probe
        self.posted = posted
        self._held: PostedWeights | None = None  # rank 0: the last version posted, kept alive
        #: rank 0, posted syncs: (version, the trainer's probe log-probs) of the last version
        #: posted, whose engine-side probe is read once an engine has loaded it.
        self._probing: tuple[int, list[float]] | None = None
        self.version: int | None = None  # the policy version the serving engines hold
        self.last_sync: dict[str, float] = {}
        low, high = state.args.rollout_range
        self.pool = EnginePool(
            low, high, state.rank, start=self._create, attach=self._attach,
            wait=RemoteEngine.wait_any, **pool,
        )  # fmt: skip

    @property
    def restarts(self) -> int:
        """Engines started again after one was lost (counted on rank 0, 0 elsewhere)."""
        return self.pool.replaced

    @property
    def engines(self) -> list[RemoteEngine]:
        """The serving engines, in slot order (the same on every rank)."""
        return [self.pool.engine(i) for i in self.pool.serving]

    def __len__(self) -> int:
        return len(self.pool)

    @property
    def max_tries(self) -> int:
        """How many times a step's rollout is tried before it fails: each failure takes an
        engine out, and each slot's engine may be replaced once more than it failed."""
        return 2 * self.pool.high + 1

    # ---- creating and agreeing ---------------------------------------------------------------

    def _create(self, index: int, generation: int) -> RemoteEngine:
        s = self.s
        made = create_engines(
            s.args, self.spec, s.spec.actor_name, s.ctx.attempt, s.spec.actor_namespace,
            generation, [index],
        )  # fmt: skip
        return made[index]

    def _attach(self, index: int, generation: int) -> RemoteEngine:
        import ray

        s = self.s
        name = engine_name(s.spec.actor_name, s.ctx.attempt, generation, index)
        return RemoteEngine.attach(ray.get_actor(name, namespace=s.spec.actor_namespace))

    def start(self, started: dict[int, RemoteEngine] | None = None) -> None:
        """Rank 0 creates the engines (`started`: those it created already, `create_engines`
        at the worker-group start); every rank waits until ``min`` of them are up."""
        if self.s.rank == 0:
            self.pool.fill(started)
        self._settle(need=self.pool.low)

    def _round(self, lost: list[int] = (), need: int = 0) -> list[int]:
        """One agreement on the serving set (a collective): the slots that joined."""
        agreed = agree_max(self.pool.vote(lost, need), self.s.world_size)
        return self.pool.apply(agreed, need).joined

    def _settle(self, lost: list[int] = (), need: int = 0) -> list[int]:
        """Agree on the serving set; with none serving, wait (bounded) for one: the slots that
        joined, to sync before their first request."""
        joined = self._round(lost, need)
        while not len(self.pool):
            joined += self._round(need=1)
        return [i for i in dict.fromkeys(joined) if i in self.pool.serving]

    def serving_engines(self) -> dict[int, RemoteEngine]:
        """The serving engines by slot (rank 0: where the rollout queue sends lost requests)."""
        return {i: self.pool.engine(i) for i in self.pool.serving}

    def queue(self, max_staleness: int, score: Callable[[int, list[Any]], Any]) -> RemoteQueue:
        """The run's rollout queue (every rank, after `start`): rank 0 creates its actor, on
        its node, with the run's scoring; the others attach once it exists."""
        s = self.s
        name = buffer_name(s.spec.actor_name, s.ctx.attempt)
        namespace = s.spec.actor_namespace
        if s.rank == 0:
            queue = RemoteQueue.create(name, namespace, max_staleness, s.world_size, score)
        _barrier(s.world_size)
        if s.rank != 0:
            queue = RemoteQueue.attach(name, namespace, s.rank, max_staleness)
        return queue

    def slot(self) -> int:
        """The slot this rank samples from."""
        return self.pool.slot_of(self.s.rank)

    def of_rank(self) -> RemoteEngine:
        return self.pool.assign(self.s.rank)

    def boundary(self, every: int) -> dict[str, float]:
        """The step point (every rank): agree on the serving engines (the lost leave, the up
        join), then the weights: every engine when due (every `every` steps, and before a
        start's first rollout), else the joiners alone. The sync's metrics, or none."""
        joined = self._settle()
        if self.due(every):
            self.sync()
            return self.last_sync
        if joined:
            self._sync_joiners(joined)
        return {}

    def lost(self, failed: bool) -> None:
        """After a rollout failed on some rank (agreed by every rank): the engine this rank
        saw die (`failed`) leaves, the ranks agree on the engines left, and any joiner takes
        the latest weights; then the rollout is tried again on the new assignment."""
        joined = self._settle(lost=[self.slot()] if failed else [])
        if joined:
            self._sync_joiners(joined)

    # ---- weights ---------------------------------------------------------------------------

    def _named(self) -> Iterator[tuple[str, Any]]:
        module = self.s.parallel.module()
        lora = self.s.args.lora is not None
        for name, param in module.named_parameters():
            if not lora or ".lora_" in name:
                yield name, param

    def _send(self, slots: list[int], version: int) -> tuple[float, list[int]]:
        """The weights into the engines of `slots` as `version` (rank 0 sends; under FSDP
        every rank gathers, once per engine): the bytes sent and the slots found dead. An
        engine found dead does not stop the others' sync: the engines left sample next."""
        s = self.s
        sent, dead = 0.0, []
        sharded = s.args.strategy == "fsdp"
        for i in slots:
            named = full_tensors(self._named())  # under FSDP a gather per parameter
            if s.rank == 0:
                try:
                    sent += self.pool.engine(i).sync(named, version).bytes
                except RolloutEngineDied:
                    dead.append(i)
            if s.rank != 0 and not sharded:
                continue
            for _ in named:  # this rank's part of each gather (rank 0: what a death left)
                pass
        return sent, dead

    def _post(self, slots: list[int], version: int) -> tuple[float, list[int]]:
        """The weights posted to the engines of `slots` as `version`, without waiting for
        their requests: put in the object store once (under FSDP every rank gathers each
        parameter once), then handed to each engine. The bytes put, and the slots found dead."""
        s = self.s
        named = full_tensors(self._named())
        if s.rank != 0:
            if s.args.strategy == "fsdp":
                for _ in named:  # this rank's part of each gather
                    pass
            return 0.0, []
        self._held = post_weights(named, version)  # the last version's, dropped by now
        dead = []
        for i in slots:
            try:
                self.pool.engine(i).post(self._held, self.probe)
            except RolloutEngineDied:
                dead.append(i)
        return float(self._held.bytes), dead

    def posted_diff(self) -> float | None:
        """Rank 0, posted syncs: ``rollout/logprob_diff`` of the version posted last, from the
        probe of the first serving engine that has loaded it (its next request loads it: by
        the end of the step that synced it, as a rule); None while none has, and then asked
        again later. Read once."""
        if self._probing is None:
            return None
        version, mine = self._probing
        for slot in self.pool.serving:
            try:
                theirs = self.pool.engine(slot).probed(version)
            except RolloutEngineDied:
                continue  # seen dead at the next agreement
            if theirs is not None:
                self._probing = None
                return logprob_diff(theirs, mine)
        return None

    def _sync_joiners(self, joined: list[int], rounds: int = 0) -> None:
        """The joiners take the trainer's weights (the latest: version ``global_step``) before
        their first request; one that dies meanwhile leaves, and who joins instead syncs."""
        _, dead = self._send(joined, self.s.progress.global_step)
        again = self._settle(lost=dead) if agree_any(bool(dead), self.s.world_size) else []
        if again:
            if rounds >= 2 * self.pool.high:
                raise RolloutEngineDied(
                    "grpo: rollout engines keep dying as they join; check rollout_resources "
                    "and the engines' log"
                )
            self._sync_joiners(again, rounds + 1)
        _barrier(self.s.world_size)  # no rank samples before its engine holds the weights

    def sync(self) -> None:
        """Every serving engine takes the trainer's weights as policy version ``global_step``
        (the adapter alone under LoRA), then the probe: ``rollout/logprob_diff``. Every rank.
        An engine found dead leaves (its replacement syncs when it joins). Posted (an
        asynchronous run): the engines take the weights at their next request boundary (an
        idle one at once) and score the probe then; its difference is read at the step's end (`posted_diff`)."""
        s = self.s
        version = s.progress.global_step
        started = time.perf_counter()
        serving = self.pool.serving
        # Posted: the version posted last time, if its probe was not read by its step's end.
        diff = self.posted_diff() if s.rank == 0 else None
        self._probing = None
        sent, dead = (self._post if self.posted else self._send)(serving, version)
        sharded = s.args.strategy == "fsdp"
        if sharded or s.rank == 0:  # the trainer's forward (a collective under FSDP)
            mine = trainer_logprobs(s.parallel.module(), self.probe)
            first = next((i for i in serving if i not in dead), None)
            if s.rank == 0 and self.posted:  # the engines' probe comes after they load them
                self._probing = (version, mine)
            elif s.rank == 0 and first is not None:
                try:
                    diff = logprob_diff(self.pool.engine(first).probe(self.probe), mine)
                except RolloutEngineDied:
                    dead.append(first)
        if agree_any(bool(dead), s.world_size):  # every rank: the dead leave
            joined = self._settle(lost=dead)
            if joined:  # none left but joiners, or joiners meanwhile: they sync now
                self._sync_joiners(joined)
        _barrier(s.world_size)  # no rank samples before every engine holds `version`
        self.version = version
        self.last_sync = {"sync/seconds": time.perf_counter() - started, "sync/bytes": sent}
        if diff is not None:
            self.last_sync["rollout/logprob_diff"] = diff

    def due(self, every: int) -> bool:
        return self.version is None or self.s.progress.global_step - self.version >= every


__all__ = [
    "Engines",
    "RolloutEngineDied",
    "agree_any",
    "agree_max",
    "create_engines",
    "engine_name",
    "starts_early",
]
