"""GRPO rewards a run must not take, and reward functions that do not return (issue 74, points
1 and 3), without Ray.

- what a function returns: hypothesis over returns (floats with NaN and +-inf, None, bools,
  strings, tensors, huge ints, wrong lengths, not a list) through ``call_reward``: either
  accepted with exactly the finite numbers and NaN for None/NaN, or refused with a
  ``RewardError`` naming the function and the row (never another exception);
- a raising function's error ends with one line of function, error and row: the line the
  driver's ``RunFailedError`` quotes (``launch.root_message``);
- the wait for a step's reward tasks (``reward_wait.wait_for_rewards``, against fake tasks and
  a fake clock): past ``reward_timeout_s`` the tasks still running are cancelled and the error
  names them, the completions and the time; a stop seen while they run gives them
  ``STOP_GRACE_S`` more, then cancels them; a slow reward returning within the grace lets the
  stop act as any stop does; a failed function fails the wait at once (the others cancelled);
  the callback actor is asked only after a whole slice without an answer;
- the callback actor's answer (``OutsideRequests.stop_reason``) and the probe that asks it.
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from ray_trainer._actor.requests import OutsideRequests
from ray_trainer._driver.launch import root_message
from ray_trainer._rollout import reward_wait
from ray_trainer._rollout.reward_checks import RewardError, checked_rewards, prompts_of
from ray_trainer._rollout.reward_wait import (
    STOP_GRACE_S,
    RewardStopped,
    RewardTimeout,
    StopProbe,
    wait_for_rewards,
)
from ray_trainer._rollout.rewards import RewardBatch, call_reward, resolve_reward_fns

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
N = 4  # completions of the step


def batch() -> RewardBatch:
    return RewardBatch(
        prompts=["2+2="] * N,
        completions=["4", " 5", "", "4 "],
        completion_ids=[[1], [2, 3], [], [1, 4]],
        prompt_index=[10, 10, 11, 11],
    )


def returning(value):
    def judge(completions, **kwargs):
        return value

    (fn,) = resolve_reward_fns([judge])
    return fn


VALUE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.booleans(),
    st.text(max_size=3),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: torch.tensor(f)),
    st.just(torch.tensor([1.0, 2.0])),
    st.just([1.0]),
)
RETURNED = st.one_of(
    st.lists(VALUE, min_size=N, max_size=N),
    st.lists(VALUE, max_size=N + 2),
    st.lists(VALUE, min_size=N, max_size=N).map(tuple),
    st.floats(allow_nan=True) | st.none() | st.text(max_size=2),
)


def _expected(value) -> float | None:
    """The reward `value` is, or None when it must be refused."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return None
        value = value.item()
    try:
        number = float(value)
    except OverflowError:
        return None
    return None if math.isinf(number) else number


