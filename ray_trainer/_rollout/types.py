"""Anywhere (rollout actor, training workers, driver): the record of one sampled completion.

A rollout engine returns one `Completion` per completion it samples; the trainer builds its
batch, its rewards and its importance-sampling correction from them. The record is plain data
(ints, floats, lists) so that it crosses a process boundary through Ray's object store as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EpisodeRecord:
    """What a multi-turn episode adds to its `Completion` (``ray_trainer/_agents``).

    Attributes:
        messages: the completion as messages, TRL's ``completions`` of a tool-calling run:
            each assistant turn (with its ``tool_calls``) and each ``tool`` result.
        turns: the assistant turns sampled.
        tool_calls, tool_failures: the tools called, and those that raised (the model's
            outcome: their error went back to it as the result).
        prefix_mismatch: turns whose input did not come back from the engine as sent.
        env_seconds: the time spent waiting for its environment's calls.
        restarts: how many times it started again on a fresh instance after a fault.
        environment: its environment's name (None: the only one, or none).
        env_reward: its environment's ``get_reward()`` (None: it defines none).
        snapshot: the environment instance when the episode ended (cloudpickled; None when it
            cannot be pickled): what reward functions get as ``environments``.
        extra: a ``rollout_func``'s other keys for this completion: reward columns by name.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 1
    tool_calls: int = 0
    tool_failures: int = 0
    prefix_mismatch: int = 0
    env_seconds: float = 0.0
    restarts: int = 0
    environment: str | None = None
    env_reward: float | None = None
    snapshot: bytes | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Completion:
    """One completion sampled by a rollout engine for one prompt.

    Attributes:
        prompt_index: which prompt it answers: the caller's index for it (the prompt ledger's
            position in a run), the same for the prompt's ``num_generations`` completions.
        prompt_ids: the prompt's token ids, as given to the engine.
        completion_ids: the sampled token ids, up to and including the first end-of-sequence
            token (none when `truncated`).
        logprobs: one per completion token: the engine's log-probability of that token under
            the sampling temperature, ``log_softmax(logits / temperature)`` at the token, as
            TRL 1.16's ``GRPOTrainer`` computes its per-token log-probs (top-p and top-k
            shape the sampling, not these numbers).
        truncated: ``max_completion_length`` tokens were sampled without an end-of-sequence
            token.
        version: the policy version of the weights that sampled it (0: the engine's first
            weights; each weight sync sets the version it was given); where weights changed
            while it was sampled, the version of its first token (its oldest).
        newer_versions: ``(position, version)`` for each change of weights while it was sampled
            (the ``"vllm"`` engine takes weights posted during a request between two decoding
            steps): from token ``position`` on, ``version``'s weights sampled it. Empty: one
            version sampled it all. Its `logprobs` are the sampling weights' own, token by token.
        env_mask: a multi-turn episode's: 1 on each sampled token, 0 on each tool-result token
            (no loss, no ratio, no KL there; its log-prob is 0.0); None: every token sampled.
        episode: a multi-turn episode's messages and counts (`EpisodeRecord`); None: one turn.
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool
    version: int
    newer_versions: list[tuple[int, int]] = field(default_factory=list)
    env_mask: list[int] | None = None
    episode: EpisodeRecord | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Completion of prompt {self.prompt_index}: {len(self.completion_ids)} tokens "
                f"but {len(self.logprobs)} log-probs; there must be one per token"
            )
        if self.env_mask is not None and len(self.env_mask) != len(self.completion_ids):
            raise ValueError(
                f"Completion of prompt {self.prompt_index}: {len(self.completion_ids)} tokens "
                f"but {len(self.env_mask)} env_mask entries; there must be one per token"
            )
