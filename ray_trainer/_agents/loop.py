"""Training worker: a step's multi-turn episodes, sampled on the rank's engine with tools on Ray.

:class:`AgentSampler` takes the place of one ``engine.generate`` call when a GRPO run has
``tools`` or an ``environment_factory``. Each of a prompt's ``num_generations`` samples is an
:class:`~ray_trainer._agents.episode.Episode` with an environment instance of its own (in the
run's environment actors, ``environments.EnvironmentPool``). The episodes of the step run at
once: the episodes ready to sample go into the engine's next request together (one request in
flight: those that become ready while it runs join the next one), and the tool calls of the
others run meanwhile in the environment actors, so an episode waiting on a slow tool holds back
no other episode's generation (it joins a later request).

A tool that raises is the model's outcome: its error is the tool's result. An environment actor
that dies, or a call past ``tool_timeout_s``, is an infrastructure fault: the episode starts
again from its beginning on a fresh instance (a new key), at most ``tries`` times; after that
the step fails naming the environment, the row and the cause. A faulted episode is never
scored: only finished episodes become completions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ray_trainer._agents.environments import EnvironmentFault
from ray_trainer._agents.episode import Episode, parse_turn, tool_messages, tool_suffix_ids
from ray_trainer._agents.tools import ENVIRONMENT_FIELD, AgentTools
from ray_trainer._rollout.engine import SamplingParams
from ray_trainer._rollout.types import Completion


class EpisodeFailed(RuntimeError):
    """An episode's environment faulted more times than allowed: the step fails."""