@EXAMPLES
@given(returned=RETURNED)
def test_any_return_is_taken_exactly_or_refused_naming_function_and_row(returned):
    fn = returning(returned)
    whole = isinstance(returned, (list, tuple)) and len(returned) == N
    expected = [_expected(v) for v in returned] if whole else None
    try:
        rewards = call_reward(fn, batch())
    except RewardError as e:
        msg = str(e)
        assert msg.startswith("reward function 'judge' returned"), msg
        assert len(msg.splitlines()) == 1, msg  # the line a run's final error quotes
        if not whole:
            assert f"for {N} completions" in msg, msg
        else:
            bad = next(i for i, v in enumerate(expected) if v is None)  # the first refused
            assert f"for row {bad} of the step's {N} completions (prompt " in msg, msg
        return
    assert whole and None not in expected, (returned, rewards)
    assert len(rewards) == N and all(isinstance(r, float) for r in rewards)
    for got, want in zip(rewards, expected, strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == want, (returned, rewards)
        assert not math.isinf(got)


@pytest.mark.parametrize("inf", [math.inf, -math.inf, torch.tensor(math.inf), 10**400])
def test_an_infinite_reward_is_refused_naming_the_function_and_row(inf):
    with pytest.raises(RewardError) as info:
        call_reward(returning([0.0, 1.0, inf, None]), batch())
    msg = str(info.value)
    assert "reward function 'judge' returned" in msg and "inf" in msg
    assert "for row 2 of the step's 4 completions (prompt 11 of the data)" in msg
    assert "must be finite (None or NaN abstains" in msg


def test_nan_and_none_abstain_as_in_trl():
    rewards = checked_rewards("judge", [math.nan, None, 1, torch.tensor(0.5)], N, str)
    assert math.isnan(rewards[0]) and math.isnan(rewards[1]) and rewards[2:] == [1.0, 0.5]


def test_a_raising_functions_last_line_names_it_the_error_and_the_row():
    """What ``RunFailedError`` says of a raising reward function (issue 74: it said only
    "ZeroDivisionError: division by zero"): the error's last line, through Ray's wrapping."""

    def picky(completions, **kwargs):
        return [1 / len(c) for c in completions]  # the empty completion divides by zero

    def batch_only(completions, **kwargs):
        if len(completions) > 1:
            raise RuntimeError("the reward server refused a batch")
        return [0.0]

    (fn, whole) = resolve_reward_fns([picky, batch_only])
    with pytest.raises(RewardError) as info:
        call_reward(fn, batch())
    last = str(info.value).splitlines()[-1]
    assert last == (
        "reward function 'picky' raised ZeroDivisionError: division by zero on row 2 of the "
        "step's 4 completions (prompt 11 of the data)"
    )
    assert "Traceback" in str(info.value)  # the traceback is still there, above it
    wrapped = f"Training failed.\nTraceback (most recent call last):\n  ...\n{info.value}\n"
    assert root_message(RuntimeError(wrapped)) == last
    with pytest.raises(RewardError) as info:
        call_reward(whole, batch())
    assert str(info.value).splitlines()[-1] == (
        "reward function 'batch_only' raised RuntimeError: the reward server refused a batch "
        "on the step's 4 completions (no row fails alone)"
    )


def test_the_prompts_of_a_message():
    assert prompts_of([3, 3, 1]) == " (prompts 1, 3 of the data)"
    assert prompts_of([7]) == " (prompt 7 of the data)" and prompts_of(None) == ""
    assert prompts_of(list(range(20))).endswith("15 and 4 more of the data)")


# -- waiting for the reward tasks -----------------------------------------------------------------


class Tasks:
    """Reward tasks on a fake clock: `done_at[name]` is when each returns (None: never);
    ``wait`` is ``ray.wait``'s, advancing the clock by its timeout when nothing returns."""

    def __init__(self, done_at: dict[str, float | None], stop_at: float | None = None) -> None:
        self.now = 0.0
        self.done_at = done_at
        self.stop_at = stop_at
        self.cancelled: list[str] = []
        self.ready: list[str] = []
        self.asked: list[float] = []  # when the callback actor was asked

    def clock(self) -> float:
        return self.now

    def wait(self, pending, num_returns, timeout):
        assert num_returns == 1 and timeout >= 0
        due = [r for r in pending if self.done_at[r] is not None]
        due = [r for r in due if self.done_at[r] <= self.now + timeout]
        if not due:
            self.now += timeout
            return [], list(pending)
        first = min(due, key=lambda r: self.done_at[r])
        self.now = max(self.now, self.done_at[first])
        return [first], [r for r in pending if r != first]

    def cancel(self, ref) -> None:
        self.cancelled.append(ref)

    def stop(self) -> str | None:
        self.asked.append(self.now)
        if self.stop_at is not None and self.now >= self.stop_at:
            return "stopped from outside the run: SIGTERM to the driver"
        return None

    def run(self, timeout_s, on_ready=None, stop=True):
        refs = list(self.done_at)
        wait_for_rewards(
            refs, {r: r for r in refs}, wait=self.wait, cancel=self.cancel,
            on_ready=on_ready or self.ready.append, what="step 3's 4 completions",
            timeout_s=timeout_s, stop=self.stop if stop else None, clock=self.clock,
        )  # fmt: skip


def test_quick_rewards_are_taken_as_they_return_and_the_actor_is_never_asked():
    tasks = Tasks({"a": 0.2, "b": 0.01})
    tasks.run(timeout_s=600)
    assert tasks.ready == ["b", "a"] and tasks.asked == [] and tasks.cancelled == []


def test_a_reward_past_its_timeout_is_cancelled_and_named_with_rows_and_time():
    tasks = Tasks({"quick": 0.5, "stuck": None})
    with pytest.raises(RewardTimeout) as info:
        tasks.run(timeout_s=5)
    assert tasks.now == pytest.approx(5.0)  # not a slice later
    assert tasks.ready == ["quick"] and tasks.cancelled == ["stuck"]
    assert str(info.value) == (
        "reward function(s) 'stuck' did not return within reward_timeout_s=5 s on step 3's 4 "
        "completions; their tasks were cancelled. Make them faster, or raise reward_timeout_s "
        "(None: no limit)"
    )
    assert len(tasks.asked) == 4  # once a second without an answer (at 1.5 s, 2.5 s...)


def test_no_timeout_waits_for_a_slow_reward():
    tasks = Tasks({"slow": 1234.5})
    tasks.run(timeout_s=None)
    assert tasks.ready == ["slow"] and tasks.cancelled == []


def test_a_stop_during_a_stuck_reward_cancels_it_after_the_grace():
    tasks = Tasks({"stuck": None, "also": None, "quick": 0.1}, stop_at=2.5)
    with pytest.raises(RewardStopped) as info:
        tasks.run(timeout_s=None)
    seen = 3.1  # the first question after the stop: a slice after the one before
    assert tasks.now == pytest.approx(seen + STOP_GRACE_S)
    assert sorted(tasks.cancelled) == ["also", "stuck"]
    assert max(tasks.asked) == pytest.approx(seen)  # asked until it said stop, then not again
    assert str(info.value).startswith(
        "stopped from outside the run: SIGTERM to the driver, during the rewards of step 3's 4 "
        "completions: reward function(s) 'stuck', 'also' had not returned after 13.1 s; their "
        "tasks were cancelled, the step was not trained"
    )


def test_a_stop_during_a_slow_reward_lets_it_finish_within_the_grace():
    tasks = Tasks({"slow": 8.0}, stop_at=1.0)
    tasks.run(timeout_s=600)
    assert tasks.ready == ["slow"] and tasks.cancelled == []  # the stop acts at the boundary


def test_the_timeout_still_bounds_a_stop_grace():
    tasks = Tasks({"stuck": None}, stop_at=0.0)
    with pytest.raises(RewardTimeout):
        tasks.run(timeout_s=4)
    assert tasks.now == pytest.approx(4.0) and tasks.cancelled == ["stuck"]


def test_a_failed_function_fails_the_wait_at_once():
    tasks = Tasks({"stuck": None, "raises": 0.3})

    def take(ref):
        raise RewardError(f"reward function {ref!r} raised ValueError: x on row 0")

    with pytest.raises(RewardError, match="'raises' raised ValueError"):
        tasks.run(timeout_s=600, on_ready=take)
    assert tasks.now == pytest.approx(0.3) and tasks.cancelled == ["stuck"]


def test_without_a_probe_only_the_timeout_ends_the_wait():
    tasks = Tasks({"stuck": None}, stop_at=0.0)
    with pytest.raises(RewardTimeout):
        tasks.run(timeout_s=2.5, stop=False)
    assert tasks.asked == []


# -- the stop the wait asks for -------------------------------------------------------------------


def test_the_actor_says_a_stop_is_asked_until_it_took_effect():
    requests = OutsideRequests()
    assert requests.stop_reason() is None
    requests.add("save", "ray-trainer save", step=3)
    assert requests.stop_reason() is None  # a save is no stop
    requests.add("stop", "ray-trainer stop", step=4)
    reason = "stopped from outside the run: ray-trainer stop"
    assert requests.stop_reason() == reason
    requests.take()  # delivered to rank 0: still not acted on
    assert requests.stop_reason() == reason
    requests.saw_end(5)
    assert requests.stop_reason() is None


def test_the_probe_asks_the_callback_actor_and_takes_no_answer_for_no_stop(monkeypatch):
    import ray

    asked = []

    class Method:
        def remote(self):
            asked.append(1)
            return "ref"

    class Actor:
        stop_requested = Method()

    found = {"name": None}

    def get_actor(name, namespace):
        found["name"] = (name, namespace)
        if name == "gone":
            raise ValueError("no actor")
        return Actor()

    monkeypatch.setattr(ray, "get_actor", get_actor)
    monkeypatch.setattr(ray, "get", lambda ref, timeout: "stopped from outside the run: x")
    probe = StopProbe("ray-trainer:run", "ray_trainer")
    assert probe() == "stopped from outside the run: x"
    assert probe() and len(asked) == 2 and found["name"] == ("ray-trainer:run", "ray_trainer")
    copy = pickle.loads(pickle.dumps(probe))  # travels to the rollout queue's actor
    assert copy._actor is None and copy.actor_name == "ray-trainer:run"
    assert StopProbe("gone", "ray_trainer")() is None  # no actor (a restart): no stop

    def slow(ref, timeout):
        raise TimeoutError

    monkeypatch.setattr(ray, "get", slow)
    assert probe() is None and probe._actor is None  # looked up again next time
    assert reward_wait.PROBE_TIMEOUT_S <= 5


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "x"


def _zero(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


def test_the_runs_timeout_and_stop_probe_reach_each_steps_scoring():
    """A training worker's scoring of a step (and the copy the rollout queue's actor gets) waits
    `reward_timeout_s` and asks the run's callback actor for a stop."""
    from types import SimpleNamespace

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.objectives.grpo import GrpoObjective

    for timeout in (7.5, None):
        args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                                   reward_fns=[_zero], reward_timeout_s=timeout)  # fmt: skip
        objective = GrpoObjective(args)
        spec = SimpleNamespace(launch_id="l", actor_name="ray-trainer:r", actor_namespace="ns")
        objective.begin(spec, rank=1, attempt=0)  # rank 1: no engines made here
        objective.prompts = SimpleNamespace(prompts=[])
        state = SimpleNamespace(workload=SimpleNamespace(tokenizer=_Tokenizer()), total_steps=3)
        scorer = pickle.loads(pickle.dumps(objective._scorer(state)))
        assert scorer.timeout_s == timeout and isinstance(scorer.stop, StopProbe)
        assert (scorer.stop.actor_name, scorer.stop.namespace) == ("ray-trainer:r", "ns")
    assert TrainingArgs.model_fields["reward_timeout_s"].default == 600.0


@pytest.mark.parametrize(
    ("fields", "needle"),
    [({"reward_timeout_s": 0}, "reward_timeout_s: Input should be greater than 0 (got 0)"),
     ({"reward_timeout_s": -1}, "reward_timeout_s: Input should be greater than 0"),
     ({"reward_timeout_s": math.inf}, "reward_timeout_s: Input should be a finite number"),
     ({"reward_timeout_s": math.nan}, "reward_timeout_s: Input should be a finite number"),
     ({"reward_timeout_s": 5, "objective": "sft", "reward_fns": None},
      "reward_timeout_s set with objective='sft'")],
)  # fmt: skip
def test_bad_reward_timeouts_are_refused_naming_the_field(fields, needle):
    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._errors import TrainingArgsError

    base = {"objective": "grpo", "data": "p.jsonl", "model": "m", "reward_fns": [_zero]}
    with pytest.raises(TrainingArgsError) as info:
        TrainingArgs.coerce(**{**base, **fields})
    assert needle in str(info.value)
