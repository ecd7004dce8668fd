"""TRL's ``rollout_func`` on the run's engines (``ray_trainer/_agents/custom.py``), without Ray:
a two-turn loop written against the engines handle becomes the step's completions (ids, the
engine's log-probs, its mask, its own columns for the rewards), and what the step cannot train
on is refused naming the key and the fix."""

from __future__ import annotations

import pytest

from ray_trainer import TrainingArgs
from ray_trainer._agents.custom import CustomSampler, RolloutFuncError, check_output
from ray_trainer._data.prompts import EncodedPrompt
from ray_trainer._objectives import check_fields
from ray_trainer._rollout.engine import SamplingParams
from ray_trainer._rollout.rewards import episode_columns
from ray_trainer._rollout.types import Completion

EOS = 2


class Echo:
    """An engine: each completion is the prompt's last token + 1, then the end token."""

    def __init__(self):
        self.asked = []

    def generate(self, prompts, params, indices=None):
        self.asked.append((len(prompts), params.num_generations, params.max_completion_length))
        return [
            Completion(i, list(p), [p[-1] + 1, EOS], [-0.5, -0.25], False, 7)
            for i, p in enumerate(prompts)
            for _ in range(params.num_generations)
        ]


class Tok:
    eos_token_id = EOS


def two_turns(prompts, engines):
    """A loop in TRL's shape: a turn, a fixed 'tool result' of two tokens, another turn."""
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "turns": []}
    for prompt in prompts:
        ids = [10, len(prompt[0]["content"])]
        first = engines.generate([ids], max_tokens=8)[0]
        tool = [40, 41]
        second = engines.generate([ids + first["completion_ids"] + tool])[0]
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(first["completion_ids"] + tool + second["completion_ids"])
        out["logprobs"].append(first["logprobs"] + [0.0, 0.0] + second["logprobs"])
        out["env_mask"].append([1, 1, 0, 0, 1, 1])
        out["turns"].append(2)
    return out


def test_a_two_turn_loop_becomes_the_steps_completions():
    engine = Echo()
    prompts = [EncodedPrompt([1], [{"role": "user", "content": "abc"}], ""),
               EncodedPrompt([1], [{"role": "user", "content": "abcdef"}], "")]  # fmt: skip
    params = SamplingParams(num_generations=2, max_completion_length=16)
    out = CustomSampler(two_turns, Tok()).sample(engine, prompts, [4, 9], params, "k")
    assert [c.prompt_index for c in out] == [4, 4, 9, 9]
    c = out[2]
    assert c.prompt_ids == [10, 6] and c.completion_ids == [7, EOS, 40, 41, 42, EOS]
    assert c.env_mask == [1, 1, 0, 0, 1, 1] and c.logprobs[2:4] == [0.0, 0.0]
    assert not c.truncated and c.version == 7
    assert episode_columns(out) == {"turns": [2, 2, 2, 2]}  # a reward column by name
    assert engine.asked[0] == (1, 1, 8) and engine.asked[1] == (1, 1, 16)  # the run's length


def test_what_the_step_cannot_train_on_is_refused_naming_it():
    good = {"prompt_ids": [[1]], "completion_ids": [[2, 3]], "logprobs": [[-1.0, -1.0]]}
    assert check_output(good, 1) == good
    for bad, words in (
        ([], "returned a list"),
        ({"prompt_ids": [[1]]}, "no completion_ids, logprobs"),
        ({**good, "logprobs": [[-1.0]]}, r"logprobs\[0\] has 1 entries for the 2 tokens"),
        ({**good, "env_mask": [[1]]}, r"env_mask\[0\] has 1 entries"),
        ({**good, "extra": [1, 2]}, "'extra' has 2 entries for the step's 1 prompts"),
    ):
        with pytest.raises(RolloutFuncError, match=words):
            check_output(bad, 1)


def test_rollout_func_is_grpos_alone_and_synchronous():
    def reward(prompts, completions, completion_ids, **kwargs):
        return [0.0] * len(completions)

    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[reward])
    check_fields(TrainingArgs.coerce(**base, rollout_func=two_turns))
    with pytest.raises(ValueError, match="rollout_func with tools"):
        check_fields(TrainingArgs.coerce(**base, rollout_func=two_turns, tools=[two_turns]))
    with pytest.raises(ValueError, match="max_staleness=1 with rollout_func"):
        check_fields(TrainingArgs.coerce(**base, rollout_func=two_turns, max_staleness=1))
    with pytest.raises(ValueError, match=r"rollout_func='nope:f'.*does not import"):
        check_fields(TrainingArgs.coerce(**base, rollout_func="nope:f"))
    with pytest.raises(ValueError, match="rollout_func set with objective='sft'"):
        check_fields(TrainingArgs.coerce(data="d.jsonl", rollout_func=two_turns))
