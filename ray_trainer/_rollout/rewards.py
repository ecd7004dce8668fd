"""Driver and reward tasks: GRPO's reward functions, their rewards and the advantages.

Runs where a step's completions are scored: the process that drives the rollouts (it resolves
the functions and combines their rewards) and the Ray tasks that call them, one task per
function per step, in parallel (:func:`score_on_ray`). In the order a step uses them:

- :func:`resolve_reward_fns`: ``reward_fns`` (callables with TRL 1.16's signature
  ``fn(prompts, completions, completion_ids, **columns) -> list[float | None]``, or
  ``"module:function"`` strings for YAML configs) checked before Ray starts: each importable,
  callable, named once, taking the data's columns;
- :func:`call_reward`: one function on one step's :class:`RewardBatch`, as TRL calls it
  (keyword arguments; ``None`` becomes NaN; what it returned checked by ``reward_checks.py``:
  ``inf`` is refused). A function that raises fails with a :class:`RewardError` that names
  it, the row (found by calling it again row by row) and the traceback, and ends with one line
  of all three;
- :func:`combine_rewards`: the weighted sum over functions, NaN-aware as TRL's (a completion
  every function returned None for is unscorable: NaN, and advantage 0);
- :func:`group_advantages`: group-relative advantages (``scale_rewards`` group, batch or none);
  a group of equal rewards gets 0, never NaN;
- :func:`reward_metrics`, :func:`completion_metrics`: TRL's names for the step's logs;
- :func:`score_on_ray`: the functions as Ray tasks, waited for within ``reward_timeout_s``
  and stopped by a stop from outside (``reward_wait.py``);
- :func:`score_step`: all of it for one step's ``Completion`` records (the rollout engines'
  records, ``types.py`` beside this module: ``prompt_index``, ``completion_ids``,
  ``truncated``... read by attribute), grouped by prompt.

Tensors are torch on the CPU; nothing here needs a GPU, and only :func:`score_on_ray` needs Ray.
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_trainer._errors import TrainingArgsError
from ray_trainer._named import import_named
from ray_trainer._rollout.reward_checks import (
    RewardError,
    checked_rewards,
    last_line,
    prompts_of,
    raised_summary,
)
from ray_trainer._rollout.reward_wait import wait_for_rewards

#: The keyword arguments TRL passes besides the data's columns; a column of one of these names
#: would be shadowed, so it is refused.
RESERVED = ("prompts", "completions", "completion_ids", "trainer_state")
#: A reward function's Ray task asks for this unless told otherwise.
DEFAULT_RESOURCES: dict[str, float] = {"CPU": 1.0}


@dataclass(frozen=True)
class RewardFunction:
    """One resolved reward function: ``name`` (its metrics are ``rewards/<name>/...``), the
    callable, what the user gave (``spec``: the callable or its ``"module:function"`` string)
    and the resources of its Ray task."""

    name: str
    fn: Callable[..., Any]
    spec: Any
    resources: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RESOURCES))


@dataclass(frozen=True)
class RewardState:
    """What TRL passes reward functions as ``trainer_state`` that they use to shape rewards
    over training: the optimizer step the completions are for, and the run's last step."""

    global_step: int = 0
    max_steps: int | None = None


