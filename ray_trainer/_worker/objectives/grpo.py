"""Training worker: GRPO, a step's prompts to sampled completions, rewards, advantages and loss.

Runs in each training worker (the module ``ray_trainer._objectives.grpo`` names). The loader
deals each rank its prompts of the step, in the seeded epoch order that a resumed run continues
(that order is the prompt ledger; its record travels in the checkpoint and is checked on
resume: ``grpo_batch.ledger_error``). :meth:`GrpoObjective.steps` turns each step's prompts
into its micro-batches, one step at a time, on every rank:

1. the ranks agree on the serving engines (the lost leave, the engines come up join), then
   the weight sync when due (every ``grpo.sync_every`` steps, and before the first rollout of
   a worker-group start: a resumed run's engines get the restored weights), then the probe
   (``grpo_engines.py``); a joiner takes the latest weights before its first request;
2. the rank's prompts x ``num_generations`` from its engine (an engine found dead leaves the
   serving set, its rank's rollout is tried again on an engine left, and a replacement joins
   in the background, synced before its first request: ``grpo_engines.py``);
3. rewards, each function a Ray task (``_rollout/rewards.py``), and group advantages (a group
   never spans ranks; ``scale_rewards="batch"`` agrees the batch's std over the ranks);
4. one micro-batch of completions per micro-batch of prompts (``grpo_batch.py``).

With ``max_staleness`` k >= 1 the rollouts (and their rewards) of the next k steps are
requested while a step trains, through the run's rollout queue: an actor of its own that every
rank sends its requests to, which sends a lost engine's requests again to the engines left and
scores each answer as it comes (``_rollout/buffer.py``, ``_rollout/queue.py``); a step takes
its own from it, keeping the completions at most k versions old; the loss then takes the
engine's log-probs as the old ones.

The loss of each micro-batch is TRL 1.16's (``grpo_loss.grpo_sums``), a token sum whose
denominator is the micro-batches' ``targets`` summed over the step: the loop's scaling makes it
exact for any split. The step's metrics (rewards, completions, the loss's, the rollout's
timings) ride on the step's agreement as sums (:meth:`take_sums`), their extremes in one small
MAX all-reduce; ``grpo_metrics.py`` turns them into TRL's names and writes ``rollouts.jsonl``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ray_trainer._objectives.grpo import GRPO, config_of
from ray_trainer._rollout.actor import RolloutEngineDied
from ray_trainer._rollout.engine import EngineSpec, SamplingParams
from ray_trainer._rollout.probe import Probe
from ray_trainer._rollout.queue import Taken, ages
from ray_trainer._rollout.reward_wait import StopProbe
from ray_trainer._rollout.rewards import StepScorer, resolve_reward_fns
from ray_trainer._worker.model.adaptation import WholeModel
from ray_trainer._worker.objectives.base import WorkerObjective
from ray_trainer._worker.objectives.dpo import disable_dropout
from ray_trainer._worker.objectives.grpo_agents import Sampling
from ray_trainer._worker.objectives.grpo_batch import (
    MODEL_KEYS,
    PromptDataset,
    batch_advantages,
    completion_batch,
    flat_per_token,
    ledger_error,
    ledger_record,
    token_logps,
)
from ray_trainer._worker.objectives.grpo_engines import (
    Engines,
    agree_any,
    create_engines,
    starts_early,
)
from ray_trainer._worker.objectives.grpo_loss import (
    CompletionTokens,
    engine_old_logps,
    grpo_sums,
    importance_ratio,
)
from ray_trainer._worker.objectives.grpo_metrics import (
    PROBE_AT,
    append_run_file,
    async_sums,
    completion_lines,
    rollout_extremes,
    rollout_sums,
    step_metrics,
)
from ray_trainer._worker.objectives.grpo_states import PromptStates, run_end
from ray_trainer._worker.step.micro_batches import MicroBatch

#: ``TrainerState.extra`` key of the prompt ledger's record.
LEDGER = "grpo_ledger"


def _logits(outputs: Any) -> torch.Tensor:
    return outputs if isinstance(outputs, torch.Tensor) else outputs["logits"]


class GrpoObjective(WorkerObjective):
    """A GRPO run's objective in one training worker (see the module docstring)."""

    description = GRPO

    def __init__(self, args: Any) -> None:
        self.args = args
        self.config = config_of(args)
        # Resolved again here (the driver checked them); episodes' sampling: ``grpo_agents.py``.
        self.sampling = Sampling(args, self.config)
        own = resolve_reward_fns(args.reward_fns, args.reward_resources)
        self.fns = self.sampling.reward_fns(own)
        self.model: Any = None
        self.adaptation: Any = None
        self.frozen: Any = None  # beta > 0 without LoRA: the model as it started
        self.state: Any = None
        self.prompts: PromptDataset | None = None
        self.engines: Engines | None = None
        self._started: dict[int, Any] | None = None  # rank 0's engines made by `begin`
        self._sums: torch.Tensor | None = None
        self._maxima: torch.Tensor | None = None
        self._rollout: list[float] = []  # this step's rollout sums (host)
        self._extremes: list[float] = []  # this step's rollout extremes (host)
        self._agreed_maxima: deque[list[float]] = deque()  # per agreed step, in order
        self._log_dir: str | None = None
        #: Optimizer passes over each rollout's completions (``grpo.num_iterations``).
        self.iterations = self.config.num_iterations
        self._pass = 0  # this rollout's pass in progress (0: the first, which reads old_logps)
        self._micro = 0  # the micro-batch of the pass in progress
        self._old: list[torch.Tensor] = []  # per micro-batch, the first pass's log-probs
        #: ``max_staleness`` k >= 1: this rank's handle on the run's rollout queue, made with
        #: the engines (``buffer.RemoteQueue``; None: synchronous, or not made yet).
        self.queue: Any = None
        self.scorer: StepScorer | None = None  # a step's completions scored (`_scorer`)
        self._serving: tuple[tuple[int, int], ...] | None = None  # what the queue last heard
        self._stop: StopProbe | None = None  # asks the callback actor for a stop (`begin`)
        #: The per-prompt ledger of this worker-group start (``grpo_states.py``), and the step
        #: being trained: (its 1-based step, epoch, rows), noted trained once the step is done.
        self.states = PromptStates(None, 0, 0)  # nothing written until a start locates it
        self._launch, self._rank, self._attempt = "", 0, 0
        self._training: tuple[int, int, list[int]] | None = None
        self._step_rows: list[int] = []  # the last rollout's prompts (data rows)

    # ---- the workload ------------------------------------------------------------------

    def begin(self, spec: Any, rank: int, attempt: int) -> None:
        """Rank 0 creates this worker-group start's engines now, so that each loads its model
        while the ranks load theirs (unless it shares their GPU: ``starts_early``)."""
        self._launch, self._rank, self._attempt = spec.launch_id, rank, attempt
        self._stop = StopProbe(spec.actor_name, spec.actor_namespace)  # during a stuck reward
        if rank == 0 and starts_early(self.args.rollout_resources):
            self._started = create_engines(
                self.args, self._engine_spec(), spec.actor_name, attempt, spec.actor_namespace
            )

    def _engine_spec(self) -> EngineSpec:
        from ray_trainer._model.spec import ModelSpec

        return EngineSpec(model=ModelSpec.of(self.args), lora=self.args.lora, device=None)

    def prepare(self, model: torch.nn.Module, adaptation: Any) -> None:
        """Dropout off (as TRL), and the model kept for the KL's reference (LoRA: its
        adapters off)."""
        disable_dropout(model)
        self.model, self.adaptation = model, adaptation

    def dataset(self, cached: Any, field: str, args: Any, references: dict[str, str]) -> Any:
        """The run's encoded prompts (the driver's, through the object store)."""
        c = self.config
        self.prompts = PromptDataset(cached, c.num_generations, c.max_completion_length)
        return self.prompts

    def targets_per_sample(self, args: Any, cached: bool) -> int:
        c = self.config
        return c.num_generations * max(1, c.max_completion_length // 2)

    def after_placement(self, workload: Any, parallel: Any) -> None:
        """``beta > 0`` without LoRA: a frozen copy of the placed model, before any step."""
        if self.config.beta > 0 and isinstance(workload.adaptation, WholeModel):
            from ray_trainer._worker.objectives.dpo_reference import frozen_copy

            self.frozen = frozen_copy(parallel.module())

    def before_training(self, state: Any, references: dict[str, str]) -> None:
        self.state = state

    # ---- the step's micro-batches ------------------------------------------------------

    def steps(self, state: Any, steps: Iterator[list[MicroBatch]]) -> Iterator[list[MicroBatch]]:
        """Each step's micro-batches of completions, from the loader's of prompts: with
        ``num_iterations`` k, each rollout's micro-batches for k optimizer steps in a row
        (TRL's mu; an epoch is k times the loader's steps, ``assemble``), the old log-probs
        those of the policy that sampled them, read in the first pass (:meth:`step_loss`)."""
        self._start(state)
        k, p = self.iterations, state.progress
        self.states.remainder(state.loader, p.global_step + 1, p.epoch)  # rows no step deals
        first = 0
        if k > 1:  # the loader's step of this optimizer step, and the passes it has had
            start, first = iteration_start(p.step_in_epoch, k)
            steps = state.loader.steps(p.epoch, start)
        if self.args.max_staleness:  # k >= 1: rollouts requested ahead, through the queue
            yield from self._async_steps(state, steps)
            return
        for prompts in steps:
            batches = self.rollout_step(state, prompts)
            self._old = []
            for i in range(first, k):
                self._pass, self._micro = i - first, 0
                state.progress.extra[LEDGER] = {
                    **self._ledger(state),
                    "step_in_epoch": state.progress.step_in_epoch + 1,
                }
                if i > first:
                    no_sync = [-math.inf] * 3  # no sync, no probe (the engines stay)
                    self._extremes = self._extremes[:4] + no_sync + self._extremes[7:]
                if i == k - 1:  # the rollout's last pass: its prompts trained once it is done
                    self._train(state)
                yield batches
                self._settle(state)
            first = 0

    def _async_steps(
        self, state: Any, steps: Iterator[list[MicroBatch]]
    ) -> Iterator[list[MicroBatch]]:
        """``max_staleness`` k >= 1: the loader read k steps ahead, whose rollouts are requested
        while each step trains (``_rollout/queue.py``); the queue drains at the epoch's end."""
        ahead: deque[list[MicroBatch]] = deque()
        k = self.args.max_staleness
        self.queue.clear()  # a new epoch (or start): nothing requested for its steps yet
        p = state.progress
        for prompts in steps:
            ahead.append(prompts)  # the loader dealt them: step global_step + len(ahead)'s
            self.states.note("queued", p.global_step + len(ahead), p.epoch, _rows(prompts))
            if len(ahead) > k:
                yield self._async_step(state, ahead)
                self._settle(state)
        while ahead:
            yield self._async_step(state, ahead)
            self._settle(state)

    def _async_step(self, state: Any, ahead: deque[list[MicroBatch]]) -> list[MicroBatch]:
        """The oldest step of `ahead` rolled out (the others' rollouts requested), its ledger
        record the step it completes."""
        p = state.progress
        prompts = ahead.popleft()
        batches = self.rollout_step(state, prompts, list(ahead))
        # The queue's state: the steps whose rollouts are in flight once this one is trained
        # (a resume from this step's checkpoint deals their prompts and asks for them again).
        in_flight = list(range(p.global_step + 2, p.global_step + 2 + len(self.queue)))
        p.extra[LEDGER] = {
            **self._ledger(state), "step_in_epoch": p.step_in_epoch + 1,
            "in_flight_steps": in_flight,
        }  # fmt: skip
        self._train(state)
        return batches

    def _train(self, state: Any) -> None:
        """The step now given to the loop trains the last rollout's prompts: noted
        (``training``), and this step's ledger lines written, before it trains (a checkpoint of
        it finds them written)."""
        p = state.progress
        self._training = (p.global_step + 1, p.epoch, self._step_rows)
        self.states.note("training", *self._training)
        self.states.flush()

    def _settle(self, state: Any) -> None:
        """The step given to the loop is done (the loop came back for the next one): its
        prompts trained (the line is written with the next step's, or at the run's end: a
        start that fails is judged by its ``training`` lines and the resume's checkpoint)."""
        done = self._training
        if done is not None and state.progress.global_step >= done[0]:
            self._training = None
            self.states.note("trained", *done)

    def end(self, state: Any) -> None:
        """After the run's last step (or a stop): that step trained, the run's end noted, the
        ledger's last lines written; rank 0 ends the rollout queue's actor."""
        self._settle(state)
        self.states.end(**run_end(state, self.iterations))  # the audit checks the last epoch by it
        self.states.flush()
        if self.queue is not None and self._rank == 0:
            self.queue.close()
        self.sampling.close()

    def _start(self, s: Any) -> None:
        """At each epoch's first step; once per worker-group start (after the resume): the
        ledger checked, the engines made."""
        assert self.prompts is not None
        if self.engines is None:  # the first epoch of this start: right after the resume
            why = ledger_error(s.progress.extra.get(LEDGER), self._ledger(s))
            if why is not None:
                raise ValueError(why)
            first = self.prompts[0].prompt_ids
            probe = Probe(tuple(first), tuple(first[: min(8, len(first))]), self.config.temperature)
            self.engines = Engines(
                s, self._engine_spec(), probe, posted=bool(self.args.max_staleness)
            )
            self.engines.start(started=self._started)
            self._started = None
            self.sampling.start(s)
            if self.args.max_staleness:  # the run's rollout queue (rank 0 makes its actor)
                self.queue = self.engines.queue(self.args.max_staleness, self._scorer(s))
            run = getattr(s, "run", None)
            folder = run.child("ledger") if run is not None else None
            self.states = PromptStates(folder, self._rank, self._attempt)
            saved = s.progress.extra.get(LEDGER) or {}
            self.states.start(
                self._launch, s.progress.global_step, saved.get("in_flight_steps", []),
                len(self.prompts),
            )  # fmt: skip

    def _ledger(self, s: Any) -> dict[str, Any]:
        p = s.progress
        return ledger_record(self.prompts, s.args.seed, s.loader.per_step, p.epoch, p.step_in_epoch)

    def rollout_step(
        self, s: Any, prompt_batches: list[MicroBatch], upcoming: list[list[MicroBatch]] = ()
    ) -> list[MicroBatch]:
        """One step's prompts (this rank's micro-batches of rows) to its micro-batches of
        completions; asynchronous (``max_staleness`` >= 1), the rollouts of the `upcoming`
        steps requested too. Every rank, at the same point (syncs and agreements are
        collectives)."""
        c = self.config
        step, epoch = s.progress.global_step, s.progress.epoch
        rows = self._step_rows = _rows(prompt_batches)
        taken, wait_s = None, 0.0
        if self.queue is not None:  # the request sent a step (or more) ago, if any
            started = time.perf_counter()
            taken = self.queue.take(rows, step)
            wait_s = time.perf_counter() - started
        else:
            self.states.note("queued", step + 1, epoch, rows)
        sync = self.engines.boundary(self.config.sync_every)  # who serves, and the weights
        if self.queue is not None and s.rank == 0:
            self._serve()
        started = time.perf_counter()
        if taken is None:
            completions = self._generate(s, rows, step)
        else:  # what was stale, or lost with its engine, sampled again now (no-one else waits)
            missing = taken.missing
            for slot in taken.resent:  # the queue sent it again itself, to an engine left
                self.states.note("requeued", step + 1, epoch, rows, why="engine lost")
                self.states.note("in_flight", step + 1, epoch, rows, engine=slot)
            if taken.died:
                self.states.note("requeued", step + 1, epoch, missing, why="engine lost")
            elif taken.dropped:  # (missing without a drop: nothing was requested yet)
                self.states.note("dropped", step + 1, epoch, missing, completions=taken.dropped)
            completions = taken.kept + self._generate(s, missing, step, None if missing else [])
            self._request_ahead(s, upcoming, step)
        rollout_s = time.perf_counter() - started  # asynchronous: the engine's time added
        rollout_s += taken.generation_s if taken is not None else 0.0
        if taken is not None and taken.scored is not None:  # scored while the step before trained
            scored, reward_s = taken.scored, taken.reward_s
        else:
            started = time.perf_counter()
            scored = self._score(s, step, completions)
            reward_s = time.perf_counter() - started
        advantages = scored.advantages
        if c.scale_rewards == "batch":
            advantages = batch_advantages(
                scored.rewards, c.num_generations, self._batch_std(s, scored.rewards)
            )
        by_row = {}
        for i, comp in enumerate(scored.completions):
            by_row.setdefault(comp.prompt_index, []).append(i)
        out = []
        pad = s.workload.pad_id if s.workload.pad_id is not None else 0
        for m in prompt_batches:
            picked = [i for r in m.batch["prompt_index"].tolist() for i in by_row[r]]
            batch = completion_batch(
                [scored.completions[i] for i in picked], advantages[picked].tolist(),
                pad_id=pad, loss_type=c.loss_type, max_completion_length=c.max_completion_length,
                mask_truncated=c.mask_truncated_completions, packed=s.args.packing,
                pad_to=s.loader.pad_to, layout=s.loader.layout,
            )  # fmt: skip
            out.append(batch)
        self.states.note("scored", step + 1, epoch, rows)
        self._note_rollout(scored, rollout_s, reward_s, sync, taken, wait_s, step)
        if c.log_completions and s.rank == 0:
            self._log_completions(s, scored, advantages, step)
        return out

    def _score(self, s: Any, step: int, completions: list[Any]) -> Any:
        """Step `step`'s completions scored here (the reward functions as Ray tasks); a request
        sent ahead is scored by the rollout queue, as it is answered."""
        return self._scorer(s)(step, completions)

    def _scorer(self, s: Any) -> StepScorer:
        """The run's scoring of a step (picklable: the rollout queue's actor gets a copy)."""
        if self.scorer is None:
            c = self.config
            self.scorer = StepScorer(
                self.prompts.prompts, self.fns, c.num_generations, s.workload.tokenizer,
                scale_rewards="none" if c.scale_rewards == "batch" else c.scale_rewards,
                weights=self.sampling.reward_weights(), max_steps=s.total_steps,
                timeout_s=self.args.reward_timeout_s, stop=self._stop,
            )  # fmt: skip
        return self.scorer

    def _serve(self) -> None:
        """Rank 0: the rollout queue told the serving engines when they changed (where it
        sends a lost engine's requests again)."""
        serving = self.engines.serving_engines()
        key = tuple((slot, id(engine)) for slot, engine in serving.items())
        if key != self._serving:
            self.queue.serve(serving)
            self._serving = key

    def _params(self, s: Any, step: int) -> SamplingParams:
        """The sampling of step `step`'s rollout on this rank (its own seed)."""
        c = self.config
        return SamplingParams(
            num_generations=c.num_generations, max_completion_length=c.max_completion_length,
            temperature=c.temperature, top_p=c.top_p, top_k=c.top_k,
            seed=(s.args.seed * 1_000_003 + step * 1_009 + s.rank) % 2**31,
        )  # fmt: skip

    def _request_ahead(self, s: Any, upcoming: list[list[MicroBatch]], step: int) -> None:
        """Request the rollouts of the `upcoming` steps not yet requested (up to
        ``max_staleness`` in flight, none past the run's last step), from this rank's engine,
        by the weights it holds now."""
        queue = self.queue
        last = min(len(upcoming), queue.max_staleness, s.total_steps - step - 1)
        for j in range(len(queue), last):
            rows = _rows(upcoming[j])
            prompt_ids = [self.prompts[r].prompt_ids for r in rows]
            ahead, slot = step + 1 + j, self.engines.slot()
            params = self._params(s, ahead)
            queue.submit(ahead, slot, self.engines.of_rank(), rows, prompt_ids, params)
            self.states.note("in_flight", ahead + 1, s.progress.epoch, rows, engine=slot)

    def _generate(
        self, s: Any, rows: list[int], step: int, completions: list[Any] | None = None
    ) -> list[Any]:
        """This rank's completions of `rows` from its engine (given `completions`: this rank
        needs none, but takes part in the agreement). An engine found dead on any rank leaves
        the serving set (every rank agrees), and the failed rollouts are tried again on the
        engines left (with none left, on the first to come up: ``grpo_engines.Engines.lost``)."""
        params = self._params(s, step)
        error = None
        tries = self.engines.max_tries
        epoch = s.progress.epoch
        for attempt in range(tries):
            failed = False
            if completions is None:
                self.states.note("in_flight", step + 1, epoch, rows, engine=self.engines.slot())
                try:
                    key, engine = (
                        f"{self._attempt}:{step}:{s.rank}:{attempt}",
                        self.engines.of_rank(),
                    )
                    completions = self.sampling.sample(engine, self.prompts, rows, params, key)
                except RolloutEngineDied as e:
                    error, failed = e, True
                    self.states.note("requeued", step + 1, epoch, rows, why="engine lost")
            if not agree_any(completions is None, s.world_size):
                return completions
            if attempt == tries - 1:
                raise RuntimeError(
                    f"grpo: step {step + 1}'s rollouts failed {tries} times: rollout engines "
                    f"died one after another ({error}); check the engines' resources "
                    "(rollout_resources) and their log"
                )
            self.engines.lost(failed)
        raise AssertionError("unreachable")

    def _batch_std(self, s: Any, rewards: torch.Tensor) -> float:
        """The std of the step's rewards over every rank (``scale_rewards="batch"``)."""
        ok = rewards[~torch.isnan(rewards)].double()
        sums = torch.tensor([ok.sum().item(), (ok**2).sum().item(), float(ok.numel())])
        if s.world_size > 1:
            sums = sums.to(s.accelerator.device)
            dist.all_reduce(sums)
        total, sq, n = sums.tolist()
        if n < 2:
            return math.nan
        return math.sqrt(max(sq - total * total / n, 0.0) / (n - 1))

    def _note_rollout(
        self,
        scored: Any,
        rollout_s: float,
        reward_s: float,
        sync: dict,
        taken: Taken | None = None,
        wait_s: float = 0.0,
        step: int = 0,
    ) -> None:
        """This step's rollout sums and extremes (rank-local), for :meth:`take_sums`;
        asynchronous, the queue's after them (``grpo_metrics.async_sums``)."""
        self._rollout = rollout_sums(scored, len(self.fns), self.sampling.agents)
        self._extremes = rollout_extremes(scored, rollout_s, reward_s, sync, len(self.engines))
        if taken is not None:
            sums, extremes = async_sums(
                ages(scored.completions, step), taken, wait_s, len(self.queue)
            )
            self._rollout += sums
            self._extremes += extremes

    # ---- the loss ----------------------------------------------------------------------

    def step_loss(
        self, workload: Any, model: Any, batch: dict[str, Any], targets: int
    ) -> tuple[Any, torch.Tensor]:
        c = self.config
        inputs = {k: batch[k] for k in MODEL_KEYS if k in batch}
        logps, rows, entropy = token_logps(_logits(model(**inputs)), batch, c.temperature, True)
        ref = None
        if c.beta > 0:
            with torch.no_grad():
                if self.frozen is not None:
                    ref_logits = _logits(self.frozen(**inputs))
                else:
                    with self.adaptation.disabled(self.model):
                        ref_logits = _logits(model(**inputs))
                ref, _, _ = token_logps(ref_logits, batch, c.temperature)
        keep = batch["keep"][rows]
        if "env_mask" in batch:  # a multi-turn episode's tool-result tokens: no loss
            keep = keep * flat_per_token(batch["env_mask"], batch["length"])
        old = None  # one pass: the log-probs themselves, detached (TRL's shortcut)
        if self.iterations > 1:  # the first pass's, as TRL's old_per_token_logps
            if self._pass == 0:
                self._old.append(logps.detach())
            else:
                old = self._old[self._micro]
            self._micro += 1
        sampling = flat_per_token(batch["sampling_logps"], batch["length"])
        if self.args.max_staleness:  # asynchronous: the engine's log-probs are the old ones
            old = engine_old_logps(sampling, logps)
        tokens = CompletionTokens(
            logps=logps, sequence=rows, advantages=batch["advantages"], mask=keep, old_logps=old,
            sampling_logps=sampling, ref_logps=ref, entropy=entropy,
        )  # fmt: skip
        ratio = importance_ratio(
            tokens, c.importance_sampling, c.importance_sampling_cap, c.importance_sampling_min
        )
        sums = grpo_sums(
            tokens, loss_type=c.loss_type, beta=c.beta, epsilon=c.epsilon,
            epsilon_high=c.epsilon_high, importance_sampling_level=c.importance_sampling_level,
            importance_sampling_ratio=ratio,
        )  # fmt: skip
        if self._sums is None:
            self._sums, self._maxima = sums.sums, sums.maxima
        else:
            self._sums = self._sums + sums.sums
            self._maxima = torch.maximum(self._maxima, sums.maxima)
        return {"logps": logps, "metrics": sums.sums}, sums.loss / workload.norm

    def take_sums(self) -> torch.Tensor | None:
        """The step's sums (the loss's, then the rollout's) for the step's all-reduce; its
        extremes reduced now with MAX (a small collective every rank reaches here)."""
        loss_sums, loss_max = self._sums, self._maxima
        self._sums = self._maxima = None
        device = loss_sums.device
        if self._rank == 0 and self.engines is not None and self.engines.posted:
            diff = self.engines.posted_diff()  # the step's posted sync, probed by an engine
            if diff is not None and self._extremes:
                self._extremes[PROBE_AT] = max(self._extremes[PROBE_AT], diff)
        rollout = torch.tensor(self._rollout, dtype=loss_sums.dtype, device=device)
        extremes = torch.cat(
            [loss_max, torch.tensor(self._extremes, dtype=loss_max.dtype, device=device)]
        )
        if self.state is not None and self.state.world_size > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        self._agreed_maxima.append(extremes.tolist())
        return torch.cat([loss_sums.detach(), rollout])

    def metrics_from_sums(self, sums: Any, targets: float) -> dict[str, float]:
        """The step's metrics with TRL's names (``grpo_metrics.step_metrics``)."""
        restarts = self.engines.restarts if self.engines is not None else 0
        return step_metrics(
            list(sums), self._agreed_maxima.popleft(), [f.name for f in self.fns], self.config,
            restarts, asynchronous=bool(self.args.max_staleness), agents=self.sampling.agents,
        )  # fmt: skip

    # ---- sampled completions -----------------------------------------------------------

    def _log_completions(self, s: Any, scored: Any, advantages: torch.Tensor, step: int) -> None:
        """A few of rank 0's completions of the step into ``<run>/rollouts.jsonl``."""
        keep = self.config.num_completions_to_print or len(scored.completions)
        names = [f.name for f in self.fns]
        lines = completion_lines(
            scored, advantages, step, self.prompts, self._scorer(s).decode, names, keep
        )
        self._log_dir = append_run_file(s.run.child("rollouts.jsonl"), lines, self._log_dir)


def _rows(prompt_batches: list[MicroBatch]) -> list[int]:
    """The prompt rows of a step's micro-batches of prompts, in order."""
    return [r for m in prompt_batches for r in m.batch["prompt_index"].tolist()]


def iteration_start(step_in_epoch: int, iterations: int) -> tuple[int, int]:
    """Where an epoch resumed at `step_in_epoch` (optimizer steps) continues with
    ``num_iterations`` `iterations`: the loader's step (its prompts rolled out again, by the
    policy as restored) and the passes over them already taken (the rest are taken, so the
    epoch keeps its count of optimizer steps)."""
    return step_in_epoch // iterations, step_in_epoch % iterations


def build(args: Any) -> GrpoObjective:
    """The GRPO objective of a run (``ray_trainer._objectives.grpo`` names this module)."""
    return GrpoObjective(args)
