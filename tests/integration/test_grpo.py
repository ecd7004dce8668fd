"""Online RL end to end (issue 50): GRPO on 2 gloo workers of a real local Ray, DDP + LoRA, one
``hf`` rollout engine on a fractional CPU, a reward function run as a Ray task.

One run, with ``grpo.beta > 0`` (the KL against the base with the LoRA adapters off), the
completions packed (``packing=True``), the reward task on a quarter CPU (``reward_resources``)
and asynchronous rollouts (``max_staleness=1``, issue 51: a step's rollout is requested
while the step before trains) from elastic engines (``rollout_workers=(1, 2)``): rank 1's
engine actor is killed once (after step 1, its request in flight: step 2 goes on with the
engine left, rank 1's prompts sampled there, with no restart of the worker group; the
replacement joins at step 3 with the latest weights before its first request), and rank 1 is
killed once (after step 3: the run resumes from its step-2 checkpoint, the engines of the new
worker group get the restored weights). What it shows: the metrics with TRL's names are logged with finite
values, ``kl`` among them (> 0 once the adapters have moved); every completion was sampled by
the policy of its step or the one before (the engine's version advances each step), never
older, none dropped, and a step's rollout was sampled while the step before trained
(``rollout/overlap_seconds``); ``rollout/logprob_diff`` < 1e-5 (fp32, after every sync);
``rollouts.jsonl`` is written; each reward task ran on the resources it was given; and the
prompts scored, step by step, are exactly the loader's epoch order: none skipped or repeated
across the crash, and the second epoch starts over in its own order.
"""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import ray
from rt_support import KillRank1Once, read_records
from waiting import wait_until

from callbacks import TrainerCallback

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
PROMPTS, PER_STEP, STEPS, SEED = 12, 4, 4, 3  # 3 steps an epoch: step 4 starts epoch 2
BETA = 0.04  # the KL against the base with the adapters off


def scored_to(folder: str):
    """A reward function (a Ray task per step) that records each prompt it scores, by step."""

    def scored(prompts, completions, completion_ids, trainer_state, id, **kwargs):
        cpu = ray.get_runtime_context().get_assigned_resources().get("CPU")  # reward_resources
        with open(os.path.join(folder, f"scored-{os.getpid()}.jsonl"), "a") as f:
            for i in sorted(set(id)):
                record = {"step": trainer_state.global_step, "id": i, "cpu": cpu}
                f.write(json.dumps(record) + "\n")
        return [float(c[0] % 2) if c else 0.0 for c in completion_ids]  # varies in a group

    return scored