@dataclass(frozen=True)
class RewardBatch:
    """One step's completions as reward functions see them, one entry per completion (the
    ``num_generations`` completions of a prompt are consecutive): ``prompts`` (the record's
    prompt: a string or a list of messages), ``completions`` (decoded: a string, or
    ``[{"role": "assistant", "content": ...}]`` for a conversational prompt, as TRL),
    ``completion_ids``, the data's other ``columns`` by name (each a list, repeated per
    completion) and each completion's ``prompt_index`` (its prompt's ledger position)."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    prompt_index: list[int] | None = None

    def __len__(self) -> int:
        return len(self.completions)

    def row(self, i: int) -> RewardBatch:
        """The batch of completion ``i`` alone (to find the row a function fails on)."""
        return RewardBatch(
            [self.prompts[i]],
            [self.completions[i]],
            [self.completion_ids[i]],
            {k: [v[i]] for k, v in self.columns.items()},
            None if self.prompt_index is None else [self.prompt_index[i]],
        )

    def where(self, i: int) -> str:
        """How an error names completion ``i``."""
        at = f"row {i} of the step's {len(self)} completions"
        if self.prompt_index is not None:
            at += f" (prompt {self.prompt_index[i]} of the data)"
        return at


# -- resolving ------------------------------------------------------------------------------------


def resolve_reward_fns(
    reward_fns: Any,
    resources: dict[str, dict[str, float]] | None = None,
    columns: Sequence[str] = (),
) -> list[RewardFunction]:
    """The run's reward functions, checked (the driver, before Ray starts).

    ``reward_fns`` is a callable, a ``"module:function"`` string, or a list of them;
    ``resources`` (``TrainingArgs.reward_resources``) gives the functions' Ray tasks their
    resources: one dict of Ray resources for every function's task (``{"CPU": 0.5}``,
    ``{"GPU": 1}``), or a dict of such dicts keyed by function name (a function not named
    keeps :data:`DEFAULT_RESOURCES`, as every function does when it is None); ``columns`` are the data's columns besides
    ``prompt``, which each function must accept (as parameters, or ``**kwargs`` as TRL's do).

    Raises:
        TrainingArgsError: no function, a string that does not import or names no callable,
            two functions of one name, resources for a function that is not there, a column
            a function cannot take. The message names the function and the fix.
    """
    items = reward_fns if isinstance(reward_fns, (list, tuple)) else [reward_fns]
    if reward_fns is None or not items:
        raise TrainingArgsError(
            "reward_fns: GRPO needs at least one reward function, e.g. reward_fns=[my_reward] "
            "with def my_reward(prompts, completions, completion_ids, **kwargs) -> list[float]"
        )
    out: list[RewardFunction] = []
    resources = dict(resources or {})
    shared = DEFAULT_RESOURCES
    if resources and not any(isinstance(v, dict) for v in resources.values()):
        shared, resources = resources, {}  # one resource dict for every function's task
    for i, spec in enumerate(items):
        fn = _resolve(spec, i)
        name = getattr(fn, "__name__", None) or type(fn).__name__
        taken = [f for f in out if f.name == name]
        if taken:
            raise TrainingArgsError(
                f"reward_fns[{i}]: a second reward function named {name!r} (its metrics "
                f"rewards/{name}/... would mix with reward_fns[{out.index(taken[0])}]'s); give "
                "each function its own name"
            )
        _check_signature(fn, name, i, columns)
        res = _check_resources(resources.pop(name, shared), name)
        out.append(RewardFunction(name, fn, spec, res))
    if resources:
        raise TrainingArgsError(
            f"reward_resources names {', '.join(map(repr, resources))}, not a reward function "
            f"(they are {', '.join(repr(f.name) for f in out)}); key it by a function's name"
        )
    return out


def _resolve(spec: Any, i: int) -> Callable[..., Any]:
    return import_named(
        spec, f"reward_fns[{i}]", "my_rewards:exact_match",
        "a function that takes (prompts, completions, completion_ids, **kwargs)",
    )  # fmt: skip


def _check_signature(fn: Any, name: str, i: int, columns: Sequence[str]) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return  # a builtin or C callable: it is called as it is
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    shadowed = [c for c in columns if c in RESERVED]
    if shadowed:
        raise TrainingArgsError(
            f"data: a column named {shadowed[0]!r} would shadow the reward functions' own "
            f"argument of that name ({', '.join(RESERVED)}); rename the column"
        )
    needed = [n for n in (*RESERVED, *columns) if n not in params]
    if needed and not var_kw:
        raise TrainingArgsError(
            f"reward_fns[{i}] {name!r} cannot take {', '.join(map(repr, needed))}: reward "
            "functions are called as fn(prompts=..., completions=..., completion_ids=..., "
            "**columns), the data's other columns by name; add **kwargs to its parameters"
        )


def _check_resources(value: Any, name: str) -> dict[str, float]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
        and v >= 0
        for k, v in value.items()
    ):
        raise TrainingArgsError(
            f"reward_resources for {name!r}: got {value!r}; give a dict of Ray resources for "
            "every function's task, e.g. {'CPU': 0.5} or {'GPU': 1} for a reward model, or "
            "such a dict per function name, e.g. {'my_reward': {'GPU': 1}}"
        )
    return {k: float(v) for k, v in value.items()}


def task_options(fn: RewardFunction) -> dict[str, Any]:
    """Ray's task options for `fn`'s reward task: its resources (``CPU`` and ``GPU`` as
    ``num_cpus`` and ``num_gpus``, 0 when absent; the others as custom resources), no retry
    (a failed reward fails the step), and a name that shows in Ray's dashboard."""
    return {
        "num_cpus": fn.resources.get("CPU", 0.0),
        "num_gpus": fn.resources.get("GPU", 0.0),
        "resources": {k: v for k, v in fn.resources.items() if k not in ("CPU", "GPU")},
        "max_retries": 0,
        "name": f"reward:{fn.name}",
    }


def task_resources(fns: Sequence[RewardFunction]) -> dict[str, float]:
    """What one reward task may need at most (each resource's largest over the functions):
    what the driver's fit check keeps free beside the workers."""
    out: dict[str, float] = {}
    for fn in fns:
        for k, v in fn.resources.items():
            out[k] = max(out.get(k, 0.0), v)
    return out


# -- calling --------------------------------------------------------------------------------------


def call_reward(
    fn: RewardFunction, batch: RewardBatch, state: RewardState | None = None
) -> list[float]:
    """``fn``'s reward of each completion of ``batch`` (``None`` -> NaN), called as TRL calls
    it. Runs in a reward task (or in the process that drives the rollouts).

    Raises:
        RewardError: the function raised (naming the row it raises on, when one alone does,
            with its traceback), or returned anything but one finite number, None or NaN per
            completion (``reward_checks.checked_rewards``).
    """
    state = state or RewardState()
    try:
        out = _call(fn, batch, state)
    except Exception:
        raise RewardError(_failure(fn, batch, state, traceback.format_exc())) from None
    return checked_rewards(fn.name, out, len(batch), batch.where)


def _call(fn: RewardFunction, batch: RewardBatch, state: RewardState) -> Any:
    return fn.fn(
        prompts=batch.prompts,
        completions=batch.completions,
        completion_ids=batch.completion_ids,
        trainer_state=state,
        **batch.columns,
    )


def _failure(fn: RewardFunction, batch: RewardBatch, state: RewardState, trace: str) -> str:
    """Why ``fn`` failed on ``batch``: the first row that fails alone, with its traceback, then
    one line of function, error and row (the line a run's final error quotes)."""
    for i in range(len(batch)) if len(batch) > 1 else ():
        try:
            _call(fn, batch.row(i), state)
        except Exception:
            completion = batch.completions[i]
            shown = repr(completion) if len(repr(completion)) < 200 else repr(completion)[:197]
            row_trace = traceback.format_exc()
            return (
                f"reward function {fn.name!r} raised on {batch.where(i)}, completion "
                f"{shown}:\n{row_trace}"
                f"{raised_summary(fn.name, last_line(row_trace), batch.where(i))}"
            )
    where = (
        f"the step's {len(batch)} completions (no row fails alone)"
        if len(batch) > 1
        else (batch.where(0))
    )
    summary = raised_summary(fn.name, last_line(trace), where)
    return f"reward function {fn.name!r} raised on {where}:\n{trace}{summary}"


def score(
    fns: Sequence[RewardFunction], batch: RewardBatch, state: RewardState | None = None
) -> torch.Tensor:
    """Each function's rewards, in this process: fp32 ``[completions, functions]`` (NaN where a
    function returned None)."""
    columns = [call_reward(fn, batch, state) for fn in fns]
    return torch.tensor(columns, dtype=torch.float32).T.reshape(len(batch), len(fns))


def score_on_ray(
    fns: Sequence[RewardFunction],
    batch: RewardBatch,
    state: RewardState | None = None,
    timeout_s: float | None = None,
    stop: Callable[[], str | None] | None = None,
) -> torch.Tensor:
    """:func:`score`, each function in a Ray task of its own resources, all in parallel (the
    batch put in the object store once). Runs in the process that drives the rollouts, on a
    running Ray.

    Raises:
        RewardError: a function failed (its task's :class:`RewardError`, with the row and the
            traceback), as soon as it did; ``timeout_s`` passed before every function
            returned, or `stop()` (``reward_wait.StopProbe``) gave a stop reason meanwhile:
            the tasks still running are cancelled, and the error names them, the step's
            completions and the time (``reward_wait.wait_for_rewards``).
    """
    import ray

    remote = ray.remote(call_reward)
    batch_ref = ray.put(batch)
    refs = {remote.options(**task_options(fn)).remote(fn, batch_ref, state): fn for fn in fns}
    got: dict[Any, list[float]] = {}

    def take(ref: Any) -> None:
        try:
            got[ref] = ray.get(ref)
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, RewardError):  # its message has the user's traceback
                raise RewardError(str(cause)) from None
            raise RewardError(f"reward function {refs[ref].name!r}'s task failed: {e}") from None
        except ray.exceptions.RayError as e:  # its worker died, the task was cancelled...
            raise RewardError(f"reward function {refs[ref].name!r}'s task failed: {e}") from None

    step = f"step {state.global_step + 1}'s " if state is not None else "the step's "
    wait_for_rewards(
        list(refs), {r: fn.name for r, fn in refs.items()}, wait=ray.wait, on_ready=take,
        cancel=lambda ref: ray.cancel(ref, force=True), timeout_s=timeout_s, stop=stop,
        what=f"{step}{len(batch)} completions{prompts_of(batch.prompt_index)}",
    )  # fmt: skip
    columns = [got[ref] for ref in refs]
    return torch.tensor(columns, dtype=torch.float32).T.reshape(len(batch), len(fns))


