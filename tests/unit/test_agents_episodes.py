"""Multi-turn episodes (``ray_trainer/_agents``) without Ray: their tokens, masks and faults.

A scripted engine answers each turn with fixed text (a tool call, then an answer), tokenized by
the tiny ChatML tokenizer of ``ray_trainer.demo``; the environments run in an in-process
``EnvironmentHost`` (the class the environment actors run), behind a pool whose references are
already resolved. Checked: ids built by concatenation (prompt + sampled turn + the template's
tool-result ids + next turn), ``env_mask`` 0 exactly on tool-result tokens, the engine's
log-probs kept, the turn limit and the length bound as TRL applies them, a raising tool
returned to the model as an error, infrastructure faults restarting an episode (never scored)
and failing the step after the tries; and, against TRL 1.16 itself, the same episode's ids and
mask from ``GRPOTrainer._tool_call_loop``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from ray_trainer._agents.env_host import EnvironmentHost, EnvironmentSpec
from ray_trainer._agents.environments import EnvironmentFault
from ray_trainer._agents.loop import AgentSampler, EpisodeFailed
from ray_trainer._agents.tools import (
    CHATML_TOOL_CALLS,
    resolve_agent_tools,
    run_template,
)
from ray_trainer._data.prompts import EncodedPrompt
from ray_trainer._errors import TrainingArgsError
from ray_trainer._rollout.engine import SamplingParams
from ray_trainer._rollout.types import Completion

CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call><|im_end|>'
ANSWER = "408<|im_end|>"


class Multiply:
    """An environment in the shape of TRL's docs: reset, one typed tool, a reward."""

    def __init__(self):
        self.calls = 0
        self.answer = None

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: The first number.
            b: The second number.

        Returns:
            Their product.
        """
        self.calls += 1
        return a * b

    def get_reward(self) -> float:
        return float(self.calls)


class Broken(Multiply):
    def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        raise ZeroDivisionError("no product today")


@pytest.fixture(scope="module")
def tokenizer():
    from ray_trainer._demo.chat import make_tiny_chat_tokenizer

    return make_tiny_chat_tokenizer("chatml")


class Ref:
    """A resolved stand-in for a Ray reference (hashable, as references are)."""

    def __init__(self, *value):
        self.value = value if len(value) > 1 else value[0]


class ScriptedEngine:
    """Answers turn k of every episode with ``script[k]`` (k: the tool results in its input),
    log-prob -0.5 per token; ``submit`` answers at once."""

    def __init__(self, tokenizer, script, prompt_ids_back=None):
        self.tok = tokenizer
        self.script = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in script]
        self.calls = []
        self.back = prompt_ids_back

    def submit(self, prompts, params, indices):
        self.calls.append((len(prompts), params.max_completion_length))
        out = []
        tool_id = self.tok.convert_tokens_to_ids("<|im_start|>")
        for ids, index in zip(prompts, indices, strict=True):
            turn = max(0, ids.count(tool_id) - 3) // 2  # a tool and an assistant header a round
            sampled = self.script[min(turn, len(self.script) - 1)][: params.max_completion_length]
            truncated = len(sampled) == params.max_completion_length and sampled[-1:] != [
                self.tok.eos_token_id
            ]
            sent = self.back(ids) if self.back else ids
            out.append(Completion(index, list(sent), sampled, [-0.5] * len(sampled), truncated, 3))
        return Ref(out)

    def result(self, ref):
        return ref.value, 0.0, 0.0


class LocalPool:
    """The pool's interface over an in-process host; `faults` keys fail their first calls."""

    def __init__(self, spec, faults=()):
        self.host = EnvironmentHost(spec)
        self.faults = dict.fromkeys(faults, True)
        self.failing_forever = False
        self.dropped = []

    def open(self, key, env, row):
        return Ref("open", key, self.host.open(key, env, row))

    def call(self, key, calls):
        if self.failing_forever or self.faults.pop(key.rsplit("#", 1)[0], False):
            return Ref("fault", key, None)
        return Ref("call", key, self.host.call(key, calls))

    def finish(self, key):
        return Ref("finish", key, self.host.finish(key))

    def get(self, ref, key, timeout_s=None):
        if ref.value[0] == "fault":
            raise EnvironmentFault("environment actor 0 died: killed in the test")
        return ref.value[2]

    def drop(self, key):
        self.dropped.append(key)
        self.host.drop(key)


