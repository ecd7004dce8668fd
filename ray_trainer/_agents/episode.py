"""Training worker: one multi-turn episode's tokens, built by concatenation (pure, no Ray).

An episode is one of a prompt's ``num_generations`` samples when the model may call tools: the
engine samples a turn, the turn is parsed (transformers' ``parse_response``), its tool calls
run in an environment actor, their results are rendered with the chat template, and the engine
samples the next turn after them, up to ``grpo.max_tool_calling_iterations`` times.

The episode's ids are never re-tokenized: they are the prompt's ids, then each turn's sampled
ids as the engine returned them, then each tool result's ids as the template renders a tool
message after an assistant turn (:func:`tool_suffix_ids`, as TRL 1.16's
``_get_tool_suffix_ids``). ``env_mask`` is 1 on sampled tokens and 0 on tool-result tokens (the
loss, the log-prob ratio and the KL skip them); each sampled token keeps the engine's log-prob
(0.0 under the mask). Each turn's input must come back from the engine as the exact ids sent
(``prefix_mismatch`` counts the turns that did not). ``max_completion_length`` bounds the
tokens after the prompt, tool results included: a tool result that would pass it is dropped and
the episode ends there, as in TRL.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray_trainer._rollout.types import Completion, EpisodeRecord


def parse_turn(
    tokenizer: Any, template: dict, ids: list[int], prefix: list[int], tools: list[dict]
) -> dict:
    """A sampled turn as an assistant message (``content``, ``tool_calls`` in TRL's shape),
    parsed by transformers' response parsing with `template`; text that does not parse (a
    malformed call) is the message's content, as TRL falls back to."""
    try:
        parsed = tokenizer.parse_response(ids, template, prefix=prefix, tools=tools or None)
        if not isinstance(parsed, dict):
            raise ValueError("no message parsed")
        calls = parsed.get("tool_calls")
        if calls is not None:
            _check_calls(calls)
    except (ValueError, TypeError, KeyError):
        return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}
    eos = getattr(tokenizer, "eos_token", None)
    content = parsed.get("content") or ""
    if eos and isinstance(content, str):
        content = content.removesuffix(eos)
    return {**parsed, "role": "assistant", "content": content}


def _check_calls(calls: Any) -> None:
    if not isinstance(calls, list):
        raise ValueError("tool_calls is not a list")
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError("a tool call without a name")
        if function.get("arguments") is None:
            function["arguments"] = {}
        if not isinstance(function["arguments"], dict):
            raise ValueError("a tool call whose arguments are not an object")


def tool_suffix_ids(
    tokenizer: Any,
    template: str,
    tool_messages: list[dict],
    eos_id: int | None,
    heads: dict[str, list[int]] | None = None,
) -> list[int]:
    """The ids the chat template writes for `tool_messages` after an assistant turn that ended
    with its end-of-turn token, through the next assistant header: the rendering of a short
    conversation with them, minus its rendering without them (cut after its last `eos_id`,
    where a sampled turn stops). `heads` keeps the rendering without them by tool name (the
    same for every episode of a run: one template rendering per tool result, not two)."""
    name = tool_messages[0]["name"]
    calls = [{"type": "function", "function": {"name": name, "arguments": {}}}]
    head = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    before = None if heads is None else heads.get(name)
    if before is None:
        before = _ids(tokenizer.apply_chat_template(head, chat_template=template, tokenize=True))
        if heads is not None:
            heads[name] = before
    after = _ids(
        tokenizer.apply_chat_template(
            head + tool_messages, chat_template=template, tokenize=True,
            add_generation_prompt=True,
        )
    )  # fmt: skip
    ends = [i for i, t in enumerate(before) if t == eos_id]
    if ends:
        before = before[: ends[-1] + 1]
    if after[: len(before)] != before:
        raise ValueError(
            "the chat template renders an assistant turn differently once a tool result "
            "follows it; its tool results cannot be appended by concatenation"
        )
    return after[len(before) :]


def _ids(out: Any) -> list[int]:
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(t) for t in ids]


def tool_content(result: Any) -> str:
    """A tool's result as the tool message's content (TRL's ``str(result)``)."""
    return result if isinstance(result, str) else str(result)


