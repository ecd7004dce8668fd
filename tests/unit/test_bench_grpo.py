"""The arithmetic of `bench/baselines/bench_grpo.py`: steps/s, completion tokens/s and the
shares of a step from a step clock, the prompts, the reward both sides take, the runner's fields
and the report's target (no Ray, no TRL)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_path  # noqa: F401  (every bench folder on the path)
from bench_grpo import (
    LABELS,
    GrpoClock,
    letters_share,
    prompt_records,
    runner_fields,
    step_figures,
    summarise,
    tree_cpu,
)

from ray_trainer._objectives.grpo import GrpoConfig


def _clock(**phases):
    return {
        "begins": [0.0, 5.0, 7.0, 9.0, 13.0],  # a slow first step, then 2, 2, 4 s
        "cpu": [0.0, 4.0, 5.0, 6.0, 8.0],  # half of each second on a CPU
        "tokens": [999, 100, 100, 200, 7],  # the last step (from the last begin) is not timed
        "phases": phases,
    }


def test_step_figures_time_from_the_skipped_steps_to_the_last_begin():
    out = step_figures(_clock(), skip=1)
    assert out["steps_per_s"] == pytest.approx(3 / 8)
    assert out["tokens_per_s"] == pytest.approx(400 / 8)
    assert out["tokens_per_cpu_s"] == pytest.approx(400 / 4)
    assert (out["step_s"], out["steps_timed"]) == (2.0, 3)
    assert out["tokens_per_step"] == pytest.approx(400 / 3)
    assert out["shares"] == {"training": 1.0}  # no phase timed: all of it is training
    # No process tree (TRL's side): its one process's CPU per step.
    assert out["cpu_per_step"] == pytest.approx(4 / 3)
    assert out["cpu_parts"] == {"training process": pytest.approx(4 / 3)}
    with pytest.raises(ValueError, match="leave none"):
        step_figures(_clock(), skip=4)
    with pytest.raises(ValueError, match="completion tokens of 2 steps for 4"):
        step_figures({**_clock(), "tokens": [1, 2]}, skip=1)


def test_the_runners_cpu_per_step_counts_every_ray_process_over_the_timed_steps():
    before = {"1": ["ray::RayTrainWorker", 10.0], "2": ["ray::RolloutActor.generate", 5.0],
              "3": ["raylet", 1.0], "4": ["ray::CallbackActor", 2.0]}  # fmt: skip
    after = {"1": ["ray::RayTrainWorker", 13.0], "2": ["ray::RolloutActor", 8.0],
             "3": ["raylet", 1.5], "5": ["ray::IDLE", 0.3]}  # fmt: skip
    # pid 4 ended (not counted), pid 5 is new (all of its own CPU).
    assert tree_cpu(before, after) == pytest.approx(
        {"training worker": 3.0, "rollout engine": 3.0, "other Ray processes": 0.8}
    )
    clock = {**_clock(), "tree": {"1": before, "4": after}}
    out = step_figures(clock, skip=1)
    assert out["cpu_per_step"] == pytest.approx(6.8 / 3)
    assert out["cpu_parts"]["rollout engine"] == pytest.approx(1.0)
    assert out["tokens_per_cpu_s"] == pytest.approx(400 / 4)  # still the training process's


def test_the_shares_of_a_step_are_the_median_of_each_phase_over_its_step():
    rollout = [9.0, 1.0, 1.0, 1.0, 0.0]  # half of the 2 s steps, a quarter of the 4 s one
    reward = [0.0, 0.2, 0.2, 0.4, 0.0]  # a tenth of each
    out = step_figures(_clock(rollout=rollout, reward=reward), skip=1)
    assert out["shares"]["rollout"] == pytest.approx(0.5)
    assert out["shares"]["reward"] == pytest.approx(0.1)
    assert out["shares"]["training"] == pytest.approx(0.4)


def test_the_runner_clock_takes_tokens_and_timings_from_each_log():
    clock = GrpoClock("unused", completions_per_step=8)
    context = argparse.Namespace(
        batch_metrics={"completions/mean_length": 3.5, "rollout/seconds": 0.7,
                       "reward/seconds": 0.1, "reward": 0.25, "label": "x"}
    )  # fmt: skip
    clock.on_log(context)  # a step without a sync logs no sync/seconds
    assert clock.tokens == [28.0]
    assert clock.phases == {"rollout": [0.7], "reward": [0.1], "sync": [0.0]}
    assert clock.logged[0]["reward"] == 0.25 and "label" not in clock.logged[0]


def test_the_prompts_are_conversations_that_end_on_a_user_turn():
    records = prompt_records(40, seed=1)
    assert records == prompt_records(40, seed=1) and len(records) == 40
    assert all(r["prompt"][-1]["role"] == "user" for r in records)
    assert {m["role"] for r in records for m in r["prompt"]} <= {"system", "user"}


def test_the_reward_is_the_share_of_letters_and_spaces_for_both_completion_forms():
    completions = ["ab c", "a1!?", ""]
    rewards = letters_share([], completions, [])
    assert rewards == [1.0, 0.25, 0.0]
    conversational = [[{"role": "assistant", "content": c}] for c in completions]
    assert letters_share([], conversational, []) == rewards


def test_the_runner_does_the_work_of_trls_side():
    size = {"steps": 5, "skip": 1, "batch_prompts": 4, "generations": 8, "completion_length": 32}
    fields = runner_fields("m", "d.jsonl", size, threads=2, storage="s")
    grpo = GrpoConfig.coerce(fields["grpo"])
    assert (grpo.num_generations, grpo.max_completion_length) == (8, 32)
    assert (grpo.beta, grpo.loss_type, grpo.temperature) == (0.0, "dapo", 1.0)  # TRL's defaults
    assert fields["batch_size"] == 4 and fields["num_workers"] == 1
    assert fields["resources_per_worker"] == fields["rollout_resources"] == {"CPU": 2}
    assert (fields["rollout_backend"], fields["rollout_workers"]) == ("hf", 1)
    assert fields["reward_fns"] == [letters_share] and fields["log_every_steps"] == 1


def _run(steps_per_s, tokens_per_s=None, shares=None, cpu=1.0, parts=None):
    tokens_per_s = 100 * steps_per_s if tokens_per_s is None else tokens_per_s
    return {
        "steps_per_s": steps_per_s, "tokens_per_s": tokens_per_s,
        "tokens_per_cpu_s": tokens_per_s, "step_s": 1 / steps_per_s, "tokens_per_step": 100.0,
        "torch_threads": 1, "shares": shares or {"rollout": 0.5, "training": 0.5},
        "cpu_per_step": cpu, "cpu_parts": parts or {"training process": cpu},
    }  # fmt: skip


def test_the_report_gives_ratios_to_trl_the_shares_and_the_target():
    rows = {
        "trl": [_run(0.9), _run(1.1)],  # median 1.0
        "runner": [
            _run(0.9, shares={"rollout": 0.6, "reward": 0.05, "sync": 0.05, "training": 0.3},
                 cpu=1.25, parts={"training worker": 0.75, "rollout engine": 0.5})
        ],
    }  # fmt: skip
    opts = argparse.Namespace(prompts=16, batch_prompts=2, generations=4, completion_length=8,
                              steps=6, skip=1, hidden_size=32, layers=1, threads=1, rounds=2)  # fmt: skip
    out = summarise(rows, opts)
    assert out["ratios"][LABELS["runner"]] == pytest.approx(0.9)
    assert out["ratios"][LABELS["trl"]] == pytest.approx(1.0)
    assert out["target_met"] and "0.900x (>= 0.9: met)" in out["table"]
    # The runner's step is 1/0.9 s: its shares and their seconds; TRL has no sync.
    assert (
        "| 0.600 | 0.050 | 0.050 | 0.300 | 1.111 | 0.667 | 0.056 | 0.056 | 0.333 |" in out["table"]
    )
    assert "| 0.500 | - | - | 0.500 |" in out["table"]
    # CPU-s per step: TRL's 1.0 against the runner's 1.25 (0.8x), and the runner's parts.
    assert "| 1.111 | 1.250 | 0.800 |" in out["table"]
    assert "| 0.500 | 0.000 | 0.750 |" in out["table"]  # engine, training process, worker
    slow = summarise({**rows, "runner": [_run(0.5)]}, opts)
    assert not slow["target_met"] and "(>= 0.9: MISSED)" in slow["table"]


def test_run_all_holds_the_normalised_report_against_the_target():
    import run_all

    opts = argparse.Namespace(prompts=8, batch_prompts=2, generations=2, completion_length=4,
                              steps=3, skip=1, hidden_size=32, layers=1, threads=1, rounds=1)  # fmt: skip
    for runner, met in ((0.85, False), (0.95, True)):
        report = run_all.normalise("grpo", summarise({"trl": [_run(1.0)],
                                                      "runner": [_run(runner)]}, opts))  # fmt: skip
        assert report["baseline"] == LABELS["trl"] and report["target"] == 0.9
        [(_, figure, target, ok)] = run_all.grpo_goals(report)
        assert (figure, target, ok) == (f"{runner:.3f}x", ">= 0.900x", met)