# -- rewards to advantages ------------------------------------------------------------------------


def reward_weights(weights: Sequence[float] | None, fns: Sequence[Any]) -> torch.Tensor:
    """The functions' weights (None: all 1.0), checked against their number (TRL's rule)."""
    if weights is None:
        return torch.ones(len(fns), dtype=torch.float32)
    if len(weights) != len(fns):
        raise TrainingArgsError(
            f"reward_weights has {len(weights)} weight(s) for {len(fns)} reward "
            "function(s); give one weight per function, in the order of reward_fns"
        )
    return torch.tensor([float(w) for w in weights], dtype=torch.float32)


def combine_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted sum over functions, a function's None (NaN)
    left out; NaN where every function returned None (unscorable), as TRL 1.16."""
    rewards = (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)
    unscorable = torch.isnan(per_function).all(dim=1)
    return rewards.masked_fill(unscorable, math.nan)


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """The standard deviation ignoring NaNs, with Bessel's correction (TRL's ``nanstd``;
    NaN with fewer than two values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, math.nan))
    std = torch.sqrt(var * correction)
    return std.squeeze(dim) if dim is not None else std.reshape(())


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages, as TRL 1.16 (``multi_objective_aggregation=
    "sum_then_normalize"``): each completion's reward minus its group's mean (the
    ``num_generations`` consecutive completions of one prompt), divided by the group's std
    (``"group"``), the batch's (``"batch"``) or nothing (``"none"``), plus 1e-4. An unscorable
    completion (NaN) stays out of its group's mean and std and gets 0. Returns
    ``(advantages, std_is_zero)``, the second per completion (for ``frac_reward_zero_std``): a
    group of equal rewards gets advantage 0, never NaN."""
    if rewards.numel() % num_generations:
        raise ValueError(
            f"{rewards.numel()} rewards are not whole groups of num_generations="
            f"{num_generations}; a step scores every completion of each of its prompts"
        )
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)
    if scale_rewards in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    elif scale_rewards == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else rewards * 0
    else:
        raise ValueError(
            f"grpo.scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}"
        )
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + 1e-4)
    zero_std = torch.isclose(std, torch.zeros_like(std))
    return torch.nan_to_num(advantages, nan=0.0), zero_std


def reward_metrics(
    per_function: torch.Tensor,
    names: Sequence[str],
    weights: torch.Tensor,
    zero_std: torch.Tensor,
) -> dict[str, float]:
    """A step's reward metrics, with TRL 1.16's names: ``rewards/<fn>/mean`` and ``/std`` over
    the completions each function scored, ``reward`` and ``reward_std`` of the weighted sum
    (unscorable completions left out), ``frac_reward_zero_std``."""
    out: dict[str, float] = {}
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = torch.nanmean(per_function[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(per_function[:, i]).item()
    rewards = combine_rewards(per_function, weights)
    out["reward"] = torch.nanmean(rewards).item()
    out["reward_std"] = nanstd(rewards).item()
    out["frac_reward_zero_std"] = zero_std.float().mean().item()
    return out


def completion_metrics(lengths: Sequence[int], truncated: Sequence[bool]) -> dict[str, float]:
    """A step's completion metrics, with TRL 1.16's names: ``completions/mean_length``,
    ``min_length``, ``max_length`` (tokens) and ``clipped_ratio`` (the share cut at
    ``max_completion_length``, ending on no EOS)."""
    n = max(len(lengths), 1)
    return {
        "completions/mean_length": sum(lengths) / n,
        "completions/min_length": float(min(lengths, default=0)),
        "completions/max_length": float(max(lengths, default=0)),
        "completions/clipped_ratio": sum(bool(t) for t in truncated) / n,
    }


# -- one step -------------------------------------------------------------------------------------


@dataclass
class ScoredStep:
    """One step's completions scored: ``completions`` grouped (each prompt's
    ``num_generations`` consecutive, prompts in ledger order), and for each of them, in that
    order, ``per_function`` rewards (``[completions, functions]``, NaN for None), the
    weighted ``rewards`` and the ``advantages``; ``metrics`` with TRL's names."""

    completions: list[Any]
    per_function: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor
    metrics: dict[str, float]