def _sampler(tokenizer, env=Multiply, tools=None, script=(CALL, ANSWER), **kw):
    agent = resolve_agent_tools(tools, env)
    spec = EnvironmentSpec(factories=agent.factories, tools=agent.tools)
    pool = LocalPool(spec, kw.pop("faults", ()))
    template, response = run_template(tokenizer, None)
    sampler = AgentSampler(
        agent, tokenizer, template, response, pool, kw.pop("max_iterations", None),
        wait=lambda refs, timeout: list(refs),
    )  # fmt: skip
    engine = ScriptedEngine(tokenizer, list(script), kw.pop("back", None))
    return sampler, engine, agent


def _prompt(tokenizer, agent, content="12*34="):
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(
        messages, tools=agent.schemas_of(None), add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    return EncodedPrompt(list(ids), messages, "", {"answer": "408"})


def _run(sampler, engine, prompt, generations=2, max_len=160):
    params = SamplingParams(num_generations=generations, max_completion_length=max_len)
    return sampler.sample(engine, [prompt], [5], params, "s0")


def test_an_episode_is_its_turns_and_the_templates_tool_ids_concatenated(tokenizer):
    sampler, engine, agent = _sampler(tokenizer)
    prompt = _prompt(tokenizer, agent)
    out = _run(sampler, engine, prompt)
    assert len(out) == 2 and {c.prompt_index for c in out} == {5}
    c = out[0]
    call, answer = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (CALL, ANSWER))
    tool = c.completion_ids[len(call) : len(c.completion_ids) - len(answer)]
    assert c.completion_ids == call + tool + answer
    assert tokenizer.decode(tool) == "\n<|im_start|>tool\n408<|im_end|>\n<|im_start|>assistant\n"
    assert c.env_mask == [1] * len(call) + [0] * len(tool) + [1] * len(answer)
    assert c.logprobs == [-0.5] * len(call) + [0.0] * len(tool) + [-0.5] * len(answer)
    assert c.prompt_ids == prompt.prompt_ids and not c.truncated and c.version == 3
    e = c.episode
    assert (e.turns, e.tool_calls, e.tool_failures, e.prefix_mismatch) == (2, 1, 0, 0)
    assert [m["role"] for m in e.messages] == ["assistant", "tool", "assistant"]
    assert e.messages[0]["tool_calls"][0]["function"] == {
        "name": "multiply", "arguments": {"a": 12, "b": 34},
    }  # fmt: skip
    assert e.messages[1] == {"role": "tool", "name": "multiply", "content": "408"}
    assert e.messages[2]["content"] == "408"
    assert e.env_reward == 1.0  # get_reward: one call
    # Both episodes' first turns went in one request, then both second turns in another.
    assert [n for n, _ in engine.calls] == [2, 2]
    assert engine.calls[1][1] == 160 - len(call) - len(tool)  # the room left


def test_the_turn_limit_and_the_length_bound_end_an_episode_as_trl_does(tokenizer):
    sampler, engine, agent = _sampler(tokenizer, script=(CALL, CALL, ANSWER), max_iterations=1)
    c = _run(sampler, engine, _prompt(tokenizer, agent), generations=1)[0]
    assert (c.episode.turns, c.episode.tool_calls) == (2, 1)  # the second call is not run
    assert c.episode.messages[-1]["tool_calls"]
    call = tokenizer(CALL, add_special_tokens=False)["input_ids"]
    sampler, engine, agent = _sampler(tokenizer)
    c = _run(sampler, engine, _prompt(tokenizer, agent), generations=1, max_len=len(call) + 3)[0]
    # The tool result would pass max_completion_length: dropped, the episode ends at its call.
    assert c.completion_ids == call and c.env_mask == [1] * len(call)
    assert (c.episode.turns, c.episode.tool_calls) == (1, 1)


