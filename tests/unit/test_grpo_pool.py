"""Elastic rollout engines (issue 51, section 2), their membership logic: no Ray.

The pool of ``rollout_workers=(min, max)`` slots (``grpo_pool.EnginePool``) driven for several
ranks at once, the round's MAX all-reduce done here over their votes: a lost engine leaves on
every rank at the same round and its rank samples from an engine left, while rank 0 starts a
replacement that joins once up; the first step waits for ``min`` engines, bounded, and past
the wait every rank raises an error naming the fields; an engine that never starts is not
started forever. Then the ranks' side (``grpo_engines.Engines``, one rank, fake engines): a
joiner takes the trainer's latest weights before its first request, a rollout whose engine
died is sampled again on an engine left, and with none left the step waits for a replacement.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ray_trainer._worker.objectives.grpo_engines as grpo_engines
from ray_trainer._rollout.actor import RolloutEngineDied
from ray_trainer._worker.objectives.grpo_pool import (
    DEAD,
    MAX_FAILED_STARTS,
    STARTING,
    UP,
    EnginePool,
    EnginesUnavailable,
)


class _Engine:
    """A rollout engine as the pool and the ranks see it: a state, weights of a version."""

    def __init__(self, index: int, generation: int, log: list, status: str = STARTING) -> None:
        self.key, self.log, self.status, self.version = (index, generation), log, status, None

    def state(self) -> str:
        return self.status

    def kill(self) -> None:
        self.status = DEAD
        self.log.append(("kill", self.key))

    def sync(self, named, version):
        list(named)
        if self.status == DEAD:
            raise RolloutEngineDied("dead")
        self.version = version
        self.log.append(("sync", self.key, version))
        return SimpleNamespace(bytes=1.0)

    def probe(self, probe):
        return [0.0]

    def post(self, posted, probe):  # taken at its next request boundary: here at once
        if self.status == DEAD:
            raise RolloutEngineDied("dead")
        self.version = posted.version
        self.log.append(("post", self.key, posted.version))
        return 0

    def probed(self, version):
        return [0.25 + version] if version == self.version else None

    def generate(self, prompt_ids, params, rows):
        if self.status == DEAD:
            raise RolloutEngineDied("dead")
        self.log.append(("generate", self.key, self.version))
        return [self.version] * len(rows)


class _Clock:
    """The waits' clock: a wait moves it on, and may bring engines up (`then`)."""

    def __init__(self) -> None:
        self.now, self.waits, self.then = 0.0, [], None

    def __call__(self) -> float:
        return self.now

    def wait(self, engines, seconds):
        self.waits.append((len(engines), seconds))
        self.now += seconds
        if self.then is not None:
            self.then()


def _pools(low, high, ranks=2, wait_s=60.0):
    log, made, clock = [], {}, _Clock()

    def start(index, generation):
        made[(index, generation)] = _Engine(index, generation, log)
        return made[(index, generation)]

    pools = [EnginePool(low, high, 0, start=start, wait=clock.wait, clock=clock, wait_s=wait_s)]
    pools += [EnginePool(low, high, r, attach=lambda i, g: ("handle", i, g)) for r in
              range(1, ranks)]  # fmt: skip
    pools[0].fill()
    return pools, made, clock, log


def _round(pools, lost=None, need=0):
    """One agreement: each rank's vote, their MAX (the all-reduce), each rank's change."""
    votes = [p.vote((lost or {}).get(p.rank, ()), need) for p in pools]
    agreed = [max(column) for column in zip(*votes, strict=True)]
    return [p.apply(agreed, need) for p in pools]


def test_a_lost_engine_leaves_on_every_rank_its_rank_moves_and_a_replacement_joins():
    pools, made, _, log = _pools(1, 2)
    for engine in made.values():
        engine.status = UP
    changes = _round(pools, need=1)
    assert [c.joined for c in changes] == [[0, 1], [0, 1]]
    assert [p.slot_of(1) for p in pools] == [1, 1]  # rank 1 samples from engine 1
    assert pools[1].engine(1) == ("handle", 1, 0)  # found by its name (slot 1, generation 0)
    # Rank 1's rollout found engine 1 dead: every rank drops it at the same round.
    made[(1, 0)].status = DEAD
    changes = _round(pools, lost={1: [1]})
    assert [c.lost for c in changes] == [[1], [1]] and [c.joined for c in changes] == [[], []]
    assert [p.serving for p in pools] == [[0], [0]]
    assert [p.slot_of(1) for p in pools] == [0, 0]  # rank 1 moved to the engine left
    # Rank 0 ended it and started its replacement, generation 1, pending: no one waits for it.
    assert ("kill", (1, 0)) in log and made[(1, 1)].status == STARTING
    assert pools[0].replaced == 1
    assert [c.joined for c in _round(pools)] == [[], []]  # still loading: not serving yet
    made[(1, 1)].status = UP
    changes = _round(pools)
    assert [c.joined for c in changes] == [[1], [1]]
    assert pools[1].engine(1) == ("handle", 1, 1)  # the next generation's name
    assert [p.slot_of(1) for p in pools] == [1, 1]


