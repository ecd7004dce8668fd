"""A run's tools checked in the driver (``ray_trainer/_agents/tools.py``), without Ray: the
fields and their refusals before anything runs, the prompts rendered with the tools' schemas
(as each environment of a row shows them), and the chat template checks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from ray_trainer import TrainingArgs
from ray_trainer._agents.tools import agent_prompts, resolve_agent_tools
from ray_trainer._data.chat import RecordError
from ray_trainer._data.prompts import PromptEncoder
from ray_trainer._objectives import check_fields


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


class Board:
    def reset(self, **row) -> str | None:
        return None

    def move(self, square: str) -> str:
        """Play a move.

        Args:
            square: Where to play.
        """
        return square

    def get_reward(self) -> float:
        return 1.0


def _reward(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def tokenizer():
    from ray_trainer._demo.chat import make_tiny_chat_tokenizer

    return make_tiny_chat_tokenizer("chatml")


def _args(**kw):
    base = dict(objective="grpo", data="p.jsonl", model="m", reward_fns=[_reward])
    return TrainingArgs.coerce(**{**base, **kw})


def test_the_fields_are_grpos_and_what_agents_do_not_compose_with_yet_is_refused():
    with pytest.raises(ValueError, match="tools, environment_workers set with objective='sft'"):
        check_fields(TrainingArgs.coerce(data="d.jsonl", tools=[add], environment_workers=2))
    with pytest.raises(ValueError, match="max_staleness=1 with tools or environment_factory"):
        check_fields(_args(tools=[add], max_staleness=1))
    with pytest.raises(ValueError, match="environment_resources"):
        check_fields(_args(environment_factory=Board, environment_resources={"CPU": -1}))
    check_fields(_args(tools=[add], environment_factory={"go": Board, "chess": Board}))
    with pytest.raises(ValueError, match="tool_timeout_s"):
        _args(tools=[add], tool_timeout_s=0)
    with pytest.raises(ValueError, match="max_tool_calling_iterations"):
        _args(tools=[add], grpo={"max_tool_calling_iterations": -1})


def test_schemas_put_standalone_tools_first_and_environments_own_their_reward():
    agent = resolve_agent_tools([add], {"go": Board, "chess": "test_agents_tools:Board"})
    assert agent.multi and set(agent.factories) == {"go", "chess"}
    assert [s["function"]["name"] for s in agent.schemas_of("go")] == ["add", "move"]
    assert agent.rewarded == {"go": "Board", "chess": "Board"}
    only = resolve_agent_tools("test_agents_tools:add", None)
    assert (
        not only.multi
        and only.factories == {}
        and only.schemas_of(None)[0]["function"]["name"] == "add"
    )
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        resolve_agent_tools([add, add], None)


def test_prompts_are_rendered_with_their_environments_tools_and_refused_naming_the_fix(tokenizer):
    args = _args(tools=[add], environment_factory={"go": Board})
    encoder = PromptEncoder(
        tokenizer, max_length=2048, max_completion_length=64, **agent_prompts(args, tokenizer)
    )
    convo = [{"role": "user", "content": "play"}]
    encoded = encoder.encode({"prompt": convo, "environment": "go"})
    text = tokenizer.decode(encoded.prompt_ids)
    assert '"name": "add"' in text and '"name": "move"' in text  # the row's environment's tools
    assert encoded.columns == {"environment": "go"}
    with pytest.raises(RecordError, match=r"'environment' field is 'chess'.*'go'"):
        encoder.encode({"prompt": convo, "environment": "chess"})
    with pytest.raises(RecordError, match="tools need a conversation"):
        encoder.encode({"prompt": "play"})
    assert agent_prompts(_args(), tokenizer) == {}
