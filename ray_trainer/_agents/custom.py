"""Training worker: a user's own rollout loop, TRL 1.16's ``rollout_func``, on the run's engines.

``rollout_func(prompts, engines) -> dict`` is TRL's contract with a handle on the run's rollout
engines in place of TRL's trainer: `prompts` are the step's prompts as the data holds them
(each of a row's ``num_generations`` in a row, as TRL repeats them), and the dict holds, one
entry per prompt, ``prompt_ids``, ``completion_ids`` and ``logprobs`` (the engine's, one per
completion token), optionally ``env_mask`` (1 on tokens the model sampled, 0 on tokens the loop
added: masked out of the loss) and ``truncated``; any other key is a column the reward
functions get by name. :class:`Engines` generates on the rank's engine with the run's sampling
(TRL's ``vllm_generation`` role); the loop may call it as often as it needs, with its own
prompts (a multi-turn loop builds each turn's input by concatenation).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ray_trainer._rollout.engine import SamplingParams
from ray_trainer._rollout.types import Completion, EpisodeRecord

#: What a ``rollout_func`` must return, one entry per prompt (TRL's required keys).
REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
#: Optional keys with a meaning here; the others are reward columns.
OPTIONAL = ("env_mask", "truncated")


class RolloutFuncError(ValueError):
    """A ``rollout_func`` returned what the step cannot train on (named, with the fix)."""


class Engines:
    """The handle a ``rollout_func`` gets: sampling on the rank's rollout engine (a Ray actor).

    Runs in the training worker, inside the step's rollout. ``generate`` samples `n`
    completions of each prompt (token ids) with the run's sampling (``grpo.temperature``,
    ``top_p``, ``top_k``; `max_tokens` defaults to ``grpo.max_completion_length``) and answers
    one dict per completion: ``prompt_ids``, ``completion_ids``, ``logprobs``, ``truncated``
    and ``version`` (the policy version that sampled it). ``tokenizer`` is the run's.
    """

    def __init__(self, engine: Any, params: SamplingParams, tokenizer: Any) -> None:
        self._engine = engine
        self._params = params
        self._calls = 0
        self.tokenizer = tokenizer
        self.versions: list[int] = []

    def generate(
        self,
        prompt_ids: list[list[int]],
        max_tokens: int | None = None,
        n: int = 1,
        temperature: float | None = None,
    ) -> list[dict[str, Any]]:
        """`n` completions of each of `prompt_ids`, grouped by prompt, as dicts."""
        params = replace(
            self._params, num_generations=n,
            max_completion_length=max_tokens or self._params.max_completion_length,
            temperature=temperature or self._params.temperature,
            seed=(self._params.seed + 104_729 * self._calls) % 2**31,
        )  # fmt: skip
        self._calls += 1
        out = self._engine.generate([list(p) for p in prompt_ids], params)
        self.versions += [c.version for c in out]
        return [
            {"prompt_ids": list(c.prompt_ids), "completion_ids": list(c.completion_ids),
             "logprobs": list(c.logprobs), "truncated": c.truncated, "version": c.version}
            for c in out
        ]  # fmt: skip


class CustomSampler:
    """A step's completions from the user's ``rollout_func`` (see the module docstring)."""

    def __init__(self, rollout_func: Callable[..., dict], tokenizer: Any) -> None:
        self.rollout_func = rollout_func
        self.tokenizer = tokenizer

    def sample(
        self, engine: Any, prompts: list[Any], rows: list[int], params: SamplingParams, key: str
    ) -> list[Completion]:
        """The completions of `rows` (`prompts[i]` is row `rows[i]`'s record), grouped by row."""
        g = params.num_generations
        handle = Engines(engine, params, self.tokenizer)
        asked = [p.prompt for p in prompts for _ in range(g)]
        out = self.rollout_func(asked, handle)
        checked = check_output(out, len(asked))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        version = min(handle.versions, default=0)
        completions = []
        for i in range(len(asked)):
            ids = [int(t) for t in checked["completion_ids"][i]]
            mask = checked.get("env_mask")
            extra = {k: v[i] for k, v in checked.items() if k not in (*REQUIRED, *OPTIONAL)}
            truncated = checked.get("truncated")
            completions.append(
                Completion(
                    prompt_index=rows[i // g],
                    prompt_ids=[int(t) for t in checked["prompt_ids"][i]],
                    completion_ids=ids,
                    logprobs=[float(x) for x in checked["logprobs"][i]],
                    truncated=bool(truncated[i]) if truncated else (not ids or ids[-1] != eos),
                    version=version,
                    env_mask=None if mask is None else [int(m) for m in mask[i]],
                    episode=EpisodeRecord(extra=extra) if extra else None,
                )
            )
        return completions


def check_output(out: Any, expected: int) -> dict[str, list]:
    """A ``rollout_func``'s answer checked: a dict with TRL's keys, one entry per prompt, a
    log-prob (and a mask entry) per completion token; a :class:`RolloutFuncError` names the
    key, the entry and the fix."""
    if not isinstance(out, dict):
        raise RolloutFuncError(
            f"rollout_func returned a {type(out).__name__}; return a dict with "
            f"{', '.join(REQUIRED)} (one list per prompt), as TRL's rollout_func does"
        )
    missing = [k for k in REQUIRED if k not in out]
    if missing:
        raise RolloutFuncError(
            f"rollout_func's answer has no {', '.join(missing)}; it must hold "
            f"{', '.join(REQUIRED)} (and may hold env_mask, truncated and reward columns)"
        )
    for k, v in out.items():
        if not isinstance(v, (list, tuple)) or len(v) != expected:
            raise RolloutFuncError(
                f"rollout_func's {k!r} has {len(v) if hasattr(v, '__len__') else 'no'} "
                f"entries for the step's {expected} prompts (its rows' prompts, each "
                "num_generations times); give one per prompt, in order"
            )
    for k in ("logprobs", "env_mask"):
        for i, (ids, vals) in enumerate(zip(out["completion_ids"], out.get(k) or [], strict=False)):
            if len(vals) != len(ids):
                raise RolloutFuncError(
                    f"rollout_func's {k}[{i}] has {len(vals)} entries for the {len(ids)} "
                    f"tokens of completion_ids[{i}]; give one per completion token"
                )
    return dict(out)
