"""Asynchronous GRPO rollouts (issue 51, section 1), their pure parts: no Ray.

The worker objective's own steps (``GrpoObjective.steps`` with ``max_staleness`` k >= 1)
driven as the loop drives them, against an in-process engine that stamps each completion with
the policy version it holds (a sync sets it, as ``Engines.sync`` does) and rewards scored
in-process: the rollouts of the next steps are requested while a step trains, at most k in
flight; a completion more than k versions old is dropped, counted and its prompt sampled again,
so every prompt of the epoch is trained exactly once, also across a resume with requests in
flight; the versions, ages, queue depth and drops reach the step's metrics. The refusals of
``max_staleness`` before Ray (and under another objective). (The loss with the engine's log-probs as the old ones against
TRL's is in ``test_grpo_loss.py``, beside the other TRL comparisons.)
"""

from __future__ import annotations

import math
import random
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import ray_trainer._rollout.rewards as rewards_module
from ray_trainer import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._objectives.grpo_ledger import audit, read_states
from ray_trainer._rollout.actor import RolloutEngineDied
from ray_trainer._rollout.queue import RolloutQueue, Serving, split_stale
from ray_trainer._rollout.rewards import score_step
from ray_trainer._rollout.types import Completion
from ray_trainer._storage import locate
from ray_trainer._worker.objectives.grpo import LEDGER, GrpoObjective
from ray_trainer._worker.objectives.grpo_batch import PromptDataset
from ray_trainer._worker.objectives.grpo_states import PromptStates

VOCAB = 11
GENERATIONS = 2


def _zero(prompts, completions, completion_ids, **kwargs):
    return [0.0] * len(completions)


class _Prompt:
    def __init__(self, row: int) -> None:
        self.prompt_ids = [row % 9 + 1, 10]
        self.prompt = f"prompt {row}"
        self.columns = {}


class _Engine:
    """An engine in this process, as the trainer side drives one: ``generate`` now, or
    ``submit`` and ``result`` (answered at once, by the weights it holds then: the actor runs its calls in
    order, so a request sent after a sync is sampled by the synced version)."""

    def __init__(self, clock=lambda: 10.0) -> None:
        self.version = None
        self.clock = clock
        self.sampled: list[tuple[int, int]] = []  # (prompt row, version) of every completion
        self.die_at: set[int] = set()  # requests (by count) whose answer is a dead actor's
        self.requests = 0

    def generate(self, prompt_ids, params, rows):
        out = []
        for ids, row in zip(prompt_ids, rows, strict=True):
            for g in range(params.num_generations):
                tokens = [(row + g) % 9 + 1, (row * 3 + g) % 9 + 1]
                out.append(Completion(row, list(ids), tokens, [-0.5, -0.7], False, self.version))
                self.sampled.append((row, self.version))
        return out

    def submit(self, prompt_ids, params, rows):
        self.requests += 1
        if self.requests in self.die_at:
            return None
        started = self.clock()  # sampled at once, in 2 s of the loop's clock
        return self.generate(prompt_ids, params, rows), started, started + 2.0

    def result(self, ticket):
        if ticket is None:
            raise RolloutEngineDied("the rollout engine died")
        return ticket


class _Engines:
    """``grpo_engines.Engines`` as one rank of one sees it: a sync sets the engine's version."""

    def __init__(self, state, clock) -> None:
        self.s, self.engine, self.version, self.restarts = state, _Engine(clock), None, 0
        self.last_sync: dict[str, float] = {}

    def due(self, every):
        return self.version is None or self.s.progress.global_step - self.version >= every

    def sync(self):
        self.version = self.engine.version = self.s.progress.global_step
        self.last_sync = {"sync/seconds": 0.0, "sync/bytes": 1.0}

    def boundary(self, every):
        if not self.due(every):
            return {}
        self.sync()
        return self.last_sync

    def __len__(self):
        return 1

    max_tries = 2
    posted = False  # the weights synced in place here (posted ones: test_grpo_pool.py)

    def of_rank(self):
        return self.engine

    def slot(self):
        return 0

    def serving_engines(self):
        return {0: self.engine}


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        return {"logits": self.head(self.emb(input_ids))}