def grouped(completions: Sequence[Any], num_generations: int) -> list[Any]:
    """``completions`` (records with a ``prompt_index``) in groups: by prompt position, each
    prompt's completions in the order the engines returned them. Raises ``ValueError`` when a
    prompt has other than ``num_generations`` completions (a rollout lost or repeated one)."""
    order = sorted(range(len(completions)), key=lambda i: completions[i].prompt_index)
    out = [completions[i] for i in order]
    counts: dict[int, int] = {}
    for c in out:
        counts[c.prompt_index] = counts.get(c.prompt_index, 0) + 1
    wrong = {p: n for p, n in counts.items() if n != num_generations}
    if wrong:
        p, n = next(iter(wrong.items()))
        raise ValueError(
            f"prompt {p} has {n} completions, GRPO groups num_generations={num_generations} "
            "per prompt: a rollout returned too few or too many"
        )
    return out


def score_step(
    completions: Sequence[Any],
    prompts: Any,
    fns: Sequence[RewardFunction],
    *,
    num_generations: int,
    decode: Callable[[list[int]], str],
    scale_rewards: str = "group",
    weights: Sequence[float] | None = None,
    state: RewardState | None = None,
    on_ray: bool = True,
    timeout_s: float | None = None,
    stop: Callable[[], str | None] | None = None,
) -> ScoredStep:
    """Score one step's ``Completion`` records: group them (:func:`grouped`), build the
    reward functions' batch (``prompts[c.prompt_index]`` has the record's ``prompt`` and
    ``columns``, e.g. an ``EncodedPrompt``; ``decode`` turns ids into text, skipping special
    tokens as TRL does; a conversational prompt's completion becomes an assistant message),
    call the functions (as Ray tasks with ``on_ray``), and turn their rewards into advantages
    and metrics (on Ray: within `timeout_s`, `stop` asked while they run: :func:`score_on_ray`).
    Runs in the process that drives the rollouts."""
    ordered = grouped(completions, num_generations)
    texts = [decode(list(c.completion_ids)) for c in ordered]
    records = [prompts[c.prompt_index] for c in ordered]
    names = sorted({k for r in records for k in r.columns})
    columns = {k: [r.columns.get(k) for r in records] for k in names}
    columns.update(episode_columns(ordered))
    batch = RewardBatch(
        prompts=[r.prompt for r in records],
        completions=[
            _completion(c, r.prompt, t) for c, r, t in zip(ordered, records, texts, strict=True)
        ],
        completion_ids=[list(c.completion_ids) for c in ordered],
        columns=columns,
        prompt_index=[c.prompt_index for c in ordered],
    )
    if on_ray:
        per_function = score_on_ray(fns, batch, state, timeout_s, stop)
    else:
        per_function = score(fns, batch, state)
    w = reward_weights(weights, fns)
    rewards = combine_rewards(per_function, w)
    advantages, zero_std = group_advantages(rewards, num_generations, scale_rewards)
    metrics = reward_metrics(per_function, [f.name for f in fns], w, zero_std)
    metrics.update(
        completion_metrics([len(c.completion_ids) for c in ordered], [c.truncated for c in ordered])
    )
    return ScoredStep(list(ordered), per_function, rewards, advantages, metrics)