def test_a_tool_that_raises_answers_the_model_with_its_error(tokenizer):
    sampler, engine, agent = _sampler(tokenizer, env=Broken)
    c = _run(sampler, engine, _prompt(tokenizer, agent), generations=1)[0]
    assert c.episode.messages[1]["content"] == "{'error': 'no product today'}"
    assert (c.episode.tool_calls, c.episode.tool_failures, c.episode.turns) == (1, 1, 2)


def test_a_fault_starts_the_episode_again_and_too_many_fail_the_step_naming_the_row(tokenizer):
    sampler, engine, agent = _sampler(tokenizer, faults=["s0:5:1"])
    out = _run(sampler, engine, _prompt(tokenizer, agent))
    assert [c.episode.restarts for c in out] == [0, 1]  # the faulted one, from its beginning
    assert out[0].completion_ids == out[1].completion_ids and sampler.restarts == 1
    assert "s0:5:1" in sampler.pool.dropped  # its first instance was let go
    sampler, engine, agent = _sampler(tokenizer)
    sampler.pool.failing_forever = True
    with pytest.raises(EpisodeFailed, match=r"row 5 faulted 4 times.*tool_timeout_s"):
        _run(sampler, engine, _prompt(tokenizer, agent), generations=1)


def test_a_turn_whose_input_came_back_changed_is_counted(tokenizer):
    sampler, engine, agent = _sampler(tokenizer, back=lambda ids: [0, *ids[1:]])
    c = _run(sampler, engine, _prompt(tokenizer, agent), generations=1)[0]
    assert c.episode.prefix_mismatch == 2


def test_resets_text_joins_the_last_user_message_and_a_standalone_tool_works(tokenizer):
    def square(x: int) -> int:
        """Square a number.

        Args:
            x: The number.
        """
        return x * x

    class Hinted(Multiply):
        def reset(self, **kwargs) -> str | None:
            return f" (hint for {kwargs['answer']})"

    sampler, engine, agent = _sampler(tokenizer, env=Hinted, tools=[square])
    assert [s["function"]["name"] for s in agent.schemas_of(None)] == ["square", "multiply"]
    prompt = _prompt(tokenizer, agent)
    c = _run(sampler, engine, prompt, generations=1)[0]
    assert "12*34= (hint for 408)" in tokenizer.decode(c.prompt_ids)
    assert c.prompt_ids != prompt.prompt_ids


def test_bad_tools_and_factories_are_refused_naming_them_and_the_fix(tokenizer):
    def no_doc(a: int) -> int:
        return a

    def no_hint(a):
        """A tool.

        Args:
            a: A number.
        """

    class NoReset:
        def play(self, a: int) -> int:
            """Play.

            Args:
                a: A number.
            """

    for tools, env, words in (
        ([no_doc], None, r"tools\[0\] 'no_doc'.*docstring"),
        ([no_hint], None, r"tools\[0\] 'no_hint'.*type hint"),
        (None, NoReset, "environment_factory: returned a NoReset with no reset method"),
        ([no_doc, "no_module_here:f"], None, r"tools\[1\]='no_module_here:f'.*does not import"),
        (None, {"a": Multiply, "b": "no_module_here:Env"}, "environment_factory\\['b'\\]"),
    ):
        with pytest.raises(TrainingArgsError, match=words):
            resolve_agent_tools(tools, env)
    agent = resolve_agent_tools(None, {"mult": Multiply})
    with pytest.raises(TrainingArgsError, match=r"'environment' field is 'chess'.*'mult'"):
        agent.environment_of({"environment": "chess"}, "data row 3")


def test_a_template_that_cannot_express_tool_calls_is_refused_naming_it(tokenizer):
    plain = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with pytest.raises(TrainingArgsError, match=r"TrainingArgs\.chat_template drops part"):
        run_template(tokenizer, plain)
    assert run_template(tokenizer, None)[1] is CHATML_TOOL_CALLS


