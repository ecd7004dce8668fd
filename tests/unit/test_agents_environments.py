"""`EnvironmentHost` as a plain object (no Ray): TRL's rules for environments and tools.

The pool and the actors in a real Ray: tests/integration/test_agent_environments.py.
"""

from __future__ import annotations

import cloudpickle
import pytest
from agent_envs import Counter, Locked, NoReward, shout, whisper

from ray_trainer._agents.environments import EnvironmentHost, EnvironmentSpec, environment_tools


def fn(name, **arguments):
    """One tool call in TRL's parsed shape."""
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


class DocCounter:
    """Written as in TRL's docs for `environment_factory`."""

    def __init__(self):
        self.total = 0

    def reset(self, **kwargs) -> str | None:
        self.total = 0
        return None

    def add(self, n: int) -> int:
        """Add a number to the running total.

        Args:
            n: The number to add.

        Returns:
            The new total.
        """
        self.total += n
        return self.total


def host(factories=None, tools=()):
    """A host of `factories` (one Counter by default) and standalone `tools`."""
    factories = {None: Counter} if factories is None else factories
    return EnvironmentHost(EnvironmentSpec(factories, tools=tools))


def test_a_class_written_as_in_trls_docs_keeps_its_state_across_a_turns_calls_in_order():
    h = host({None: DocCounter})
    assert h.open("e0", None, {"prompt": [{"role": "user", "content": "hi"}]}) is None
    answers = h.call("e0", [fn("add", n=2), fn("add", n=3), fn("add", n=-1)])
    assert answers == [("add", 2, False), ("add", 5, False), ("add", 4, False)]
    assert h.call("e0", [fn("add", n=10)]) == [("add", 14, False)]  # the next turn: same instance
    reward, snapshot = h.finish("e0")
    assert reward is None  # no get_reward
    assert cloudpickle.loads(snapshot).total == 14
    assert h.ping() == 0


def test_reset_gets_the_row_and_its_string_is_returned():
    h = host()
    row = {"prompt": "p", "start": 3}
    assert h.open("e0", None, row) == "Start from 3."
    assert h._episodes["e0"].seen == row  # one environment: the whole row, as TRL passes it
    assert h.ping() == 1


def test_the_tools_are_the_public_methods_but_reset_and_get_reward():
    names = [t.__name__ for t in environment_tools(Counter())]
    assert names == ["add", "add_later", "fail"]  # by name (TRL's inspect.getmembers), no property
    h = host()
    h.open("e0", None, {})
    for hidden in ("reset", "get_reward", "_private", "doubled"):
        missing = {"error": f"Tool {hidden} not found."}
        assert h.call("e0", [fn(hidden)]) == [(hidden, missing, True)]


def test_a_raising_tool_an_unknown_tool_and_another_call_type_answer_errors_and_the_turn_goes_on():
    h = host()
    h.open("e0", None, {})
    answers = h.call(
        "e0",
        [
            fn("fail", why="no luck"),
            fn("nope"),
            {"type": "code", "name": "x"},
            fn("add", m=1),  # a bad argument: the TypeError's text
            fn("add", n=1),
        ],
    )
    assert answers[0] == ("fail", {"error": "no luck"}, True)
    assert answers[1] == ("nope", {"error": "Tool nope not found."}, True)
    assert answers[2] == ("x", {"error": "Unsupported tool call type: code"}, True)
    assert answers[3][0] == "add" and answers[3][2] and "m" in answers[3][1]["error"]
    assert answers[4] == ("add", 1, False)


def test_an_async_tool_is_awaited():
    h = host(tools=(whisper,))
    h.open("e0", None, {})
    answers = h.call("e0", [fn("add_later", n=4), fn("add", n=1), fn("whisper", text="HeY")])
    assert answers == [("add_later", 4, False), ("add", 5, False), ("whisper", "hey", False)]


def test_finish_answers_get_rewards_float_and_a_snapshot_with_the_state():
    h = host()
    h.open("e0", None, {})
    h.call("e0", [fn("add", n=7)])
    reward, snapshot = h.finish("e0")
    assert reward == 7.0 and isinstance(reward, float)
    restored = cloudpickle.loads(snapshot)
    assert isinstance(restored, Counter) and restored.total == 7
    assert h.ping() == 0
    with pytest.raises(LookupError, match="no episode is open under key 'e0'"):
        h.call("e0", [fn("add", n=1)])


def test_an_unpicklable_environment_finishes_with_no_snapshot():
    h = host({None: Locked})
    h.open("e0", None, {})
    h.call("e0", [fn("add", n=2)])
    assert h.finish("e0") == (2.0, None)


def test_standalone_tools_with_no_factories():
    h = host({}, tools=(shout, whisper))
    assert h.open("e0", None, {"prompt": "p"}) is None
    answers = h.call("e0", [fn("shout", text="hi"), fn("whisper", text="HO"), fn("add", n=1)])
    assert answers[:2] == [("shout", "HI", False), ("whisper", "ho", False)]
    assert answers[2] == ("add", {"error": "Tool add not found."}, True)
    assert h.finish("e0") == (None, None)


def test_an_environment_has_the_standalone_tools_too_and_its_methods_shadow_them():
    def add(n: int) -> str:
        return "the standalone one"

    h = host(tools=(shout, add))
    h.open("e0", None, {})
    assert h.call("e0", [fn("shout", text="a"), fn("add", n=2)]) == [
        ("shout", "A", False),
        ("add", 2, False),
    ]


def test_named_environments_are_picked_by_the_rows_field_which_reset_does_not_get():
    h = host({"count": Counter, "plain": NoReward})
    assert h.open("a", "count", {"environment": "count", "start": 1}) == "Start from 1."
    assert h._episodes["a"].seen == {"start": 1}
    assert h.open("b", "plain", {"environment": "plain"}) == "ready"
    assert h.finish("b")[0] is None
    with pytest.raises(ValueError, match=r"'other'.*expected one of \['count', 'plain'\]"):
        h.open("c", "other", {"environment": "other"})


def test_episodes_are_apart_and_drop_forgets_one():
    h = host()
    h.open("a", None, {})
    h.open("b", None, {})
    h.call("a", [fn("add", n=1)])
    assert h.call("b", [fn("add", n=10)]) == [("add", 10, False)]
    h.drop("a")
    h.drop("never-opened")
    assert h.ping() == 1


def test_a_reset_that_raises_raises_and_keeps_nothing():
    class Broken(Counter):
        def reset(self, **kwargs):
            raise RuntimeError("bad row")

    h = host({None: Broken})
    with pytest.raises(RuntimeError, match="bad row"):
        h.open("e0", None, {})
    assert h.ping() == 0


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"workers": 0}, "environment_workers is 0"),
        ({"timeout_s": 0}, "tool_timeout_s is 0"),
        ({"resources": {"CPU": -1}}, "environment_resources"),
        ({"factories": {None: 3}}, "not a callable"),
        ({"tools": (3,)}, "not a named function"),
    ],
)
def test_a_bad_spec_names_its_field(fields, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EnvironmentSpec(**fields)


def test_the_spec_travels_by_cloudpickle_with_its_default_resources():
    spec = cloudpickle.loads(cloudpickle.dumps(EnvironmentSpec({None: Counter}, tools=[shout])))
    assert spec.tools == (shout,) and spec.actor_resources == {"CPU": 0.25}
