"""The rollout queue's actor (issue 51, section 1, "where the queue lives") in a real Ray.

One ``RolloutBuffer`` actor of its own shared by two ranks' handles (``RemoteQueue``), with two
stand-in engine actors (``rollout_fakes.HeldEngine``): a request whose engine is killed while it
is in flight is sent again by the queue itself to the engine left and scored in the queue's
process, the step takes it with the re-send named; another rank's request goes straight
through; the bound of k requests in flight holds through Ray; the actor ends when closed. (The
queue in a training run: ``test_grpo.py``, ``test_multinode.py``; its logic with fakes and no
Ray: ``tests/unit/test_grpo_async.py``.)
"""

from __future__ import annotations

import os

import pytest
from waiting import wait_until


def test_the_queue_actor_resends_a_killed_engines_request_and_scores_it_in_its_own_process(
    ray_session,
):
    import ray
    from rollout_fakes import HeldEngine, score_where

    from ray_trainer._rollout.actor import RemoteEngine
    from ray_trainer._rollout.buffer import RemoteQueue, buffer_name
    from ray_trainer._rollout.engine import SamplingParams

    engine = ray.remote(HeldEngine).options(num_cpus=0, max_concurrency=2)
    held, left = engine.remote(3, hold=True), engine.remote(3)
    name, namespace = buffer_name("queue-test", 0), "queue-test"
    rank0 = RemoteQueue.create(name, namespace, 1, 2, score_where)
    rank1 = RemoteQueue.attach(name, namespace, 1, 1)
    try:
        engines = {0: RemoteEngine.attach(held), 1: RemoteEngine.attach(left)}
        rank0.serve(engines)
        params = SamplingParams(num_generations=2, max_completion_length=2, seed=1)

        rank1.submit(4, 0, engines[0], [5, 6], [[1, 2], [3]], params)
        assert len(rank1) == 1 and rank1.room() == 0
        wait_until(lambda: ray.get(held.asked.remote()) == 1, 30, "the request at the engine")
        ray.kill(held)  # its request in flight: the queue sends it to the engine left
        taken = rank1.take([5, 6], trainer_version=4)
        assert taken.resent == [1] and not taken.died and taken.missing == []
        assert [c.prompt_index for c in taken.kept] == [5, 5, 6, 6]
        assert {c.version for c in taken.kept} == {3} and taken.dropped == 0
        actor_pid = taken.scored["pid"]
        assert taken.scored["step"] == 4 and taken.scored["rows"] == [5, 5, 6, 6]
        assert actor_pid != os.getpid()  # scored in the queue's own process, not the caller's
        assert ray.get(left.asked.remote()) == 1

        rank0.submit(5, 1, engines[1], [7], [[4]], params)  # rank 0's own, straight through
        with pytest.raises(RuntimeError, match="in flight already"):
            rank0.submit(6, 1, engines[1], [8], [[4]], params)
        assert ray.get(rank0.actor.depths.remote()) == [1, 0]
        taken = rank0.take([7], trainer_version=4)
        assert taken.resent == [] and taken.scored["pid"] == actor_pid
        assert ray.get(rank0.actor.depths.remote()) == [0, 0]
    finally:
        rank0.close()
    named = lambda: [a for a in ray.util.list_named_actors(True) if a["name"] == name]  # noqa: E731
    wait_until(lambda: not named(), 30, "the queue's actor to end")