class AgentSampler:
    """One rank's multi-turn sampling (see the module docstring).

    Args:
        agent: the run's tools and environments (``tools.resolve_agent_tools``).
        tokenizer: the run's tokenizer (renders prompts and tool results, parses turns).
        chat_template: the run's chat template (Jinja text).
        response_template: how a turn parses (``tools.check_tool_template``).
        pool: the run's environment actors as this rank sees them.
        max_iterations: ``grpo.max_tool_calling_iterations`` (None: no limit but the length).
        tries: how many times an episode may start on a fresh instance after faults.
        wait: ``ray.wait``-like: the ready references of those given (at least one, unless
            the timeout passes first: then maybe none).
    """

    def __init__(
        self,
        agent: AgentTools,
        tokenizer: Any,
        chat_template: str,
        response_template: dict,
        pool: Any,
        max_iterations: int | None = None,
        tries: int = 3,
        wait: Callable[[list[Any], float | None], list[Any]] | None = None,
    ) -> None:
        self.agent = agent
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.response_template = response_template
        self.pool = pool
        self.max_iterations = max_iterations
        self.tries = tries
        self.wait = wait or _ray_wait
        self.timeout_s = float(getattr(getattr(pool, "spec", None), "timeout_s", 60.0))
        self.eos_id = getattr(tokenizer, "eos_token_id", None)
        #: Episodes started again after an infrastructure fault (this rank, the run so far).
        self.restarts = 0
        self._max_len = 0  # the step's max_completion_length
        self._heads: dict[str, list[int]] = {}  # the template's turn before a tool result

    # ---- one step --------------------------------------------------------------------------

    def sample(
        self,
        engine: Any,
        prompts: list[Any],
        rows: list[int],
        params: SamplingParams,
        key: str,
    ) -> list[Completion]:
        """The episodes of `rows` (`prompts[i]` is row `rows[i]`'s record: ``prompt_ids``,
        ``prompt``, ``columns``), ``params.num_generations`` each, sampled on `engine`
        (``RemoteEngine``: ``submit``/``result``); `key` makes their instances' keys unique
        in the run. One `Completion` per episode, grouped by prompt in the rows' order."""
        episodes = [
            self._new(prompt, row, f"{key}:{row}:{g}")
            for prompt, row in zip(prompts, rows, strict=True)
            for g in range(params.num_generations)
        ]
        try:
            return self._run(engine, episodes, params)
        except BaseException:
            for ep in episodes:  # their instances are not needed any more
                self.pool.drop(ep.key)
            raise

    def _run(
        self, engine: Any, episodes: list[Episode], params: SamplingParams
    ) -> list[Completion]:
        self._max_len = params.max_completion_length
        tries = {ep.key: 0 for ep in episodes}
        slot_of = {ep.key: i for i, ep in enumerate(episodes)}
        inflight: dict[Any, tuple[str, Any]] = {}  # ref -> (what, episode or episodes)
        sent: dict[Any, float] = {}  # an environment call's ref -> when it was sent
        for ep in episodes:
            inflight[self.pool.open(ep.key, ep.environment, ep.row)] = ("open", ep)
        ready: list[Episode] = []
        wave = 0
        while inflight or ready:
            # One request at a time: the engine answers its requests one after another, so the
            # episodes ready meanwhile wait for it together and go in one batch, not several.
            busy = any(what == "turn" for what, _ in inflight.values())
            if ready and not busy:  # each episode's turn cut to its own room after, as TRL
                room = max(ep.room(params.max_completion_length) for ep in ready)
                turn = replace(
                    params, num_generations=1, max_completion_length=room,
                    seed=(params.seed + 7919 * wave) % 2**31,
                )  # fmt: skip
                ref = engine.submit(
                    [ep.input_ids for ep in ready], turn, [ep.prompt_index for ep in ready]
                )
                inflight[ref] = ("turn", [(ep, ep.input_ids) for ep in ready])
                ready, wave = [], wave + 1
            for ref in self._ready(inflight, sent):
                what, held = inflight.pop(ref)
                if what == "turn":
                    self._turns(engine, ref, held, inflight)
                    continue
                ep = held
                if ep.key not in slot_of:  # an episode abandoned after a fault
                    continue
                asked = sent.pop(ref)
                left = max(0.0, asked + self.timeout_s - time.monotonic())
                try:
                    value = self.pool.get(ref, ep.key, left)
                    ep.env_seconds += time.monotonic() - asked
                except (EnvironmentFault, LookupError) as fault:
                    # Its actor died, a call ran past tool_timeout_s, or its instance went with
                    # an actor another episode's fault replaced (LookupError): never scored.
                    fresh = self._restart(ep, fault, tries, slot_of, episodes)
                    inflight[self.pool.open(fresh.key, fresh.environment, fresh.row)] = (
                        "open", fresh,
                    )  # fmt: skip
                    continue
                if what == "finish":
                    ep.ending = value
                elif what == "open":
                    self._opened(ep, value)
                    ready.append(ep)
                elif self._results(ep, value, params.max_completion_length):
                    ready.append(ep)
                else:
                    self._close(ep, inflight)
            ready = [ep for ep in ready if not ep.done]
        return [ep.completion(*ep.ending) for ep in episodes]

    def _ready(self, inflight: dict, sent: dict) -> list[Any]:
        """The references answered (at least one), or the environment calls past
        ``tool_timeout_s`` (their ``get`` ends them as faults): nothing waits longer than the
        oldest call's deadline. `sent` gains the environment calls sent since (when)."""
        now = time.monotonic()
        for ref, (what, _) in inflight.items():
            if what != "turn" and ref not in sent:
                sent[ref] = now
        deadline = min(sent.values(), default=None)
        timeout = None if deadline is None else max(0.0, deadline + self.timeout_s - now)
        ready = self.wait(list(inflight), timeout)
        late = time.monotonic() - self.timeout_s
        return ready + [r for r, t in sent.items() if t <= late and r not in ready]

    def _turns(
        self, engine: Any, ref: Any, held: list[tuple[Episode, list[int]]], inflight: dict
    ) -> None:
        """A request's turns added to their episodes; those whose tools now run are sent to
        their environments, those done to be finished."""
        completions, _, _ = engine.result(ref)
        for (ep, sent), sampled in zip(held, completions, strict=True):
            completion = cut(sampled, ep.room(self._max_len))
            message = parse_turn(
                self.tokenizer, self.response_template, list(completion.completion_ids), sent,
                ep.tools,
            )  # fmt: skip
            ep.add_turn(sent, completion, message, self.max_iterations)
            if ep.pending:
                inflight[self.pool.call(ep.key, ep.pending)] = ("call", ep)
            else:
                self._close(ep, inflight)

    def _close(self, ep: Episode, inflight: dict) -> None:
        """The episode is done sampling: its environment answers ``get_reward`` and gives its
        instance back (what reward functions get as ``environments``); a fault meanwhile
        starts the episode again, as any other."""
        ep.done = True
        inflight[self.pool.finish(ep.key)] = ("finish", ep)

    def _opened(self, ep: Episode, observation: Any) -> None:
        """The instance's ``reset`` answered: its text joins the prompt's last user message
        (the prompt rendered again with it, as TRL does); None keeps the prompt's ids."""
        if observation is None:
            return
        if not isinstance(observation, str):
            raise EpisodeFailed(
                f"environment {ep.environment or 'environment_factory'}: reset() returned a "
                f"{type(observation).__name__} for row {ep.prompt_index}; return a str "
                "(appended to the last user message) or None"
            )
        messages = list(ep.row.get("prompt") or [])
        last = messages[-1]
        messages[-1] = {**last, "content": (last.get("content") or "") + observation}
        ep.prompt_ids = self._render(messages, ep.tools)

    def _results(self, ep: Episode, results: list, max_completion_length: int) -> bool:
        """The pending calls' results appended (rendered by the template); whether the
        episode samples again."""
        suffix = tool_suffix_ids(
            self.tokenizer,
            self.chat_template,
            tool_messages(results),
            self.eos_id,
            self._heads,
        )
        appended = ep.add_results(results, suffix, max_completion_length)
        if appended and ep.room(max_completion_length) <= 0:
            ep.done = True
        return appended and not ep.done

    def _restart(
        self,
        ep: Episode,
        fault: Exception,
        tries: dict[str, int],
        slot_of: dict[str, int],
        episodes: list[Episode],
    ) -> Episode:
        """The episode faulted: a fresh one in its place (a new key, a new instance), or the
        step fails once it has used its tries."""
        count = tries.pop(ep.key) + 1
        slot = slot_of.pop(ep.key)
        self.pool.drop(ep.key)
        if count > self.tries:
            raise EpisodeFailed(
                f"environment {ep.environment or _env_label(self.agent)}: the episode of row "
                f"{ep.prompt_index} faulted {count} times (its actor died or a call ran past "
                f"tool_timeout_s); last: {fault}. Check the environment's tools and "
                "environment_resources, or raise tool_timeout_s"
            )
        self.restarts += 1
        base = ep.key.rsplit("#", 1)[0]
        fresh = self._new_like(ep, f"{base}#{count}")
        fresh.restarts = count
        tries[fresh.key], slot_of[fresh.key] = count, slot
        episodes[slot] = fresh
        return fresh

    # ---- episodes ----------------------------------------------------------------------

    def _new(self, prompt: Any, row: int, key: str) -> Episode:
        columns = dict(getattr(prompt, "columns", {}) or {})
        fields = {"prompt": prompt.prompt, **columns}
        environment = self.agent.environment_of(fields, f"data row {row}")
        if self.agent.multi:
            fields.pop(ENVIRONMENT_FIELD, None)
        return Episode(
            key=key, prompt_index=row, environment=environment,
            prompt_ids=list(prompt.prompt_ids), tools=self.agent.schemas_of(environment),
            row=fields,
        )  # fmt: skip

    def _new_like(self, ep: Episode, key: str) -> Episode:
        return Episode(
            key=key, prompt_index=ep.prompt_index, environment=ep.environment,
            prompt_ids=list(ep.base_ids), tools=ep.tools, row=ep.row,
        )  # fmt: skip

    def _render(self, messages: list[dict], tools: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            messages, chat_template=self.chat_template, tools=tools or None, tokenize=True,
            add_generation_prompt=True,
        )  # fmt: skip
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]


def _env_label(agent: AgentTools) -> str:
    return "of the tools" if not agent.factories else "environment_factory"


def cut(completion: Completion, room: int) -> Completion:
    """A turn sampled with more room than its episode has left, cut to `room` tokens (and then
    truncated, unless it ended right there), as TRL cuts a turn after a tool result."""
    if len(completion.completion_ids) <= room:
        return completion
    return replace(
        completion, completion_ids=list(completion.completion_ids[:room]),
        logprobs=list(completion.logprobs[:room]), truncated=True,
        newer_versions=[(p, v) for p, v in completion.newer_versions if p < room],
    )  # fmt: skip


def _ray_wait(refs: list[Any], timeout: float | None) -> list[Any]:
    import ray

    ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
    if rest:  # the others answered meanwhile, without waiting
        more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
        ready += more
    return ready