def _completion(c: Any, prompt: Any, text: str) -> Any:
    """What reward functions get as a completion: a multi-turn episode's messages (each
    assistant turn with its tool calls, each tool result: TRL's), an assistant message for a
    conversational prompt, else the text."""
    episode = getattr(c, "episode", None)
    if episode is not None:
        return list(episode.messages)
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def episode_columns(completions: Sequence[Any]) -> dict[str, list[Any]]:
    """A multi-turn run's columns besides the data's: a ``rollout_func``'s own keys, and with
    environments ``environments`` (each episode's instance as it ended, as TRL passes them;
    None where it could not be pickled) and ``environment_reward`` (its ``get_reward()``, None
    where it defines none)."""
    import cloudpickle

    episodes = [getattr(c, "episode", None) for c in completions]
    extra = sorted({k for e in episodes if e is not None for k in e.extra})
    columns = {k: [None if e is None else e.extra.get(k) for e in episodes] for k in extra}
    if not any(e is not None and (e.snapshot, e.env_reward) != (None, None) for e in episodes):
        return columns
    return {
        **columns,
        "environments": [
            None if e is None or e.snapshot is None else cloudpickle.loads(e.snapshot)
            for e in episodes
        ],
        "environment_reward": [None if e is None else e.env_reward for e in episodes],
    }


