"""Test process: training runs that several integration modules read, each run once per session.

A fixture here trains one configuration and returns what its tests assert on; every module that
reads that configuration asks for the fixture (``tests/integration/conftest.py`` imports them),
so the run's Ray Train start-up, its steps and its restart are paid once, not per module.

`fsdp_runs`: a tiny GPT-2 on 2 gloo workers from one seed, three runs.

* ``fsdp``: FSDP2 with asynchronous checkpoints every 2 steps, written through a filesystem that
  writes slowly (`slow_storage.py`, as network storage) and kills rank 1 while it writes its
  shard of the step-4 checkpoint: the run resumes from its sharded step-2 checkpoint. Each
  checkpoint's ``hf/`` export is opened with ``from_pretrained`` in an ``EvalOnSave`` task.
  Read by ``test_fsdp.py`` (shards, the resume, the exports) and ``test_async_checkpoint.py``
  (steps during a write, ``on_save`` after every rank's files, a crash mid-write).
* ``one``: that run continued by one worker with activation checkpointing (DCP reshards).
* ``ddp``: DDP from the same seed with activation checkpointing and asynchronous checkpoints to a
  local folder, 4 steps: the same losses as FSDP's (``test_fsdp.py``), and its exports
  (``test_async_checkpoint.py``).

`evals_run`: one tiny run (`rt_support.tiny_run`, 15 steps, a save every 5) with four
``EvalOnSave`` of their own at each save: one held until training took 2 more steps, one that
raises, one that hangs past its timeout, one a callable object. Read by ``test_eval_on_save.py``
(one evaluation per save, in step order, without the loop waiting) and ``test_faults.py``
(failing and hanging evaluations recorded, the end not held).

`crash_then_resume`: a tiny run without retries whose rank 1 is killed at step 3 (it fails with
its step-2 checkpoint), then a new call that resumes it to step 10 with an actor-side ``async``
``on_log`` that hangs and stateful callbacks whose state cannot be pickled. Read by
``test_faults.py`` (the failure, the actor's events, the resume) and
``test_callback_actor.py`` (the hung hook cancelled and recorded, the state left out).
"""

from __future__ import annotations

import json
import time

import pytest
from rt_support import (
    ActorRecorder,
    AllRanksRecorder,
    CallableEval,
    HangingAsyncLogger,
    HeldEval,
    KillRank1Once,
    LockLaterActor,
    LockLaterRank0,
    ShardProbe,
    SlowSteps,
    eval_hf_export,
    hanging_eval,
    raising_eval,
    read_records,
    tiny_run,
)
from slow_storage import CompleteAtOnSave, slow_filesystem

from callbacks import EvalOnSave

TEXTS = [
    "the cat sat on the mat",
    "what did the dog do ? it ran home",
    "the dog sat on the mat and the cat ran home",
]


def _lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f.read().splitlines()]


@pytest.fixture(scope="session")
def fsdp_runs(ray_session, tmp_path_factory):
    from ray_trainer import run_training
    from ray_trainer.demo import make_tiny_causal_lm

    tmp = tmp_path_factory.mktemp("fsdp-runs")
    # 4 blocks, no dropout: DDP and FSDP must compute the same thing.
    model = str(make_tiny_causal_lm(tmp / "gpt2", n_layer=4, n_embd=32, dropout=0.0))
    data = tmp / "train.jsonl"
    data.write_text("".join(json.dumps({"text": TEXTS[i % 3]}) + "\n" for i in range(240)))
    folder = str(tmp / "records")
    common = dict(
        model=model,
        data=str(data),
        batch_size=4,
        max_length=16,
        learning_rate=3e-3,
        lr_schedule="constant",  # the DDP run is shorter: the same learning rate at each step
        mixed_precision="no",
        log_every_steps=1,
        seed=7,
        async_checkpoint=True,
        save_every_steps=2,
    )
    slow_storage = str(tmp / "slow")
    fsdp = run_training(
        **common,
        strategy="fsdp",
        num_workers=2,
        max_steps=6,
        max_failures=1,
        storage_path=slow_storage,
        storage_filesystem=slow_filesystem(
            per_file_s=0.15,
            crash_on="checkpoint_00000004/shards/__1_0.distcp",
            crash_marker=str(tmp / "crashed"),
        ),
        run_name="fsdp",
        callbacks=[
            AllRanksRecorder(folder, prefix="fsdp"),
            ShardProbe(folder),
            CompleteAtOnSave(str(tmp / "fsdp-on-save.jsonl")),
            EvalOnSave(eval_hf_export, num_gpus=0),
        ],
    )
    fsdp_records = read_records(folder, "fsdp")
    # The same run continued by one worker, with activation checkpointing on.
    one = run_training(
        **common,
        strategy="fsdp",
        num_workers=1,
        max_steps=8,
        activation_checkpointing=True,
        storage_path=slow_storage,
        storage_filesystem=slow_filesystem(),
        run_name="fsdp",
        callbacks=[AllRanksRecorder(folder, prefix="one")],
    )
    ddp = run_training(
        **common,
        strategy="ddp",
        num_workers=2,
        max_steps=4,
        activation_checkpointing=True,
        storage_path=str(tmp / "local"),
        run_name="ddp",
        callbacks=[
            AllRanksRecorder(folder, prefix="ddp"),
            CompleteAtOnSave(str(tmp / "ddp-on-save.jsonl")),
            EvalOnSave(eval_hf_export, num_gpus=0),
        ],
    )
    crashed = tmp / "crashed"
    return {
        "fsdp": fsdp,
        "one": one,
        "ddp": ddp,
        "fsdp_records": fsdp_records,
        "one_records": read_records(folder, "one"),
        "ddp_records": read_records(folder, "ddp"),
        "shards": read_records(folder, "shards"),
        "on_save": {k: _lines(tmp / f"{k}-on-save.jsonl") for k in ("fsdp", "ddp")},
        "crashed": crashed.read_text() if crashed.exists() else "",
    }


