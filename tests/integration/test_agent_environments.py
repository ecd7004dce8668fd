"""Multi-turn GRPO's environment actors in a real Ray: `EnvironmentPool` and its faults.

Calls of many episodes overlap on one actor's threads; an actor killed while a call is in flight
and a tool past ``tool_timeout_s`` are `EnvironmentFault`s after which the slot holds a new
actor; two pools of one name (two ranks) share their actors, also after a replacement. (The
actor's class as a plain object: tests/unit/test_agents_environments.py.)
"""

from __future__ import annotations

import time

import pytest
from waiting import wait_until

from ray_trainer._agents.environments import EnvironmentFault, EnvironmentPool, EnvironmentSpec


def fn(name, **arguments):
    """One tool call in TRL's parsed shape."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def started(ray, pool, slot=0):
    """The slot's actor, once it answers (a new actor process takes a few seconds to start)."""
    return ray.get(pool.actor(slot).ping.remote(), timeout=60)


def actor_id(pool, slot=0):
    return pool.actor(slot)._actor_id.hex()


def test_sleeping_tools_of_many_episodes_overlap_on_one_actor(ray_session):
    from agent_envs import Sleeper

    ray = ray_session
    pool = EnvironmentPool(EnvironmentSpec({None: Sleeper}), "envs-overlap")
    try:
        started(ray, pool)
        keys = [f"e{i}" for i in range(64)]
        opened = [(pool.open(k, None, {}), k) for k in keys]
        assert [pool.get(r, k) for r, k in opened] == [None] * 64
        t0 = time.monotonic()
        refs = [(pool.call(k, [fn("nap", seconds=1.0)]), k) for k in keys]
        answers = [pool.get(r, k) for r, k in refs]
        elapsed = time.monotonic() - t0
        assert answers == [[("nap", 1.0, False)]] * 64
        assert elapsed < 20, f"64 one-second naps took {elapsed:.1f} s: they ran one by one"
        rewards = [pool.get(pool.finish(k), k) for k in keys]
        assert {r for r, _ in rewards} == {None} and all(s for _, s in rewards)
        with pytest.raises(ValueError, match="bad row"):  # the user's error, as is: no fault
            pool.get(pool.open("bad", None, {"fail": True}), "bad")
        assert pool.replaced == 0 and started(ray, pool) == 0
    finally:
        pool.close()


def test_an_actor_killed_in_a_call_is_a_fault_and_the_slot_gets_a_new_actor(ray_session):
    from agent_envs import Sleeper

    ray = ray_session
    pool = EnvironmentPool(EnvironmentSpec({None: Sleeper}), "envs-kill")
    try:
        started(ray, pool)
        pool.get(pool.open("e0", None, {}), "e0")
        first = pool.get(pool.call("e0", [fn("where")]), "e0")[0][1]
        old, in_flight = actor_id(pool), pool.call("e0", [fn("nap", seconds=30.0)])
        naps = lambda: pool.get(pool.call("e0", [fn("naps")]), "e0")[0][1]  # noqa: E731
        wait_until(naps, 30, "the nap to begin")
        ray.kill(pool.actor(0))
        with pytest.raises(EnvironmentFault, match="environment actor 0 died"):
            pool.get(in_flight, "e0")
        assert pool.replaced == 1 and actor_id(pool) != old
        assert pool.get(pool.open("e0", None, {}), "e0") is None  # the new actor: opened again
        assert pool.get(pool.call("e0", [fn("where")]), "e0")[0][1] != first
        assert pool.replaced == 1
    finally:
        pool.close()


def test_a_tool_past_the_timeout_is_a_fault_naming_tool_timeout_s(ray_session):
    from agent_envs import Sleeper

    ray = ray_session
    pool = EnvironmentPool(EnvironmentSpec({None: Sleeper}, timeout_s=1.0), "envs-timeout")
    try:
        started(ray, pool)
        pool.get(pool.open("e0", None, {}), "e0")
        old = pool.actor(0)
        t0 = time.monotonic()
        with pytest.raises(EnvironmentFault, match=r"tool_timeout_s=1 s"):
            pool.get(pool.call("e0", [fn("nap", seconds=60.0)]), "e0")
        assert time.monotonic() - t0 < 10
        assert pool.replaced == 1 and pool.actor(0) is not old
        with pytest.raises(ray.exceptions.RayActorError):  # the stuck one was killed
            ray.get(old.ping.remote(), timeout=30)
        assert started(ray, pool) == 0  # the new one, with no episodes
    finally:
        pool.close()


def test_two_ranks_share_the_actors_and_meet_on_the_replacement(ray_session):
    from agent_envs import NoReward

    ray = ray_session
    spec = EnvironmentSpec({None: NoReward}, workers=2)
    rank0 = EnvironmentPool(spec, "envs-ranks")
    rank1 = EnvironmentPool(spec, "envs-ranks")
    try:
        assert [actor_id(rank0, i) for i in (0, 1)] == [actor_id(rank1, i) for i in (0, 1)]
        key = next(k for k in (f"e{i}" for i in range(100)) if rank0.slot(k) == 1)
        assert rank1.slot(key) == 1
        started(ray, rank0, 1)
        assert rank0.get(rank0.open(key, None, {}), key) == "ready"
        ray.kill(rank0.actor(1))
        with pytest.raises(EnvironmentFault):
            rank0.get(rank0.call(key, [fn("where")]), key)
        assert rank0.replaced == 1 and actor_id(rank0, 1) != actor_id(rank1, 1)
        with pytest.raises(EnvironmentFault):  # rank 1 sees the death on its own next call
            rank1.get(rank1.open(key, None, {}), key)
        assert rank1.replaced == 1 and actor_id(rank1, 1) == actor_id(rank0, 1)
        assert rank1.get(rank1.open(key, None, {}), key) == "ready"  # the one rank 0 created
        assert rank0.get(rank0.call(key, [fn("where")]), key)[0][2] is False  # one instance
        assert actor_id(rank0, 0) == actor_id(rank1, 0)  # the other slot untouched
    finally:
        rank1.close()
        rank0.close()