def test_rank_zeros_view_alone_takes_out_an_engine_that_died_between_requests():
    pools, made, _, _ = _pools(2, 2)
    for engine in made.values():
        engine.status = UP
    _round(pools, need=2)
    made[(0, 0)].status = DEAD  # no rank's rollout saw it: rank 0's poll does
    changes = _round(pools)
    assert [c.lost for c in changes] == [[0], [0]] and [p.serving for p in pools] == [[1], [1]]
    assert [p.slot_of(0) for p in pools] == [1, 1]


def test_the_first_step_waits_for_min_engines_and_fails_on_every_rank_past_the_wait():
    pools, made, clock, _ = _pools(2, 3)
    made[(0, 0)].status = UP

    def second_comes_up():
        if clock.now >= 10:
            made[(2, 0)].status = UP

    clock.then = second_comes_up
    changes = _round(pools, need=2)
    assert [c.joined for c in changes] == [[0, 2], [0, 2]]  # engine 1 stays pending
    assert clock.waits and all(n == 2 for n, _ in clock.waits)  # waited on the two starting
    assert clock.now == pytest.approx(10.0)
    # Too few ever come: past the wait, every rank raises the same error naming the fields.
    pools, made, clock, _ = _pools(2, 2, wait_s=30.0)
    made[(0, 0)].status = UP
    votes = [p.vote((), need=2) for p in pools]
    agreed = [max(column) for column in zip(*votes, strict=True)]
    for p in pools:
        with pytest.raises(EnginesUnavailable) as info:
            p.apply(agreed, need=2)
        text = str(info.value)
        assert "fewer than 2 rollout engine(s) came up in 30s" in text
        assert "rollout_workers" in text and "rollout_resources" in text
    assert clock.now >= 30.0


def test_an_engine_that_dies_before_it_ever_serves_is_not_started_forever():
    pools, made, _, _ = _pools(1, 2, ranks=1)
    made[(0, 0)].status = UP
    for generation in range(MAX_FAILED_STARTS + 2):
        engine = made.get((1, generation))
        if engine is not None:
            engine.status = DEAD  # its model does not load, say
        _round(pools, need=1)
    assert sorted(g for i, g in made if i == 1) == list(range(MAX_FAILED_STARTS))
    assert pools[0].engine(1) is None and pools[0].serving == [0]  # left empty, training on


# ---- the ranks' side: Engines, one rank ------------------------------------------------------


def _engines(monkeypatch, low, high, up=(), posted=False):
    """`Engines` of a one-rank run over fake engines (slots `up` up at the start)."""
    log, made, clock = [], {}, _Clock()

    def create(args, spec, actor_name, attempt, namespace, generation, only):
        (i,) = only
        made[(i, generation)] = _Engine(
            i, generation, log, UP if (i in up and not generation) else STARTING
        )
        return {i: made[(i, generation)]}

    monkeypatch.setattr(grpo_engines, "create_engines", create)
    monkeypatch.setattr(grpo_engines, "trainer_logprobs", lambda module, probe: [0.0])
    monkeypatch.setattr(grpo_engines, "logprob_diff", lambda theirs, mine: 0.0)
    model = nn.Linear(2, 2)
    state = SimpleNamespace(
        rank=0, world_size=1, progress=SimpleNamespace(global_step=0, epoch=0),
        args=SimpleNamespace(rollout_range=(low, high), lora=None, strategy="ddp"),
        parallel=SimpleNamespace(module=lambda: model),
        spec=SimpleNamespace(actor_name="run", actor_namespace="ns"), ctx=SimpleNamespace(attempt=0),
    )  # fmt: skip
    engines = grpo_engines.Engines(state, None, None, posted=posted, wait_s=60.0, clock=clock)
    engines.pool._wait = clock.wait
    return engines, made, clock, log, state


def test_a_joiner_takes_the_latest_weights_before_its_first_request(monkeypatch):
    engines, made, _, log, state = _engines(monkeypatch, 1, 2, up={0})
    engines.start()
    assert len(engines) == 1  # min 1 up: training starts, engine 1 still loading
    assert engines.boundary(every=2)["sync/bytes"] == 1.0  # step 0: the first sync
    assert made[(0, 0)].version == 0
    with torch.no_grad():
        state.parallel.module().weight += 1.0
    state.progress.global_step = 1
    made[(1, 0)].status = UP
    assert engines.boundary(every=2) == {}  # not due: the joiner alone syncs
    assert len(engines) == 2 and made[(1, 0)].version == 1  # the trainer's latest, not the pool's 0
    assert made[(0, 0)].version == 0
    engine = engines.pool.engine(1)
    engine.generate([[1]], None, [0])
    assert log.index(("sync", (1, 0), 1)) < log.index(("generate", (1, 0), 1))