#: The steps of `evals_run` and its save period: one evaluation of each kind per save.
EVALS_STEPS, EVALS_SAVE_EVERY = 15, 5


@pytest.fixture(scope="session")
def evals_run(ray_session, tmp_path_factory):
    from ray_trainer import run_training

    tmp = tmp_path_factory.mktemp("evals-run")
    folder = str(tmp / "records")
    started = time.monotonic()
    result = run_training(
        **tiny_run(
            tmp,
            max_steps=EVALS_STEPS,
            save_every_steps=EVALS_SAVE_EVERY,
            run_name="evals",
            # 12 evaluation tasks on the 2 CPUs the workers leave: they may queue behind each
            # other (and behind their workers' start on a loaded machine) at the end.
            eval_timeout_s=60,
            callbacks=[
                AllRanksRecorder(folder),
                SlowSteps(0.05),
                # Each evaluation lasts until training has taken 2 more steps.
                EvalOnSave(HeldEval(folder, max_steps=EVALS_STEPS), num_gpus=0, num_cpus=1),
                EvalOnSave(raising_eval, num_gpus=0),
                EvalOnSave(hanging_eval, num_gpus=0, timeout_s=2),
                EvalOnSave(CallableEval(1000), num_gpus=0),  # a callable object works too
            ],
        )
    )
    return {"result": result, "seconds": time.monotonic() - started}


@pytest.fixture(scope="session")
def crash_then_resume(ray_session, tmp_path_factory):
    from ray_trainer import RunFailedError, run_training

    tmp = tmp_path_factory.mktemp("crash-then-resume")
    crash_folder, resume_folder = str(tmp / "crash-records"), str(tmp / "resume-records")
    try:
        run_training(
            **tiny_run(
                tmp,
                max_steps=8,
                save_every_steps=2,
                max_failures=0,
                run_name="crash-no-retry",
                callbacks=[KillRank1Once(3), ActorRecorder(crash_folder)],
            )
        )
    except RunFailedError as e:
        failure: RunFailedError | None = e
    else:
        failure = None
    # A new call resumes it from its step-2 checkpoint; its actor's `on_log` hangs (each cut at
    # the hook timeout) and two callbacks' state cannot be pickled once training began.
    timeout = 2.0
    started = time.monotonic()
    resumed = run_training(
        **tiny_run(
            tmp,
            max_steps=10,
            save_every_steps=5,
            log_every_steps=5,
            run_name="crash-no-retry",
            callbacks=[
                HangingAsyncLogger(),
                ActorRecorder(resume_folder),
                LockLaterRank0(),
                LockLaterActor(),
            ],
            callback_timeout_s=timeout,
            eval_timeout_s=5,
        )
    )
    return {
        "failure": failure,
        "crash_records": read_records(crash_folder, "actor"),
        "resumed": resumed,
        "resumed_seconds": time.monotonic() - started,
        "resumed_records": read_records(resume_folder, "actor"),
        "hook_timeout": timeout,
    }