def _run(
    monkeypatch,
    *,
    rows=12,
    per_step=2,
    start=0,
    session=None,
    total=None,
    max_staleness=1,
    ledger=None,
    die_at=(),
    **grpo,
):
    """The loop's part over one epoch of the objective's steps, from loader step `start`:
    returns the session (objective, engine, the rows trained and their completions' versions
    per step, the metrics per step). With `ledger` (a folder, this session's attempt number
    and the steps its checkpoint had in flight), the per-prompt ledger is written there; `die_at`: the engine's requests (by
    count) whose answer is lost, as a dead engine's."""
    trained: list[list[int]] = []
    versions: list[list[int]] = []
    scored_on: dict[frozenset[int], list[str]] = {}  # the threads that scored each set of rows

    def scoring(completions, *args, **kwargs):  # rewards in this process (no Ray)
        rows = frozenset(c.prompt_index for c in completions)
        scored_on.setdefault(rows, []).append(threading.current_thread().name)
        return score_step(completions, *args, on_ray=False, **kwargs)

    monkeypatch.setattr(rewards_module, "score_step", scoring)

    def reward(prompts, completions, completion_ids, **kwargs):
        return [float(ids[0] % 3) for ids in completion_ids]

    grpo = {"num_generations": GENERATIONS, "max_completion_length": 2, **grpo}
    args = TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[reward],
                               grpo=grpo, seed=3, max_staleness=max_staleness)  # fmt: skip
    objective = GrpoObjective(args)
    dataset = PromptDataset([_Prompt(r) for r in range(rows)])
    objective.prompts = dataset
    order = list(range(rows))
    random.Random(3).shuffle(order)

    def loader_steps(epoch, first):
        for step in range(first, rows // per_step):
            yield [dataset.padded(order[step * per_step : (step + 1) * per_step])]

    progress = SimpleNamespace(epoch=0, step_in_epoch=start, global_step=start, extra={})
    state = SimpleNamespace(
        progress=progress, rank=0, world_size=1, total_steps=total or rows // per_step,
        steps_per_epoch=rows // per_step, stop_reason=None,
        args=SimpleNamespace(seed=3, packing=False, reward_weights=None),
        workload=SimpleNamespace(pad_id=0, tokenizer=SimpleNamespace(decode=lambda ids, **k: "x")),
        loader=SimpleNamespace(steps=loader_steps, per_step=per_step, pad_to=1, layout=False,
                               left_out=lambda epoch: order[rows // per_step * per_step :]),
    )  # fmt: skip
    objective.state = state
    now = [0.0]  # the loop's clock: each step trains for 10 s
    objective.engines = _Engines(state, lambda: now[0])  # made: _start leaves them
    # The queue in this process (in a run, the queue's actor: `_rollout/buffer.py`); none for
    # the synchronous step (max_staleness=0).
    if max_staleness:
        queue = RolloutQueue(max_staleness, objective._scorer(state), clock=lambda: now[0])
        objective.queue = queue
    objective.engines.engine.die_at = set(die_at)
    if ledger is not None:  # what `_start` does in a worker, to a local folder
        folder, attempt, in_flight = ledger
        objective.states = PromptStates(locate(str(folder)), 0, attempt)
        objective.states.start("launch", start, in_flight, rows)
    note = objective._note_rollout

    def noted(scored, *args, **kwargs):  # the step's scored completions: what it trains on
        trained.append(sorted({c.prompt_index for c in scored.completions}))
        versions.append([c.version for c in scored.completions])
        return note(scored, *args, **kwargs)

    objective._note_rollout = noted
    model, metrics, depths, saved = _Toy(), [], [], []
    for batches in objective.steps(state, loader_steps(0, start)):
        depths.append(len(objective.queue or ()))
        targets = 0
        for micro in batches:
            objective.step_loss(SimpleNamespace(norm=1.0), model, micro.batch, micro.targets)
            targets += micro.targets
        metrics.append(objective.metrics_from_sums(objective.take_sums().tolist(), targets))
        progress.global_step += 1
        progress.step_in_epoch += 1
        now[0] += 10.0
        saved.append(dict(progress.extra[LEDGER]))  # what a checkpoint now would record
        if session is not None and len(metrics) == session:  # a crash after this step
            break
        if progress.global_step >= state.total_steps:  # the loop's end: max_steps
            break
    if session is None:  # the loop's end (not a crash): the last step is trained
        objective.end(state)
    steps = [sorted(order[i * per_step : (i + 1) * per_step]) for i in range(rows // per_step)]
    return SimpleNamespace(objective=objective, engine=objective.engines.engine, trained=trained,
                           versions=versions, metrics=metrics, depths=depths, steps=steps,
                           scored_on=[set(scored_on.get(frozenset(r), ())) for r in trained],
                           saved=saved)  # fmt: skip


def test_stale_completions_are_dropped_counted_and_their_prompts_trained_once(monkeypatch):
    """k=1 with the weights synced every 2 steps: every other step's request was sampled 2
    versions back, so it is dropped (counted) and its prompts sampled again by the policy as it
    is; every prompt of the epoch is trained exactly once, in the loader's order."""
    run = _run(monkeypatch, max_staleness=1, sync_every=2)
    assert run.trained == run.steps  # each step trains its own prompts: none skipped or repeated
    dropped = [m["rollout/stale_dropped"] for m in run.metrics]
    # Step 0 samples now; steps 2 and 4 take requests sent at steps 1 and 3, by versions 0 and
    # 2: two versions back, dropped; steps 1, 3 and 5 take one-step-old ones, kept.
    assert dropped == [0, 0, 4, 0, 4, 0]
    for step, versions in enumerate(run.versions):
        assert all(step - v <= 1 for v in versions)  # never trained beyond the bound
    # The dropped prompts were sampled twice (the stale request, then again), the others once.
    counts: dict[int, int] = {}
    for row, _ in run.engine.sampled:
        counts[row] = counts.get(row, 0) + 1
    again = {r for s in (2, 4) for r in run.steps[s]}
    assert counts == {r: GENERATIONS * (2 if r in again else 1) for rows in run.steps for r in rows}
    stale = [(r, v) for r, v in run.engine.sampled if r in again]
    assert sorted({v for _, v in stale}) == [0, 2, 4]  # old ones dropped, new ones trained
    assert max(run.depths) == 1 and run.depths[-1] == 0  # at most k in flight; drained at the end
    # A request taken whole was scored in the background as soon as it came (the reward tasks
    # ran while the step before trained); a step that sampled prompts again scores them now.
    main, background = threading.main_thread().name, "grpo-rollout"
    assert [run.scored_on[s] for s in (0, 1, 3, 5)] == [{main}] + [{background}] * 3
    assert all(main in run.scored_on[s] for s in (2, 4))  # (the stale request's, wasted)


def test_the_version_of_every_completion_gives_its_age_and_the_queue_stays_bounded(monkeypatch):
    """k=2, synced every step: a step takes completions sampled 1 or 2 versions back (the first
    its own, now), never more; the queue holds at most k requests while a step trains (with the
    step's own, k + 1 steps of rollouts) and its depth, the ages and the overlap are metrics."""
    run = _run(monkeypatch, rows=14, max_staleness=2)
    ages = [[step - v for v in versions] for step, versions in enumerate(run.versions)]
    assert [sorted(set(a)) for a in ages] == [[0], [1], [2], [2], [2], [2], [2]]
    assert [m["rollout/age_max"] for m in run.metrics] == [0, 1, 2, 2, 2, 2, 2]
    assert [m["rollout/age_mean"] for m in run.metrics] == [0, 1, 2, 2, 2, 2, 2]
    assert [m["rollout/age_min"] for m in run.metrics] == [0, 1, 2, 2, 2, 2, 2]
    assert [m["rollout/queue_depth"] for m in run.metrics] == [2, 2, 2, 2, 2, 1, 0]
    assert run.depths == [2, 2, 2, 2, 2, 1, 0]
    assert all(m["rollout/stale_dropped"] == 0 for m in run.metrics)
    # Each request ran 2 s from its submission, within the 10 s steps: all of it overlapped
    # training (the first step's rollout was sampled while the trainer waited: none).
    assert [m["rollout/overlap_seconds"] for m in run.metrics] == [0, 2, 2, 2, 2, 2, 2]
    assert run.metrics[1]["rollout/seconds"] == pytest.approx(2.0, abs=0.5)  # the engine's time
    assert all(not math.isnan(m["reward"]) for m in run.metrics)
    assert run.scored_on == [{threading.main_thread().name}] + [{"grpo-rollout"}] * 6


def test_a_resume_samples_again_the_prompts_whose_requests_were_in_flight(monkeypatch):
    """A crash after step 3 with the requests of steps 4 and 5 in flight (k=2): the checkpoint
    records steps 0-3 trained (the ledger's position), not the requests, so the resumed run
    samples steps 4 and 5 again and every prompt of the epoch is trained exactly once."""
    first = _run(monkeypatch, rows=16, max_staleness=2, session=4)
    assert first.saved[-1]["step_in_epoch"] == 4  # trained steps only
    in_flight = [sorted(req.rows) for req in first.objective.queue.requests]
    assert in_flight == [first.steps[4], first.steps[5]]  # sampled, never trained
    second = _run(monkeypatch, rows=16, max_staleness=2, start=4)
    assert first.trained + second.trained == first.steps  # each once, in order, across both
    assert second.versions[0] == [4] * (2 * GENERATIONS)  # sampled again by the restored policy


def test_the_ledger_trains_every_prompt_once_across_drops_a_lost_request_and_a_crash(
    monkeypatch, tmp_path
):
    """The per-prompt ledger (``<run>/ledger/``) over a session with stale drops (k=1, synced
    every 2 steps), a request lost with its engine, and a crash after step 4 with step 5's
    request in flight, then the resume from that step's checkpoint: read back by prompt, every
    prompt of the epoch was trained exactly once; the drops and the lost request are counted
    against the prompts they hit, and the resume names the step its checkpoint had in flight."""
    folder = tmp_path / "ledger"
    first = _run(monkeypatch, rows=16, sync_every=2, session=4, ledger=(folder, 0, []),
                 die_at={2})  # fmt: skip
    saved = first.saved[-1]
    assert saved["step_in_epoch"] == 4 and saved["in_flight_steps"] == [5]  # 1-based
    second = _run(monkeypatch, rows=16, sync_every=2, start=4, ledger=(folder, 1, [5]))
    assert first.trained + second.trained == first.steps
    segments = read_states(locate(str(folder)))
    assert [(g.attempt, g.restored, g.in_flight_steps) for g in segments] == [
        (0, 0, []),
        (1, 4, [5]),
    ]
    found = audit(segments)
    assert found.problems(16, epochs=[0]) == []  # every prompt once
    # The lost request (the engine's 2nd: step 3's, 1-based) was asked for again.
    assert set(found.requeued) == {(0, r) for r in first.steps[2]}
    # The stale drops, by prompt, are those the metrics counted (each prompt's group whole).
    dropped = sum(m["rollout/stale_dropped"] for m in first.metrics + second.metrics)
    assert dropped > 0 and sum(found.dropped.values()) * GENERATIONS == dropped
    # The crashed session's step 5 request was in flight, never trained: nothing rolled back
    # (the crash came after step 4's checkpoint), and each state a prompt went through is
    # named by its step: queued, in flight, scored, training, trained.
    states = {r["state"] for g in segments for r in g.records}
    assert states == {"queued", "in_flight", "requeued", "dropped", "scored", "training",
                      "trained"}  # fmt: skip
    assert found.rolled_back == 0


@pytest.mark.parametrize("max_staleness, total", [(0, None), (2, 4)])
def test_the_ledger_command_checks_the_epoch_the_run_ended_in(
    monkeypatch, tmp_path, capsys, max_staleness, total
):
    """The objective's own ledger lines of a run that ends cleanly (issue 70, part 6): a
    default run (synchronous, num_epochs=1, no max_steps: its one epoch is the one it ends in)
    and an asynchronous one whose max_steps=4 ends inside the epoch (its read-ahead dealt the
    next steps' prompts to the queue, never to a step). The end line says where the run
    stopped, `ray-trainer ledger` finds every prompt its steps dealt trained once, and fails,
    naming the row and the step, once the final step's `trained` line (written at the run's
    end) is taken out."""
    import json

    from ray_trainer.cli import main

    run_dir = tmp_path / "rl"
    run = _run(monkeypatch, rows=12, per_step=2, max_staleness=max_staleness, total=total,
               ledger=(run_dir / "ledger", 0, []))  # fmt: skip
    last = total or 6
    (segment,) = read_states(locate(str(run_dir / "ledger")))
    assert (segment.end.step, segment.end.step_in_epoch, segment.end.total_steps) == (last,) * 3
    assert segment.end.steps_per_epoch == 6 and segment.end.per_step == 2
    assert main(["ledger", str(run_dir)]) == 0
    due = 2 * last
    assert f"epoch 0: {due} of the {due} prompts its steps dealt trained once" in (
        capsys.readouterr().out
    )
    path = run_dir / "ledger" / "attempt0-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    final = [ln for ln in lines if '"state":"trained"' in ln][-1]
    assert json.loads(final)["step"] == last
    path.write_text("".join(ln for ln in lines if ln != final))
    assert main(["ledger", str(run_dir)]) == 1
    out = capsys.readouterr().out
    named = ", ".join(f"row {r} of step {last}" for r in run.steps[last - 1])
    assert f"never trained: 2 ({named})" in out and "NOT whole" in out


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_objective_records_its_epochs_remainder_and_the_ledger_is_whole(
    monkeypatch, tmp_path, capsys, max_staleness
):
    """13 prompts at 2 a step (issue 74, point 2): 6 steps, and the loader's order leaves its
    last prompt out; the objective's rank 0 notes it (`remainder`, the loader's `left_out`)
    at the epoch's first step, so `ray-trainer ledger` finds the run whole."""
    from ray_trainer.cli import main

    run_dir = tmp_path / "rl"
    run = _run(monkeypatch, rows=13, per_step=2, max_staleness=max_staleness,
               ledger=(run_dir / "ledger", 0, []))  # fmt: skip
    found = audit(read_states(locate(str(run_dir / "ledger"))))
    (left,) = set(range(13)) - {r for rows in run.steps for r in rows}
    assert found.remainder == {0: {left}} and found.problems(13, epochs=[0]) == []
    assert main(["ledger", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "epoch 0: 12 of the 12 prompts its steps dealt trained once (the run's last" in out
    assert f"dropped (epoch remainder) 1: rows [{left}]" in out and "whole: every" in out


def test_no_rollout_is_requested_past_the_runs_last_step(monkeypatch):
    """max_steps inside an epoch: the steps after it are never requested (nor scored)."""
    run = _run(monkeypatch, rows=14, max_staleness=2, total=4)
    assert run.trained == run.steps[:4]
    assert {r for r, _ in run.engine.sampled} == {r for rows in run.steps[:4] for r in rows}
    assert run.depths == [2, 2, 1, 0]


def _score(step, completions):
    return [c.prompt_index for c in completions]


def test_a_request_whose_engine_died_with_none_left_has_its_prompts_sampled_again():
    """The answer of a dead engine's request, no other engine serving: its rows are all
    missing, nothing is dropped as stale, and the queue goes on with the next request."""
    engine = _Engine()
    engine.version = 3
    engine.die_at = {1}
    params = SimpleNamespace(num_generations=2)
    queue = RolloutQueue(2, _score)
    queue.serve({0: engine})

    queue.submit(1, 0, engine, [5, 6], [[1], [2]], params)
    queue.submit(2, 0, engine, [7], [[3]], params)
    with pytest.raises(RuntimeError, match="in flight already"):
        queue.submit(3, 0, engine, [8], [[4]], params)
    lost = queue.take([5, 6], trainer_version=4)
    assert lost.died and lost.missing == [5, 6] and lost.kept == [] and lost.dropped == 0
    assert lost.scored is None and lost.resent == []  # the step samples and scores them itself
    kept = queue.take([7], trainer_version=4)
    assert kept.missing == [] and [c.prompt_index for c in kept.kept] == [7, 7]
    assert kept.scored == [7, 7] and kept.reward_s >= 0  # scored in the background
    assert queue.take([9], trainer_version=4).missing == [9]  # nothing requested: sample now
    with pytest.raises(RuntimeError, match="lost the loader's order"):
        queue.submit(4, 0, engine, [1], [[1]], params)
        queue.take([2], trainer_version=4)


def test_the_queue_sends_a_lost_engines_request_again_to_an_engine_left():
    """Two ranks' queues share the serving engines: rank 1's request to a dead engine goes,
    by the queue itself, to the serving engine left (as a rank is assigned: ``rank % n`` of
    those left), its answer scored there; an engine that dies in turn passes it on again, and
    with none left the rows come back to the trainer, each re-send named for the ledger."""
    dead, a, b = _Engine(), _Engine(), _Engine()
    dead.die_at, a.version, b.version = {1}, 5, 5
    serving = Serving()
    serving.set({0: a, 1: dead, 2: b})
    ranks = [RolloutQueue(1, _score, rank=r, serving=serving) for r in range(2)]
    params = SimpleNamespace(num_generations=2)
    ranks[1].submit(6, 1, dead, [3, 4], [[1], [2]], params)
    taken = ranks[1].take([3, 4], trainer_version=6)
    assert taken.resent == [2] and not taken.died and taken.missing == []  # {0, 2}[1 % 2]
    assert sorted({r for r, _ in b.sampled}) == [3, 4] and a.sampled == []
    assert taken.scored == [3, 3, 4, 4] and {c.version for c in taken.kept} == {5}

    # Every engine lost in turn (the dead one still listed: rank 0 has not heard yet): the
    # request tries each serving slot once, then its rows come back to the trainer.
    b.die_at, a.die_at, dead.die_at = {2}, {1}, {1, 2}
    ranks[0].submit(7, 2, b, [8], [[3]], params)
    both = ranks[0].take([8], trainer_version=7)
    assert both.resent == [0, 1] and both.died and both.missing == [8] and both.kept == []


def test_a_reward_functions_error_in_the_background_fails_the_step_that_takes_it():
    from ray_trainer._rollout.rewards import RewardError

    def score(step, completions):
        raise RewardError("reward function 'exact' raised on completion 1 (prompt 4)")

    queue, engine = RolloutQueue(1, score), _Engine()
    engine.version = 0
    queue.submit(1, 0, engine, [4], [[1]], SimpleNamespace(num_generations=2))
    with pytest.raises(RewardError, match="'exact' raised on completion 1"):
        queue.take([4], trainer_version=1)


def test_split_stale_drops_whole_groups_by_prompt():
    comps = [Completion(p, [1], [2], [-0.1], False, v) for p, v in ((0, 5), (0, 3), (1, 4), (1, 5))]
    kept, rows, dropped = split_stale(comps, trainer_version=5, max_staleness=1)
    assert rows == [0] and dropped == 2  # prompt 0's group goes whole: one completion was old
    assert [(c.prompt_index, c.version) for c in kept] == [(1, 4), (1, 5)]


@pytest.mark.parametrize(
    "value, expected",
    [(-1, "got -1"), (1.5, "got 1.5"), (True, "got True"), ("two", "got 'two'")],
)
def test_max_staleness_is_refused_before_ray_naming_the_field(value, expected):
    with pytest.raises(TrainingArgsError, match=r"max_staleness") as e:
        TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                            reward_fns=[_zero], max_staleness=value)  # fmt: skip
    assert expected in str(e.value)


def test_max_staleness_belongs_to_grpo_and_is_refused_under_another_objective():
    with pytest.raises(TrainingArgsError, match=r"max_staleness set with objective='sft'"):
        TrainingArgs.coerce(data="p.jsonl", model="m", max_staleness=1)


def test_max_staleness_with_several_passes_is_refused_with_the_fix():
    with pytest.raises(TrainingArgsError, match=r"max_staleness=1 with grpo\.num_iterations=2"):
        TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m", reward_fns=[_zero],
                            grpo={"num_iterations": 2}, max_staleness=1)  # fmt: skip


def test_zero_is_the_synchronous_step_and_the_queue_refuses_it():
    assert GrpoObjective(TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                                             reward_fns=[_zero])).queue is None  # fmt: skip
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        RolloutQueue(0)


def test_the_queues_metrics_are_named_for_the_trackers_only_when_asynchronous():
    from ray_trainer._objectives.grpo import ASYNC_METRICS, run_metrics

    def args(**fields):
        return TrainingArgs.coerce(objective="grpo", data="p.jsonl", model="m",
                                   reward_fns=[_zero], **fields)  # fmt: skip

    assert set(ASYNC_METRICS) <= set(run_metrics(args(max_staleness=2)))
    assert not set(ASYNC_METRICS) & set(run_metrics(args()))