def test_a_rollout_whose_engine_died_is_sampled_on_another_and_none_left_waits(monkeypatch):
    engines, made, clock, _, state = _engines(monkeypatch, 1, 2, up={0, 1})
    engines.start()
    engines.boundary(every=1)
    assert engines.engines == [made[(0, 0)], made[(1, 0)]]
    # The engine of rank 0 (slot 0) dies mid-request: the rank reports it, it leaves.
    made[(0, 0)].status = DEAD
    with pytest.raises(RolloutEngineDied):
        engines.of_rank().generate([[1]], None, [0])
    engines.lost(failed=True)
    assert engines.pool.serving == [1] and engines.of_rank() is made[(1, 0)]
    assert engines.of_rank().generate([[1]], None, [0]) == [0]  # sampled on the engine left
    assert made[(0, 1)].status == STARTING and engines.restarts == 1  # no one waited for it
    assert clock.waits == []
    # Now the last one dies with its replacement still loading: the step waits for it, and
    # it takes the trainer's weights before it serves.
    state.progress.global_step = 3

    def replacement_loads():
        made[(0, 1)].status = UP

    clock.then = replacement_loads
    made[(1, 0)].status = DEAD
    engines.lost(failed=True)
    assert engines.pool.serving == [0] and engines.of_rank() is made[(0, 1)]
    assert len(clock.waits) == 1 and made[(0, 1)].version == 3


def test_an_engine_found_dead_in_the_sync_leaves_and_the_engines_after_it_take_the_weights(
    monkeypatch,
):
    """Slot 0's engine serves at the step point (its node is lost just after) and is found
    dead by the weight sync: it leaves, and the engine after it in slot order still takes the
    step's weights before it samples (seen on the multi-node fault run, test_grpo_nodes.py:
    without this the engine left sampled with the weights of the step before)."""
    engines, made, _, _, state = _engines(monkeypatch, 1, 2, up={0, 1})
    engines.start()
    engines.boundary(every=1)  # both hold version 0
    state.progress.global_step = 1

    def dies(named, version):
        made[(0, 0)].status = DEAD
        raise RolloutEngineDied("its node is gone")

    made[(0, 0)].sync = dies
    assert engines.boundary(every=1)["sync/bytes"] == 1.0
    assert engines.pool.serving == [1] and made[(1, 0)].version == 1
    assert engines.of_rank().generate([[1]], None, [0]) == [1]
    assert made[(0, 1)].status == STARTING and engines.restarts == 1


def test_a_posted_sync_puts_the_weights_once_for_every_engine_and_probes_them_after_the_load(
    monkeypatch,
):
    """An asynchronous run's sync (``posted``): the weights are gathered and put once for all
    the engines (not once per engine), each engine is handed them without waiting for its
    requests, one found dead leaves; the probe an engine took after loading a version is read
    at the step's end (`posted_diff`), or at the next sync when it was not ready then."""
    engines, made, _, log, state = _engines(monkeypatch, 1, 3, up={0, 1, 2}, posted=True)
    puts = []

    def put(named, version):
        puts.append((version, len(list(named))))
        return SimpleNamespace(version=version, refs=(), bytes=8.0)

    monkeypatch.setattr(grpo_engines, "post_weights", put)
    monkeypatch.setattr(grpo_engines, "logprob_diff", lambda theirs, mine: theirs[0])
    engines.start()
    first = engines.boundary(every=1)
    assert puts == [(0, 2)] and first["sync/bytes"] == 8.0  # one put: weight and bias
    assert "rollout/logprob_diff" not in first  # the engines probe once they load it
    assert [e.version for e in engines.engines] == [0, 0, 0]
    assert not [e for e in log if e[0] == "sync"]
    assert engines.posted_diff() == 0.25 and engines.posted_diff() is None  # read once
    state.progress.global_step = 1
    made[(1, 0)].status = DEAD  # found dead by the post: it leaves, the others take it
    second = engines.boundary(every=1)
    assert puts[-1] == (1, 2) and "rollout/logprob_diff" not in second
    assert engines.pool.serving == [0, 2] and made[(2, 0)].version == 1
    state.progress.global_step = 2  # version 1's probe not read at its step's end: now
    assert engines.boundary(every=1)["rollout/logprob_diff"] == 1.25
    made[(0, 0)].version = None  # slot 0 has not loaded version 2: slot 2 has
    assert engines.posted_diff() == 2.25


def _zero(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def test_the_steps_rollout_is_sampled_again_on_an_engine_left_when_its_engine_dies(monkeypatch):
    """The worker objective's rollout (``GrpoObjective._generate``): its engine died, so the
    step's prompts are sampled on the engine left, by the weights the step synced."""
    from ray_trainer import TrainingArgs
    from ray_trainer._worker.objectives.grpo import GrpoObjective

    engines, made, clock, log, state = _engines(monkeypatch, 1, 2, up={0, 1})
    engines.start()
    state.progress.global_step = 4
    engines.boundary(every=1)  # both hold version 4
    args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[_zero])
    objective = GrpoObjective(args)
    objective.engines = engines
    objective.prompts = [SimpleNamespace(prompt_ids=[1, 2]) for _ in range(3)]
    state.args.seed = 0
    made[(0, 0)].status = DEAD  # this rank's engine, mid-step
    assert objective._generate(state, [0, 2], step=4) == [4, 4]
    assert ("generate", (1, 0), 4) in log and engines.pool.serving == [1]
    assert clock.waits == [] and made[(0, 1)].status == STARTING  # its replacement, not awaited