@dataclass
class StepScorer:
    """A run's scoring of one step's completions, ``scorer(step, completions)``: what
    :func:`score_step` needs besides them, in one picklable object (it travels to the rollout
    queue's actor, which scores each request as it is answered). ``prompts[i]`` is the data's
    row `i`; `tokenizer` decodes the completions; `max_steps` is the run's last step;
    `timeout_s` (``reward_timeout_s``) bounds the functions' tasks, and `stop`
    (``reward_wait.StopProbe``) ends them on a stop from outside."""

    prompts: Sequence[Any]
    fns: Sequence[RewardFunction]
    num_generations: int
    tokenizer: Any
    scale_rewards: str = "group"
    weights: Sequence[float] | None = None
    max_steps: int | None = None
    timeout_s: float | None = None
    stop: Callable[[], str | None] | None = None

    def __call__(self, step: int, completions: Sequence[Any]) -> ScoredStep:
        """Step `step`'s (0-based) completions scored, the reward functions as Ray tasks."""
        return score_step(
            completions, self.prompts, self.fns, num_generations=self.num_generations,
            decode=self.decode, scale_rewards=self.scale_rewards, weights=self.weights,
            state=RewardState(step, self.max_steps), timeout_s=self.timeout_s, stop=self.stop,
        )  # fmt: skip

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
