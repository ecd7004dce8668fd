"""Training worker and reward tasks: an environment's own reward, as one more reward function.

An environment that defines ``get_reward()`` owns its reward, as in TRL 1.16: each episode's
instance is asked once, when the episode ends (in its environment actor), and the value is
logged under the environment's class name (``rewards/<Class>/mean``) with weight 1, beside the
run's ``reward_fns``. An episode of another environment gets None from it (left out, as TRL).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ray_trainer._agents.tools import AgentTools
from ray_trainer._rollout.rewards import RewardFunction


@dataclass(frozen=True)
class EnvironmentReward:
    """The reward function of the environments in `names` (None: the run's only one): each
    completion's ``environment_reward`` column where its row's ``environment`` is one of them.
    Runs in a reward task."""

    names: tuple[str, ...] | None = None

    def __call__(
        self,
        prompts: Any = None,
        completions: Any = None,
        completion_ids: Any = None,
        environment_reward: Sequence[float | None] | None = None,
        environment: Sequence[str | None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        values = list(environment_reward or [None] * len(completions or []))
        if self.names is None or environment is None:
            return values
        return [v if e in self.names else None for v, e in zip(values, environment, strict=True)]


def environment_reward_fns(agent: AgentTools | None) -> list[RewardFunction]:
    """One reward function per environment class that defines ``get_reward``."""
    if agent is None:
        return []
    by_class: dict[str, list[str | None]] = {}
    for name, cls in agent.rewarded.items():
        by_class.setdefault(cls, []).append(name)
    out = []
    for cls, names in by_class.items():
        picked = None if names == [None] else tuple(n for n in names if n is not None)
        fn = EnvironmentReward(picked)
        out.append(RewardFunction(cls, fn, fn, {"CPU": 0.0}))
    return out


def with_environment_weights(weights: Sequence[float] | None, extra: int) -> list[float] | None:
    """The run's ``reward_weights`` with weight 1 for each environment's reward (None: all 1)."""
    return None if weights is None else [*weights, *([1.0] * extra)]
