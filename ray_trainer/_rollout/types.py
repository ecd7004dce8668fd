"""Anywhere (rollout actor, training workers, driver): the record of one sampled completion.

A rollout engine returns one `Completion` per completion it samples; the trainer builds its
batch, its rewards and its importance-sampling correction from them. The record is plain data
(ints, floats, lists) so that it crosses a process boundary through Ray's object store as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    """

    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    truncated: bool
    version: int
    newer_versions: list[tuple[int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"Completion of prompt {self.prompt_index}: {len(self.completion_ids)} tokens "
                f"but {len(self.logprobs)} log-probs; there must be one per token"
            )