class Logs(TrainerCallback):
    """Rank 0: every log's metrics, with the attempt."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_log(self, context, **kwargs):
        with open(os.path.join(self.folder, f"logs-{os.getpid()}.jsonl"), "a") as f:
            record = {"step": context.global_step, "loss": context.loss, "attempt": context.attempt}
            f.write(json.dumps({**record, **(context.batch_metrics or {})}) + "\n")


class ActorLogs(Logs):
    """The callback actor: every log's metrics (GRPO's among them)."""

    runs_on = "actor"


class KillEngineOnce(TrainerCallback):
    """Rank 0, first attempt: both engines up before step 1 (so both serve from it); at the end
    of step 1 rank 1's engine (slot 1) is killed, and this waits until its death is known; at
    the end of step 2, until its replacement (slot 1, generation 1) answers, so that it joins
    at step 3, and the callback actor is killed (Ray restarts it); at the end of step 3 the
    replacement's ``info`` (the version it holds, the requests it answered) is recorded with the
    seconds these waits held training (prefix "joiner")."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.held_s = 0.0

    def _wait(self, predicate, what: str) -> None:
        started = time.perf_counter()
        wait_until(predicate, 60, what)
        self.held_s += time.perf_counter() - started

    def on_train_begin(self, context, **kwargs):
        if context.attempt == 0:
            for index in (0, 1):
                self._wait(lambda i=index: _answers(i, 0), f"rollout engine {index} up")

    def on_step_end(self, context, **kwargs):
        if context.attempt != 0:
            return
        if context.global_step == 1:
            ray.kill(_engine(1, 0))
            self._wait(lambda: _answers(1, 0) is None, "the killed engine's death known")
        elif context.global_step == 2:
            self._wait(lambda: _answers(1, 1), "the replacement engine up")
            from ray_trainer._contract import NAMESPACE, actor_name

            ray.kill(ray.get_actor(actor_name("grpo"), namespace=NAMESPACE), no_restart=False)
        elif context.global_step == 3:
            record = {**_answers(1, 1), "held_s": self.held_s}
            with open(os.path.join(self.folder, f"joiner-{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")


def _engines(kind: str = ":rollout:") -> list[dict]:
    return [a for a in ray.util.list_named_actors(all_namespaces=True) if kind in a["name"]]


def _engine(index: int, generation: int):
    """The handle of engine `index`'s `generation` of the first worker-group start."""
    (found,) = [a for a in _engines() if a["name"].endswith(f":rollout:0:{generation}:{index}")]
    return ray.get_actor(found["name"], namespace=found["namespace"])


def _answers(index: int, generation: int) -> dict | None:
    """The engine's ``info`` (None: dead, or not started yet)."""
    try:
        return ray.get(_engine(index, generation).info.remote(), timeout=30)
    except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


@pytest.fixture(scope="module")
def run(ray_session, tmp_path_factory):
    from ray_trainer import run_training
    from ray_trainer._demo.chat import make_tiny_chat_model

    root = tmp_path_factory.mktemp("grpo")
    model = str(make_tiny_chat_model(root / "model", style="chatml"))
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(PROMPTS):
            prompt = [{"role": "user", "content": f"Count to {i % 5}."}]
            f.write(json.dumps({"prompt": prompt, "id": i}) + "\n")
    folder = root / "records"
    (folder / "actor").mkdir(parents=True)
    result = run_training(
        objective="grpo", model=model, data=str(root / "prompts.jsonl"), run_name="grpo",
        reward_fns=[scored_to(str(folder))], lora=LORA, seed=SEED,
        grpo={"num_generations": 2, "max_completion_length": 6, "log_completions": True,
              "beta": BETA},
        max_staleness=1, rollout_workers=(1, 2),
        reward_resources={"CPU": 0.25}, rollout_backend="hf", rollout_resources={"CPU": 0.5},
        max_length=48, num_workers=2, packing=True,
        batch_size=2, max_steps=STEPS, save_every_steps=2, max_failures=1, learning_rate=1e-3,
        log_every_steps=1, storage_path=str(root / "storage"), dashboard=False,
        callbacks=[Logs(str(folder)), ActorLogs(str(folder / "actor")), KillRank1Once(step=3),
                   KillEngineOnce(str(folder))],
    )  # fmt: skip
    return root, folder, result


def test_grpo_trains_with_trls_metrics_on_policy(run):
    root, folder, result = run
    assert result.global_step == STEPS and result.attempts == 2
    logs = read_records(str(folder), "logs")
    last = {r["step"]: r for r in logs}  # a step run again after the crash: its last log
    assert sorted(last) == list(range(1, STEPS + 1))
    for step, record in last.items():
        for name in ("loss", "reward", "reward_std", "rewards/scored/mean", "entropy",
                     "completions/mean_length", "completions/clipped_ratio",
                     "clip_ratio/region_mean", "rollout/seconds", "rollout/tokens_per_s",
                     "reward/seconds", "sync/seconds", "sync/bytes"):  # fmt: skip
            assert math.isfinite(record[name]), (step, name, record[name])
        assert record["sync/bytes"] > 0  # the adapter, every step (sync_every=1)
        # beta > 0: the KL against the adapters-off base, 0 while the adapters are (LoRA's B
        # starts at zero), > 0 once a step has moved them.
        assert math.isfinite(record["kl"]) and record["kl"] >= 0, (step, record["kl"])
        assert record["kl"] > 0 or step == 1, (step, record["kl"])
        assert record["trained_tokens"] > 0
        # The engine holds the trainer's weights: the probe's log-probs agree in fp32.
        assert record["rollout/logprob_diff"] < 1e-5, (step, record["rollout/logprob_diff"])
    # Advantages, and a gradient (the loss itself is 0 at ratio 1 when a group's lengths match).
    assert any(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in logs)
    # The killed engine was replaced in the background (counted from then on) while the run
    # went on without a restart (attempt 0 reached step 3; its one restart is rank 1's kill):
    # 2 engines served at step 1, 1 at step 2 (rank 1's prompts sampled on the engine left),
    # 2 again at step 3, the replacement synced to the latest weights (version 2, the step's)
    # on joining, before any request (step 3 ends the epoch: its first request is step 4's,
    # after the crash; that a joiner syncs before its first request: test_grpo_pool.py).
    assert any(r.get("rollout/engine_restarts", 0) >= 1 for r in logs if r["attempt"] == 0)
    first = {r["step"]: r for r in logs if r["attempt"] == 0}
    assert sorted(first) == [1, 2, 3]
    assert [first[s]["rollout/engines"] for s in (1, 2, 3)] == [2, 1, 2], first
    (joiner,) = read_records(str(folder), "joiner")
    assert joiner["version"] == 2 and joiner["requests"] == 0, joiner
    # The engines ended with their worker group (rank 0 owns them): none is left holding a CPU;
    # so did each worker-group start's rollout queue actor (max_staleness=1).
    wait_until(lambda: not _engines(), 30, "the rollout engines to end")
    wait_until(lambda: not _engines(":rollouts:"), 30, "the rollout queue's actors to end")
    rollouts = [json.loads(line) for line in (root / "storage" / "grpo" / "rollouts.jsonl").open()]
    assert {r["step"] for r in rollouts} == set(range(1, STEPS + 1))
    for r in rollouts:  # sampled by the policy of its step or the one before (max_staleness=1)
        assert r["step"] - 1 - r["version"] in (0, 1), r
        assert set(r) >= {"prompt", "completion", "rewards", "advantage"}
    # Step 3 before the crash trained the rollout requested (by version 1) while step 2 trained.
    assert any(r["step"] - 1 - r["version"] == 1 for r in rollouts), rollouts
    # Asynchronous rollouts: within the bound, none dropped (synced every step), at most one
    # request in flight; an epoch's (or a start's) first step samples its own rollout (age 0).
    for record in last.values():
        assert record["rollout/age_max"] <= 1 and record["rollout/stale_dropped"] == 0, record
        assert record["rollout/queue_depth"] <= 1, record
    assert last[1]["rollout/age_max"] == 0 and last[4]["rollout/age_max"] == 0
    # Before the crash, steps 2 and 3 took rollouts requested a step earlier: at least one of
    # them (the engine was killed after step 1, so step 2's request may have died with it) was
    # sampled while the step before trained, and is one version old.
    early = [r for r in logs if r["attempt"] == 0 and r["step"] in (2, 3)]
    assert any(r["rollout/overlap_seconds"] > 0 and r["rollout/age_max"] == 1 for r in early), early


def test_no_prompt_is_skipped_or_repeated_across_the_crash(run):
    from ray_trainer._data.packing import epoch_order

    _, folder, _ = run
    scored: dict[int, set[int]] = {}
    times: dict[int, int] = {}
    for record in read_records(str(folder), "scored"):
        scored.setdefault(record["step"], set()).add(record["id"])
        times[record["step"]] = times.get(record["step"], 0) + 1
    per_epoch = PROMPTS // PER_STEP
    expected = {}
    for s in range(STEPS):  # each epoch a new seeded order, from its first prompt again
        order, i = epoch_order(PROMPTS, SEED, s // per_epoch).tolist(), s % per_epoch
        expected[s] = set(order[i * PER_STEP : (i + 1) * PER_STEP])
    assert scored == expected
    # Each reward task ran on the resources reward_resources gave it, not the default CPU.
    assert {r["cpu"] for r in read_records(str(folder), "scored")} == {0.25}
    # Only step 3 (rolled out at global_step 2), after the step-2 checkpoint, was scored twice:
    # before the crash and again after the resume, with the same prompts.
    assert times == {s: PER_STEP * (2 if s == 2 else 1) for s in range(STEPS)}


def test_the_ledger_trains_every_prompt_once_after_the_combined_faults(run, tmp_path, capsys):
    """The run's own per-prompt ledger (``<run>/ledger/``, one file per rank and worker-group
    start) after an engine killed with a request in flight, the callback actor killed and
    restarted, and rank 1 killed (the run resumed from its step-2 checkpoint): read back by
    prompt id, every prompt of the first epoch was trained exactly once, and the second epoch's
    first step's four once; step 3's training before the crash was rolled back. The run ended
    at its max_steps inside the second epoch, which `ray-trainer ledger` checks too: a copy of
    the ledger without the final step's `trained` line of one rank fails, naming the step."""
    from ray_trainer._data.packing import epoch_order
    from ray_trainer._objectives.grpo_ledger import audit, read_states
    from ray_trainer._storage import locate

    root, folder, _ = run
    segments = read_states(locate(str(root / "storage" / "grpo" / "ledger")))
    # Two worker-group starts of two ranks: the first from scratch, the second from step 2.
    assert sorted((g.attempt, g.rank, g.restored) for g in segments) == [
        (0, 0, 0), (0, 1, 0), (1, 0, 2), (1, 1, 2)
    ]  # fmt: skip
    # The step-2 checkpoint held the queue's state: step 3's rollout in flight (asked again).
    assert [g.in_flight_steps for g in segments if g.attempt == 1] == [[3], [3]]
    found = audit(segments)
    ids = [json.loads(line)["id"] for line in (root / "prompts.jsonl").open()]
    assert ids == list(range(PROMPTS))  # the data's "id" column is its row
    assert found.problems(PROMPTS, epochs=[0]) == []
    second = epoch_order(PROMPTS, SEED, 1).tolist()[:PER_STEP]
    assert {row for (epoch, row) in found.trained if epoch == 1} == set(second)
    assert found.rolled_back == PER_STEP  # step 3, trained before the crash, again after it
    assert not found.dropped  # synced every step: nothing stale
    # The killed engine's request, if it was still in flight (step 2's or 3's, rank 1's prompts),
    # was asked for again, on the engine left.
    order = epoch_order(PROMPTS, SEED, 0).tolist()
    assert {row for (_, row) in found.requeued} <= set(order[PER_STEP : 3 * PER_STEP])
    # Every record names a state of the ledger and the steps it trained are the run's.
    from ray_trainer._objectives.grpo_ledger import STATES

    assert {r["state"] for g in segments for r in g.records} <= set(STATES)
    # The callback actor was killed after step 2 and restarted by Ray: two processes saw the
    # logs, and between them every step's.
    # `ray-trainer ledger` says so too.
    from ray_trainer.cli import main

    assert main(["ledger", "grpo", "--storage-path", str(root / "storage")]) == 0
    out = capsys.readouterr().out
    assert f"the run ended after step {STEPS} of {STEPS} (its max_steps)" in out
    assert f"epoch 1: {PER_STEP} of the {PER_STEP} prompts its steps dealt trained once" in out
    import shutil

    copy = tmp_path / "grpo"
    shutil.copytree(root / "storage" / "grpo" / "ledger", copy / "ledger")
    path = copy / "ledger" / "attempt1-rank0.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    final = [ln for ln in lines if json.loads(ln)["state"] == "trained"][-1]
    assert json.loads(final)["step"] == STEPS  # written at the run's end
    path.write_text("".join(ln for ln in lines if ln != final))
    assert main(["ledger", str(copy)]) == 1
    assert f"of step {STEPS})" in capsys.readouterr().out
    assert len(list((folder / "actor").glob("logs-*.jsonl"))) == 2  # one file per process
    assert {r["step"] for r in read_records(str(folder / "actor"), "logs")} >= {1, 4}


# -- FSDP2, full-weight sync, composed ------------------------------------------------------------

FSDP_STEPS = 4  # num_iterations=2: rollouts at steps 1 and 3, each trained on twice


def parity(prompts, completions, completion_ids, **kwargs):
    return [float(c[0] % 2) if c else 0.0 for c in completion_ids]


def checkpoint_step(checkpoint_path: str, step: int) -> dict:
    """An ``EvalOnSave`` task: the step its checkpoint holds."""
    with open(os.path.join(checkpoint_path, "trainer_state.json")) as f:
        return {"checkpoint_step": float(json.load(f)["global_step"])}


@pytest.fixture(scope="module")
def fsdp_run(ray_session, tmp_path_factory):
    """2 workers under FSDP2 with no LoRA (each sync gathers and sends the full weights), the
    completions packed, two optimizer passes over each rollout (``num_iterations=2``), an
    asynchronous save at the end evaluated by an ``EvalOnSave`` task, and callbacks on rank 0
    and in the callback actor."""
    from callbacks import EvalOnSave
    from ray_trainer import run_training
    from ray_trainer._demo.chat import make_tiny_chat_model

    root = tmp_path_factory.mktemp("grpo-fsdp")
    model = str(make_tiny_chat_model(root / "model", style="chatml"))
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Count to {i}."}) + "\n")
    folder = root / "records"
    (folder / "actor").mkdir(parents=True)
    result = run_training(
        objective="grpo", model=model, data=str(root / "prompts.jsonl"), run_name="grpo-fsdp",
        reward_fns=[parity], strategy="fsdp", seed=SEED, packing=True, async_checkpoint=True,
        grpo={"num_generations": 2, "max_completion_length": 4, "num_iterations": 2},
        rollout_backend="hf", rollout_resources={"CPU": 0.5}, reward_resources={"CPU": 0.25},
        max_length=40, num_workers=2, batch_size=2, max_steps=FSDP_STEPS, learning_rate=1e-2,
        save_every_steps=FSDP_STEPS, log_every_steps=1, storage_path=str(root / "storage"),
        dashboard=False,
        callbacks=[Logs(str(folder)), ActorLogs(str(folder / "actor")),
                   EvalOnSave(checkpoint_step, num_gpus=0, num_cpus=0.25)],
    )  # fmt: skip
    return model, folder, result


def test_fsdp2_full_syncs_with_async_saves_evaluations_and_callbacks(fsdp_run, capsys):
    from transformers import AutoModelForCausalLM

    model, folder, result = fsdp_run
    assert result.global_step == FSDP_STEPS
    full = sum(p.numel() * 4 for p in AutoModelForCausalLM.from_pretrained(model).parameters())
    logs = {r["step"]: r for r in read_records(str(folder), "logs")}
    assert sorted(logs) == list(range(1, FSDP_STEPS + 1))
    for step in (1, 3):  # a rollout: the full weights gathered from FSDP2's shards, fp32
        assert logs[step]["sync/bytes"] >= full * 0.9, (step, logs[step]["sync/bytes"], full)
        assert logs[step]["rollout/logprob_diff"] <= 1e-5, logs[step]
    for step in (2, 4):  # the second pass over the same completions: no sync, same rewards
        assert "sync/bytes" not in logs[step]
        assert logs[step]["reward"] == logs[step - 1]["reward"]
    # A first pass's ratio is 1 (old log-probs: its own); the second pass's moved off it (old
    # log-probs: the first pass's, the policy has taken a step since) and clipping bites.
    assert [logs[s]["clip_ratio/region_mean"] for s in (1, 3)] == [0.0, 0.0]
    assert all(logs[s]["clip_ratio/region_mean"] > 0 for s in (2, 4)), logs
    assert all(r["trained_tokens"] > 0 and r["grad_norm"] > 0 for r in logs.values())
    # The asynchronous save at the end was evaluated by its task, on that checkpoint.
    evaluated = [e for e in result.evaluations if "metrics" in e]
    assert [(e["step"], e["metrics"]["checkpoint_step"]) for e in evaluated] == [(4, 4.0)]
    # The callback actor saw GRPO's metrics as rank 0 did.
    seen = {r["step"]: r for r in read_records(str(folder / "actor"), "logs")}
    assert sorted(seen) == sorted(logs)
    for name in ("reward", "clip_ratio/region_mean", "completions/mean_length", "entropy"):
        assert all(seen[s][name] == pytest.approx(logs[s][name]) for s in seen), name
    # Its ledger: two passes a rollout, the run ended at the last step of its only epoch, which
    # is checked like any other (each of the 8 prompts trained once, by its rollout's 2nd pass).
    from ray_trainer.cli import main

    assert main(["ledger", str(folder.parent / "storage" / "grpo-fsdp")]) == 0
    assert "epoch 0: 8 of the 8 prompts its steps dealt trained once" in capsys.readouterr().out