def test_the_same_episode_has_the_same_ids_and_mask_as_trls_tool_loop(tokenizer):
    """TRL 1.16's ``GRPOTrainer._tool_call_loop`` (its own code, with only the generation
    replaced by the same scripted turns) builds the same ids, mask and log-probs."""
    trl = pytest.importorskip("trl")
    from types import SimpleNamespace

    from trl.chat_template_utils import parse_response

    sampler, engine, agent = _sampler(tokenizer)
    prompt = _prompt(tokenizer, agent)
    ours = _run(sampler, engine, prompt, generations=1, max_len=160)[0]

    tokenizer.response_template = CHATML_TOOL_CALLS  # what TRL sets for ChatML templates
    try:
        env = Multiply()
        trainer = object.__new__(trl.GRPOTrainer)
        script = ScriptedEngine(tokenizer, [CALL, ANSWER])

        def single_turn(prompt_ids, images, fields, *args, **kwargs):
            params = SamplingParams(num_generations=1, max_completion_length=160)
            done = script.submit(prompt_ids, params, list(range(len(prompt_ids)))).value
            return [c.completion_ids for c in done], [c.logprobs for c in done]

        trainer.__dict__.update(
            max_tool_calling_iterations=10, _sync_tool_dicts=[{"multiply": env.multiply}],
            _async_tool_dicts=[{}], processing_class=tokenizer, _tokenizer=tokenizer,
            chat_template=None, chat_template_kwargs={}, _is_vlm=False, use_vllm=False,
            model=SimpleNamespace(config=SimpleNamespace(max_position_embeddings=2048)),
            max_completion_length=160, _generate_single_turn=single_turn,
            environment_factories=None, tools=[env.multiply],
        )  # fmt: skip
        first_ids, first_logps = single_turn([prompt.prompt_ids], None, {})
        first = [[parse_response(tokenizer, first_ids[0], prefix=prompt.prompt_ids)]]
        mask, messages, ids, logps, calls, failures, _ = trainer._tool_call_loop(
            [list(prompt.prompt)], [prompt.prompt_ids], first_ids, first, first_logps, None, {}
        )
    finally:
        del tokenizer.response_template
    assert ids[0] == ours.completion_ids
    assert mask[0] == ours.env_mask
    assert logps[0] == ours.logprobs
    assert (calls, failures) == (1, 0)
    assert [m["role"] for m in messages[0]] == [m["role"] for m in ours.episode.messages]


def test_a_turn_sampled_with_more_room_than_its_episode_has_is_cut_and_truncated():
    from ray_trainer._agents.loop import cut

    c = Completion(0, [1], [5, 6, 7, 2], [-0.1, -0.2, -0.3, -0.4], False, 4, [(1, 5), (3, 6)])
    short = cut(c, 2)
    assert (short.completion_ids, short.logprobs, short.truncated) == ([5, 6], [-0.1, -0.2], True)
    assert short.newer_versions == [(1, 5)] and short.version == 4
    assert cut(c, 4) is c  # room enough: as sampled


def test_an_engine_lost_mid_episode_lets_its_instances_go_and_reaches_the_step(tokenizer):
    """The step's retry on the engines left (``grpo.py``'s ``_generate``) starts the episodes
    over with new keys: the lost attempt's instances are dropped, none scored."""
    from ray_trainer._rollout.actor import RolloutEngineDied

    sampler, engine, agent = _sampler(tokenizer)
    calls = []

    def dying(ref):
        calls.append(ref)
        if len(calls) == 2:  # the second turn's request: the engine died
            raise RolloutEngineDied("the rollout engine died: killed in the test")
        return ref.value, 0.0, 0.0

    engine.result = dying
    with pytest.raises(RolloutEngineDied):
        _run(sampler, engine, _prompt(tokenizer, agent))
    assert sorted(sampler.pool.dropped) == ["s0:5:0", "s0:5:1"]
    assert sampler.pool.host.ping() == 0  # no instance left behind
