"""The arithmetic of `bench/runner/bench_async_rl.py`: its settings, the fields each setting gives
`run_training` (validated as the driver validates them, no Ray), a run's figures from rank 0's
clock, the report's ratios per engine count, the seed spread and the target, and `run_all.py`'s
goals on it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_path  # noqa: F401  (every bench folder on the path)
from bench_async_rl import (
    async_fields,
    label,
    parse_setting,
    reward_at,
    run_figures,
    summarise,
)
from bench_grpo import letters_share

from ray_trainer import TrainingArgs


def _opts(**kw):
    base = dict(prompts=16, batch_prompts=4, generations=8, completion_length=32, steps=6,
                skip=1, reward_step=6, reward_window=2, hidden_size=32, layers=1, threads=1,
                rounds=1, learning_rate=1e-4)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def _size(engines, staleness):
    return {"steps": 6, "skip": 1, "engines": engines, "staleness": staleness,
            "batch_prompts": 4, "generations": 8, "completion_length": 32}  # fmt: skip


def test_a_setting_is_engines_x_staleness():
    assert parse_setting("1x0") == (1, 0) and parse_setting("2x1") == (2, 1)
    for bad in ("0x1", "1", "ax1", "1x-1"):
        with pytest.raises(ValueError, match="ENGINESxSTALENESS"):
            parse_setting(bad)
    assert "(synchronous, baseline)" in label(2, 0) and "baseline" not in label(1, 1)


def test_two_engines_split_the_steps_prompts_over_two_workers_and_the_driver_accepts_them():
    one = async_fields("m", "d.jsonl", _size(1, 1), _opts(), "s", seed=43)
    two = async_fields("m", "d.jsonl", _size(2, 0), _opts(), "s", seed=42)
    assert (one["num_workers"], one["rollout_workers"], one["batch_size"]) == (1, 1, 4)
    assert (two["num_workers"], two["rollout_workers"], two["batch_size"]) == (2, 2, 2)
    assert (one["max_staleness"], two["max_staleness"]) == (1, 0)
    assert (one["seed"], one["learning_rate"]) == (43, 1e-4)
    # bench_grpo.py's runner side otherwise: the reward, the engines' own CPUs, the sampling.
    assert one["reward_fns"] == [letters_share] and one["rollout_backend"] == "hf"
    assert one["resources_per_worker"] == one["rollout_resources"] == {"CPU": 1}
    args = TrainingArgs(**{**two, "max_staleness": 1})  # the driver's own validation
    assert (args.max_staleness, args.num_workers, args.grpo.num_generations) == (1, 2, 8)
    with pytest.raises(ValueError, match="do not split"):
        async_fields("m", "d", {**_size(2, 0), "batch_prompts": 3}, _opts(), "s", seed=42)


def test_the_reward_at_a_step_is_the_mean_of_the_window_ending_there():
    rewards = [0.1, 0.2, 0.4, 0.6]
    assert reward_at(rewards, 4, 2) == pytest.approx(0.5)
    assert reward_at(rewards, 3, 1) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="4 logged"):
        reward_at(rewards, 5, 2)


def test_a_runs_figures_are_medians_over_the_timed_steps():
    logged = [{"reward": 0.5, "rollout/seconds": 9.0, "rollout/stale_dropped": 2.0}] + [
        {"reward": 0.5, "rollout/seconds": s, "rollout/wait_seconds": w,
         "rollout/overlap_seconds": o, "rollout/age_mean": 1.0}
        for s, w, o in ((0.4, 0.1, 0.3), (0.5, 0.0, 0.5), (0.6, 0.2, 0.4), (0.9, 0.9, 0.0))
    ]  # fmt: skip
    clock = {
        "begins": [0.0, 3.0, 4.0, 5.0, 7.0],  # step 1 (the warm-up) left out: 3 steps in 4 s
        "cpu": [0.0, 1.0, 2.0, 3.0, 4.0],
        "tokens": [10] * 5,
        "phases": {},
        "rewards": [0.2, 0.4, 0.6, 0.8, 1.0],
        "logged": logged,
        "torch_threads": 1,
    }
    out = run_figures(clock, _size(1, 1), _opts(reward_step=5, reward_window=2))
    assert out["steps_per_s"] == pytest.approx(3 / 4) and out["step_s"] == 1.0
    assert out["reward"] == pytest.approx(0.9)
    t = out["timings"]  # the last logged step (from the last begin) is not timed
    assert (t["rollout (s)"], t["wait (s)"], t["overlap (s)"]) == (0.5, 0.1, 0.4)
    assert t["age mean"] == 1.0 and t["sync (s)"] is None  # no step logged a sync
    assert out["stale_dropped"] == 2.0  # over the whole run
    sync = run_figures(
        {**clock, "logged": [{"reward": 0.5}] * 5}, _size(1, 0), _opts(reward_step=5)
    )
    assert sync["timings"]["wait (s)"] is None  # not logged under max_staleness=0


def _run(steps_per_s, reward, wait=None):
    return {"steps_per_s": steps_per_s, "step_s": 1 / steps_per_s, "cpu_per_step": 1.0,
            "reward": reward, "stale_dropped": 0.0,
            "timings": {"rollout (s)": 0.3, "wait (s)": wait, "overlap (s)": None,
                        "sync (s)": 0.02, "age mean": None}}  # fmt: skip


def _samples(async_steps=1.5, async_reward=0.51):
    return {
        "1x0@42": [_run(1.0, 0.50)], "1x0@43": [_run(1.1, 0.53)],
        "1x1@42": [_run(async_steps, async_reward, wait=0.05)],
        "1x2@42": [_run(1.6, 0.49, wait=0.0)],
        "2x0@42": [_run(0.8, 0.50)], "2x1@42": [_run(1.0, 0.52, wait=0.1)],
    }  # fmt: skip


def test_the_report_holds_each_setting_to_the_synchronous_run_of_its_engine_count():
    out = summarise(_samples(), _opts())
    r = out["ratios"]
    assert r[label(1, 0)] == 1.0 and r[label(1, 1)] == pytest.approx(1.5)
    assert r[label(1, 2)] == pytest.approx(1.6)
    assert r[label(2, 0)] == 1.0 and r[label(2, 1)] == pytest.approx(1.25)  # 1.0 / 0.8
    assert out["baseline"] == label(1, 0)
    assert out["seed_spread"] == pytest.approx(0.03) and out["reward_gap"] == pytest.approx(0.01)
    assert out["target_met"] and "1.500x the synchronous steps/s (>= 1.4: met)" in out["table"]
    assert "| 43 | 0.5300 |" in out["table"]  # the seed rows
    assert "| 0.300 | 0.050 | - |" in out["table"]  # rollout, wait; overlap not logged
    slow = summarise(_samples(async_steps=1.3), _opts())
    assert not slow["target_met"] and "(>= 1.4: MISSED)" in slow["table"]
    drifted = summarise(_samples(async_reward=0.6), _opts())  # 0.1 apart, spread 0.03
    assert not drifted["target_met"] and "OUTSIDE" in drifted["table"]


def test_one_seed_gives_no_spread_and_misses_the_reward_half_of_the_target():
    samples = {k: v for k, v in _samples().items() if k in ("1x0@42", "1x1@42")}
    out = summarise(samples, _opts())
    assert out["seed_spread"] is None and not out["target_met"]
    assert "no seed spread measured" in out["table"]


def test_run_all_normalises_the_report_and_reads_both_goals():
    import run_all

    report = run_all.normalise("async_rl", summarise(_samples(), _opts()))
    assert report["baseline"] == label(1, 0) and report["target"] == 1.4
    assert report["ratios"][label(2, 1)] == pytest.approx(1.25)
    speed, reward = run_all.async_rl_goals(report)
    assert speed[1:] == ("1.500x", ">= 1.400x", True)
    assert reward[1:] == ("0.0100", "<= 0.0300", True)
    one_seed = {k: v for k, v in _samples(async_steps=1.2).items() if "@43" not in k}
    speed, reward = run_all.async_rl_goals(run_all.normalise("async_rl",
                                                             summarise(one_seed, _opts())))  # fmt: skip
    assert speed[3] is False and reward[2:] == ("a seed spread", False)
