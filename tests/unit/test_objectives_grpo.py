"""GRPO's settings and description (issue 50, point 1): TRL 1.16's names and defaults, refusals
that name the field and the fix, and an objective that is described but not registered (its
loop is not wired: a user cannot pick it yet)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from ray_trainer import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._objectives import names, objective_of
from ray_trainer._objectives.grpo import (
    GRPO,
    IMPORTANCE_SAMPLING,
    LOSS_METRICS,
    LOSS_TYPES,
    ROLLOUT_METRICS,
    ROLLOUT_TIMINGS,
    SCALE_REWARDS,
    GrpoConfig,
)

#: Our names for TRL's, where they differ.
TRL_NAMES = {
    "importance_sampling": "vllm_importance_sampling_mode",
    "importance_sampling_cap": "vllm_importance_sampling_clip_max",
    "importance_sampling_min": "vllm_importance_sampling_clip_min",
}


def test_every_setting_has_trls_default():
    pytest.importorskip("trl")
    from trl import GRPOConfig as TrlConfig

    trl = {f.name: f.default for f in dataclasses.fields(TrlConfig)}
    ours = GrpoConfig()
    for name in GrpoConfig.model_fields:
        if name == "sync_every":  # ours: TRL syncs before every generation
            assert ours.sync_every == 1
            continue
        assert getattr(ours, name) == trl[TRL_NAMES.get(name, name)], name
    assert trl["vllm_importance_sampling_correction"] is True  # ours: a mode, None is off
    assert (ours.epsilon_low, ours.upper_epsilon) == (0.2, 0.2)
    assert GrpoConfig(epsilon_high=0.28).upper_epsilon == 0.28
    assert GrpoConfig(scale_rewards=True).scale_rewards == "group"  # TRL's older booleans
    assert GrpoConfig(scale_rewards=False).scale_rewards == "none"


def test_the_config_and_the_loss_know_the_same_choices():
    fields = GrpoConfig.model_fields
    assert typing.get_args(fields["loss_type"].annotation) == LOSS_TYPES
    assert typing.get_args(fields["scale_rewards"].annotation) == SCALE_REWARDS
    modes = typing.get_args(typing.get_args(fields["importance_sampling"].annotation)[0])
    assert modes == IMPORTANCE_SAMPLING


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"beta": -0.1}, "grpo.beta: Input should be greater than or equal to 0 (got -0.1); TRL's default is 0.0"),
        ({"num_generations": 1}, "grpo.num_generations: Input should be greater than or equal to 2"),
        ({"num_generations": True}, "grpo.num_generations: got True: a boolean where a number goes"),
        ({"loss_type": "cispo"}, "grpo.loss_type: Input should be 'dapo', 'grpo', 'dr_grpo' or 'bnpo'"),
        ({"num_generation": 4}, "grpo.num_generation: unknown field; did you mean 'num_generations'?"),
        ({"vllm_importance_sampling_cap": 2}, "TRL's name; here it is grpo.importance_sampling_cap"),
        ({"reward_funcs": [len]}, "not a grpo setting: set TrainingArgs.reward_fns"),
        ({"delta": 1.5}, "grpo.delta: a TRL GRPOConfig field that ray-trainer does not support yet"),
        ({"importance_sampling": "token_truncate", "importance_sampling_cap": None},
         "both are None; set importance_sampling_cap (TRL's default is 3.0)"),
        ({"importance_sampling_min": 3.0}, "must be below importance_sampling_cap=3.0"),
        ({"reward_weights": [1.0]}, "not a grpo setting: set TrainingArgs.reward_weights"),
        ({"top_p": 0}, "grpo.top_p: Input should be greater than 0"),
    ],
)  # fmt: skip
def test_bad_settings_are_named_with_the_fix(fields, needle):
    with pytest.raises(TrainingArgsError) as info:
        GrpoConfig.coerce(fields)
    assert needle in str(info.value)
    with pytest.raises(TrainingArgsError, match="pass a GrpoConfig or a dict of its fields"):
        GrpoConfig.coerce([("beta", 0.1)])
    config = GrpoConfig(beta=0.04)
    assert GrpoConfig.coerce(config) is config


def _reward(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


def test_grpo_is_registered_and_owns_its_fields():
    assert "grpo" in names() and objective_of("grpo") is GRPO
    assert GRPO.name == "grpo" and GRPO.takes("prompts") and not GRPO.takes("messages")
    assert GRPO.fields == (
        "grpo", "reward_fns", "reward_weights", "reward_resources", "reward_timeout_s",
        "rollout_backend", "rollout_resources", "rollout_workers", "max_staleness", "tools",
        "environment_factory", "rollout_func", "environment_workers", "environment_resources",
        "tool_timeout_s",
    ) and not GRPO.needs_reference(None)  # fmt: skip
    assert GRPO.metrics == (*ROLLOUT_METRICS, *LOSS_METRICS, *ROLLOUT_TIMINGS)
    for name in ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio",
                 "clip_ratio/region_mean", "kl", "entropy", "rollout/logprob_diff"):  # fmt: skip
        assert name in GRPO.metrics, name
    args = TrainingArgs.coerce(
        objective="grpo", data="p.jsonl", model="m", reward_fns=_reward, grpo={"beta": 0.1}
    )
    assert args.grpo == GrpoConfig(beta=0.1) and args.to_public_dict()["grpo"]["beta"] == 0.1
    # What the trackers export: the description's metrics and each reward function's.
    exported = args.to_public_dict()["objective_metrics"]
    assert exported[: len(GRPO.metrics)] == list(GRPO.metrics)
    assert {"rewards/_reward/mean", "rewards/_reward/std", "rollout/engine_restarts"} <= set(
        exported
    )
    with pytest.raises(TrainingArgsError, match="rollout_backend set with objective='sft'"):
        TrainingArgs.coerce(rollout_backend="hf")


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"reward_fns": None}, "GRPO needs at least one reward function"),
        ({"reward_fns": "no_such_module:f"}, "module 'no_such_module' does not import"),
        # The top-level field as users write it (issue 74, point 5), not "grpo.reward_weights".
        ({"reward_weights": [1.0, 2.0]}, "(args): reward_weights has 2 weight(s) for 1 reward"),
        ({"rollout_workers": (2, 1)}, "rollout_workers=(2, 1): elastic rollout engines need"),
        ({"rollout_workers": (0, 2)}, "rollout_workers=(0, 2): elastic rollout engines need"),
        ({"rollout_workers": (1, 2, 3)}, "rollout_workers takes a number of engines or (min"),
        ({"rollout_workers": 0}, "rollout_workers must be an integer >= 1, got 0"),
        ({"rollout_resources": {"CPU": -1}}, "rollout_resources['CPU'] must be a number >= 0"),
        ({"eval_every_steps": 2}, "GRPO has no validation step yet"),
        ({"num_workers": (1, 2)}, "an elastic worker group is not built for GRPO yet"),
        ({"grpo": {"beta": 0.1}, "strategy": "fsdp"}, "add lora (the reference is the base"),
        ({"loss_fn": len}, "loss_fn with objective='grpo'"),
        ({"rollout_backend": "nope"}, "Input should be 'hf', 'vllm' or 'auto'"),
    ],
)  # fmt: skip
def test_what_grpo_refuses_is_named_before_ray_starts(fields, needle):
    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[_reward])
    with pytest.raises(TrainingArgsError) as info:
        TrainingArgs.coerce(**{**base, **fields})
    assert needle in str(info.value)


def test_grpo_refuses_a_custom_loss_and_no_data():
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="drop loss_fn"):
        GRPO.check(SimpleNamespace(loss_fn=len, data="p.jsonl"))
    with pytest.raises(ValueError, match=r"needs data: prompt-only records such as"):
        GRPO.check(SimpleNamespace(loss_fn=None, data=None))


def test_engines_and_a_reward_task_that_cannot_fit_beside_the_workers_are_refused():
    from ray_trainer._driver.checks.resources import ResourceRequestError, check_resources

    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[_reward], num_workers=2)
    two_cores = [{"CPU": 2.0}]
    with pytest.raises(ResourceRequestError) as info:  # the default: a CPU per worker and engine
        check_resources(TrainingArgs.coerce(**base), nodes=two_cores)
    assert "rollout engine 0 needs {'CPU': 1.0} beside the 2 worker(s)" in str(info.value)
    fits = dict(resources_per_worker={"CPU": 0.25}, rollout_resources={"CPU": 0.5})
    check_resources(TrainingArgs.coerce(**base, **fits), nodes=two_cores)  # 0.5 + 0.5 + 1
    with pytest.raises(ResourceRequestError, match="a reward function's task needs"):
        check_resources(TrainingArgs.coerce(**base, **fits, rollout_workers=2), nodes=two_cores)
    # Elastic engines (1, 2): the first step waits for 1, the second may wait for room.
    elastic = TrainingArgs.coerce(**base, **fits, rollout_workers=[1, 2])
    assert elastic.rollout_range == (1, 2)
    check_resources(elastic, nodes=two_cores)
    assert TrainingArgs.coerce(**base, rollout_workers=3).rollout_range == (3, 3)
    assert TrainingArgs.coerce(**base, rollout_workers=(2, 2)).rollout_workers == 2
    check_resources(TrainingArgs(num_workers=2), nodes=two_cores)  # SFT places nothing beside


def test_the_driver_encodes_every_prompt_and_checks_the_reward_fns_against_its_columns(tmp_path):
    import json

    from ray_trainer._data.sources import DataFileError
    from ray_trainer._demo.chat import make_tiny_chat_model
    from ray_trainer._driver.data import plan_data, prepare_data

    model = str(make_tiny_chat_model(tmp_path / "model", style="chatml"))
    data = tmp_path / "p.jsonl"
    rows = [{"prompt": [{"role": "user", "content": f"Add {i} and 1."}], "answer": str(i + 1)}
            for i in range(3)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = dict(objective="grpo", data=str(data), model=model, reward_fns=[_reward],
                max_length=64, grpo={"max_completion_length": 16},
                storage_path=str(tmp_path / "storage"))  # fmt: skip
    plans = plan_data(TrainingArgs.coerce(**base))
    prompts = plans["data"].prompts
    assert [p.columns for p in prompts] == [{"answer": str(i + 1)} for i in range(3)]
    assert all(0 < len(p.prompt_ids) <= 64 - 16 for p in prompts) and plans["data"].samples == 3
    assert prepare_data(plans, TrainingArgs.coerce(**base)) == {}  # no token cache, no Ray

    def no_columns(prompts, completions, completion_ids, trainer_state):
        return [0.0] * len(completions)

    with pytest.raises(TrainingArgsError, match="cannot take 'answer'"):
        plan_data(TrainingArgs.coerce(**{**base, "reward_fns": [no_columns]}))
    with pytest.raises(DataFileError, match=r"data: .*p.jsonl:1: the prompt has \d+ tokens"):
        plan_data(TrainingArgs.coerce(**{**base, "max_length": 20}))


def _judge(prompts, completions, completion_ids, **kwargs):
    return [1.0] * len(completions)


def test_reward_resources_reach_each_functions_task_options_and_the_fit_check():
    from ray_trainer._driver.checks.resources import ResourceRequestError, check_resources
    from ray_trainer._rollout.rewards import resolve_reward_fns, task_options

    def options(resources):
        return {f.name: task_options(f) for f in resolve_reward_fns([_reward, _judge], resources)}

    default = options(None)  # one CPU each, no GPU, no retry, named in Ray's dashboard
    assert default["_reward"] == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {},
                                  "max_retries": 0, "name": "reward:_reward"}  # fmt: skip
    shared = options({"CPU": 0.5, "accelerator_type:T4": 0.1})  # one dict: every function's
    for name in ("_reward", "_judge"):
        assert shared[name]["num_cpus"] == 0.5 and shared[name]["num_gpus"] == 0.0
        assert shared[name]["resources"] == {"accelerator_type:T4": 0.1}
    per = options({"_judge": {"CPU": 0, "GPU": 1}})  # by name: the others keep one CPU
    assert (per["_judge"]["num_cpus"], per["_judge"]["num_gpus"]) == (0.0, 1.0)
    assert (per["_reward"]["num_cpus"], per["_reward"]["num_gpus"]) == (1.0, 0.0)
    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[_reward, _judge])
    for bad, needle in (({"_judge": {"GPU": -1}}, "reward_resources for '_judge'"),
                        ({"CPU": "one"}, "give a dict of Ray resources"),
                        ({"judge": {"GPU": 1}}, "reward_resources names 'judge'")):  # fmt: skip
        with pytest.raises(TrainingArgsError, match=needle):
            TrainingArgs.coerce(**base, reward_resources=bad)
    with pytest.raises(TrainingArgsError, match="reward_resources set with objective='sft'"):
        TrainingArgs.coerce(model="m", data="d.jsonl", reward_resources={"CPU": 1})
    # The fit check keeps the largest reward task free beside the workers and the engine
    # (each resource's largest over the functions: _reward's CPU, _judge's GPU).
    fits = dict(base, num_workers=2, resources_per_worker={"CPU": 0.25},
                rollout_resources={"CPU": 0.5})  # fmt: skip
    check_resources(TrainingArgs.coerce(**fits, reward_resources={"CPU": 0.5}),
                    nodes=[{"CPU": 1.5}])  # fmt: skip  # 0.5 + 0.5 + 0.5
    with pytest.raises(ResourceRequestError, match=r"task needs \{'CPU': 1.0, 'GPU': 1.0\}"):
        check_resources(
            TrainingArgs.coerce(**fits, reward_resources={"_judge": {"CPU": 0.5, "GPU": 1}}),
            nodes=[{"CPU": 2.0}],
        )


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_every_resources_field_refuses_a_non_finite_or_negative_amount_before_ray(bad):
    from ray_trainer._rollout.actor import actor_options

    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[_reward])
    with pytest.raises((TrainingArgsError, ValueError), match="reward_resources"):
        TrainingArgs(**base, reward_resources={"CPU": bad})
    with pytest.raises(ValueError, match="resources_per_worker"):
        TrainingArgs(**base, resources_per_worker={"CPU": bad})
    with pytest.raises(ValueError, match="rollout_resources"):
        actor_options({"CPU": bad})
