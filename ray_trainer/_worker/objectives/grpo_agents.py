"""Training worker: how a GRPO step samples, one turn per completion or multi-turn episodes.

Runs in each training worker. :class:`Sampling` is what ``GrpoObjective`` asks for a rank's
completions of a step: without tools, one ``generate`` request to the rank's engine; with
``tools`` or ``environment_factory``, the episodes of ``_agents/loop.py`` on the same engine,
their environments in the run's environment actors (``_agents/environments.py``: a pool that
every rank of a worker-group start shares by name, ended with the run); with ``rollout_func``,
the user's own loop on the engine (``_agents/custom.py``).
"""

from __future__ import annotations

from typing import Any

from ray_trainer._agents.rewards import environment_reward_fns, with_environment_weights
from ray_trainer._agents.tools import AgentTools, resolve_agent_tools
from ray_trainer._rollout.engine import SamplingParams
from ray_trainer._rollout.rewards import RewardFunction


class Sampling:
    """A run's sampling of completions on one rank (see the module docstring)."""

    def __init__(self, args: Any, config: Any) -> None:
        self.args = args
        self.config = config
        self.agent: AgentTools | None = resolve_agent_tools(args.tools, args.environment_factory)
        self.sampler: Any = None

    @property
    def agents(self) -> bool:
        return self.agent is not None

    def reward_fns(self, fns: list[RewardFunction]) -> list[RewardFunction]:
        """The run's reward functions and its environments' own (``get_reward``)."""
        return [*fns, *environment_reward_fns(self.agent)]

    def reward_weights(self) -> list[float] | None:
        """``reward_weights`` with weight 1 for each environment's own reward."""
        extra = len(environment_reward_fns(self.agent))
        return with_environment_weights(self.args.reward_weights, extra)

    def start(self, s: Any) -> None:
        """Once per worker-group start (every rank): the user's ``rollout_func``, or the
        environment actors' pool, found by name (the first rank to ask creates them)."""
        if self.sampler is not None:
            return
        if self.args.rollout_func is not None:
            from ray_trainer._agents.custom import CustomSampler
            from ray_trainer._named import import_named

            fn = import_named(self.args.rollout_func, "rollout_func", "my_loop:rollout",
                              "a function (prompts, engines) -> dict")  # fmt: skip
            self.sampler = CustomSampler(fn, s.workload.tokenizer)
            return
        if self.agent is None:
            return
        from ray_trainer._agents.environments import EnvironmentPool, EnvironmentSpec
        from ray_trainer._agents.loop import AgentSampler
        from ray_trainer._agents.tools import run_template

        a = self.args
        template, response = run_template(s.workload.tokenizer, a.chat_template)
        spec = EnvironmentSpec(
            factories=self.agent.factories, tools=self.agent.tools, workers=a.environment_workers,
            resources=a.environment_resources, timeout_s=a.tool_timeout_s,
        )  # fmt: skip
        name = f"{s.spec.actor_name}:env:{s.ctx.attempt}"
        pool = EnvironmentPool(spec, name=name, namespace=s.spec.actor_namespace)
        self.sampler = AgentSampler(
            self.agent, s.workload.tokenizer, template, response, pool,
            self.config.max_tool_calling_iterations,
        )  # fmt: skip

    def sample(
        self, engine: Any, prompts: Any, rows: list[int], params: SamplingParams, key: str
    ) -> list[Any]:
        """This rank's completions of `rows` (`prompts`: the run's encoded prompts) on
        `engine`; `key` is unique to the step, rank and try (the episodes' instances' keys)."""
        if self.sampler is None:
            return engine.generate([prompts[r].prompt_ids for r in rows], params, rows)
        return self.sampler.sample(engine, [prompts[r] for r in rows], rows, params, key)

    def close(self) -> None:
        """The environment actors this rank created, ended."""
        pool = getattr(self.sampler, "pool", None)
        if pool is not None:
            pool.close()