@dataclass
class Episode:
    """One episode in progress (see the module docstring).

    Attributes:
        key: unique in the run (step, rank, row, sample, try): the environment instance's key.
        prompt_index: the data row (the prompt ledger's position).
        environment: its environment's name (None: the only one, or none).
        prompt_ids: the prompt's ids, rendered with the episode's tools.
        tools: the JSON schemas of its tools (for parsing typed arguments).
        row: the data row's fields (``reset(**row)``).
    """

    key: str
    prompt_index: int
    environment: str | None
    prompt_ids: list[int]
    tools: list[dict] = field(default_factory=list)
    row: dict = field(default_factory=dict)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (position, version)
    turns: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    prefix_mismatch: int = 0
    truncated: bool = False
    done: bool = False
    env_seconds: float = 0.0
    pending: list[dict] = field(default_factory=list)  # the last turn's tool calls to run
    base_ids: list[int] = field(default_factory=list)  # the prompt's ids before reset's text
    restarts: int = 0  # fresh starts after faults before this one
    ending: tuple[float | None, bytes | None] = (None, None)  # get_reward, the instance

    def __post_init__(self) -> None:
        if not self.base_ids:
            self.base_ids = list(self.prompt_ids)

    @property
    def input_ids(self) -> list[int]:
        """What the next turn is sampled after: the prompt, then everything so far."""
        return self.prompt_ids + self.completion_ids

    def room(self, max_completion_length: int) -> int:
        """How many tokens the next turn may sample."""
        return max_completion_length - len(self.completion_ids)

    def add_turn(
        self,
        sent: list[int],
        completion: Completion,
        message: dict,
        max_iterations: int | None,
    ) -> None:
        """A turn the engine sampled after `sent` (the ids it was given), parsed as
        `message`; its tool calls are `pending` when the episode goes on (the turn ended with
        an end token, and tool turns are left)."""
        if list(completion.prompt_ids) != sent:
            self.prefix_mismatch += 1
        at = len(self.completion_ids)
        if not self.versions or self.versions[-1][1] != completion.version:
            self.versions.append((at, completion.version))
        for pos, version in completion.newer_versions:
            self.versions.append((at + pos, version))
        self.completion_ids += list(completion.completion_ids)
        self.logprobs += list(completion.logprobs)
        self.env_mask += [1] * len(completion.completion_ids)
        self.messages.append(message)
        self.turns += 1
        self.truncated = completion.truncated
        calls = message.get("tool_calls") or []
        left = max_iterations is None or self.turns <= max_iterations
        if calls and left and not completion.truncated and completion.completion_ids:
            self.pending = list(calls)
        else:
            self.pending, self.done = [], True

    def add_results(
        self, results: list[tuple[str, Any, bool]], suffix: list[int], max_completion_length: int
    ) -> bool:
        """The tool results of the pending calls (``(name, result, failed)``), rendered as
        `suffix`: appended, masked out of the loss; False (and the episode done, nothing
        appended) when they would pass ``max_completion_length``."""
        self.pending = []
        self.tool_calls += len(results)
        self.tool_failures += sum(1 for _, _, failed in results if failed)
        if len(self.completion_ids) + len(suffix) > max_completion_length:
            self.done = True
            return False
        self.messages += tool_messages(results)
        self.completion_ids += suffix
        self.logprobs += [0.0] * len(suffix)
        self.env_mask += [0] * len(suffix)
        return True

    def completion(self, reward: float | None = None, snapshot: bytes | None = None) -> Completion:
        """The finished episode as the trainer takes a completion."""
        first = self.versions[0][1] if self.versions else 0
        record = EpisodeRecord(
            messages=self.messages, turns=self.turns, tool_calls=self.tool_calls,
            tool_failures=self.tool_failures, prefix_mismatch=self.prefix_mismatch,
            env_seconds=self.env_seconds, restarts=self.restarts, environment=self.environment,
            env_reward=reward, snapshot=snapshot,
        )  # fmt: skip
        return Completion(
            prompt_index=self.prompt_index, prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.completion_ids), logprobs=list(self.logprobs),
            truncated=self.truncated, version=first, newer_versions=list(self.versions[1:]),
            env_mask=list(self.env_mask), episode=record,
        )  # fmt: skip


def tool_messages(results: list[tuple[str, Any, bool]]) -> list[dict]:
    """The ``tool`` messages of a turn's results (TRL's shape)."""
    return [{"role": "tool", "name": name, "content": tool_content(r)} for name, r, _ in results]
