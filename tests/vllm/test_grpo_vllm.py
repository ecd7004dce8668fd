"""The GRPO loop with a ``"vllm"`` rollout engine, end to end (`make test-vllm`, issue 50).

One short run of `run_training(objective="grpo", rollout_backend="vllm")` in a local Ray: one
training worker, a tiny Llama with LoRA (so each step's sync sends the adapter alone, loaded by
vLLM under a new LoRA id), one vLLM engine on CPU in its rollout actor (the generation child
under the vLLM env's python), a reward function as a Ray task. What it shows: the engine that
served the steps is vLLM's (its actor's `info()`), every completion was sampled by the policy of
its step (versions advance, one per optimizer step), the adapter alone was synced every step,
and ``rollout/logprob_diff`` (vLLM's prompt log-probs of the probe against the trainer's
forward) is reported after every sync and small. The engine start takes a minute or more on 2
cores.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from support_paths import pythonpath
from waiting import wait_until

from callbacks import TrainerCallback

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
STEPS = 3
#: fp32 on CPU: vLLM's kernels against transformers' forward on the same weights (the probe).
LOGPROB_BOUND = 1e-3


def varied(prompts, completions, completion_ids, **kwargs):
    """A reward that differs within a group (so advantages, and a gradient, are not all 0)."""
    return [float(len(ids) % 3) + (ids[0] % 2 if ids else 0) for ids in completion_ids]


class Watch(TrainerCallback):
    """Rank 0: each log's metrics, and after each step what its rollout engines say they are."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _write(self, record: dict) -> None:
        with open(os.path.join(self.folder, "watch.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_log(self, context, **kwargs):
        self._write({"kind": "log", "step": context.global_step, **(context.batch_metrics or {})})

    def on_step_end(self, context, **kwargs):
        import ray

        for named in ray.util.list_named_actors(all_namespaces=True):
            if ":rollout:" in named["name"]:
                actor = ray.get_actor(named["name"], namespace=named["namespace"])
                info = ray.get(actor.info.remote(), timeout=120)
                self._write({"kind": "engine", "step": context.global_step, **info})


@pytest.fixture(scope="module")
def ray_session():
    import ray

    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    # Ray's workers start at niceness 15: on a shared, loaded machine the engine's start (a
    # minute idle) would wait for the cores far longer.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # The worker, the engine and the reward task: a CPU each.
    here = str(Path(__file__).parent)
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": pythonpath(here)}})  # fmt: skip
    yield ray
    ray.shutdown()


def _run(models, tmp_path, run_name, prompts, completion_tokens, max_length, steps, **fields):
    """One GRPO run on a vLLM engine (one worker, LoRA, `prompts` prompts); its result and the
    records its `Watch` wrote."""
    from ray_trainer import run_training

    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(prompts):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Count to {i}."}]}) + "\n")
    folder = tmp_path / "watch"
    folder.mkdir()
    result = run_training(
        objective="grpo", model=str(models["c0"]), data=str(data), run_name=run_name,
        reward_fns=[varied], lora=LORA, seed=5,
        grpo={"num_generations": 2, "max_completion_length": completion_tokens,
              "log_completions": True},
        rollout_backend="vllm", rollout_resources={"CPU": 1}, max_length=max_length,
        num_workers=1, batch_size=2, max_steps=steps, learning_rate=1e-2, log_every_steps=1,
        save_at_end=False, storage_path=str(tmp_path / "storage"), dashboard=False,
        callbacks=[Watch(str(folder))], **fields,
    )  # fmt: skip
    return result, [json.loads(line) for line in (folder / "watch.jsonl").open()]


def test_grpo_trains_on_vllm_completions_with_adapter_only_syncs(models, ray_session, tmp_path):
    result, records = _run(models, tmp_path, "grpo-vllm", 8, 6, 64, STEPS)
    assert result.global_step == STEPS
    engines = [r for r in records if r["kind"] == "engine"]
    logs = {r["step"]: r for r in records if r["kind"] == "log"}
    # vLLM served every step, one engine, never restarted; after step s it holds version s - 1
    # (the sync before step s's rollout), and its versions advance one a step.
    assert [(r["step"], r["backend"], r["version"]) for r in engines] == [
        (s, "vllm", s - 1) for s in range(1, STEPS + 1)
    ]
    assert len({r["pid"] for r in engines}) == 1
    assert sorted(logs) == list(range(1, STEPS + 1))
    for step, log in logs.items():
        print(f"\nstep {step}: rollout/logprob_diff {log['rollout/logprob_diff']:.2e}, "
              f"sync {log['sync/bytes']:.0f} B in {log['sync/seconds']:.2f} s, "
              f"rollout {log['rollout/seconds']:.2f} s, reward {log['reward']:.3f}")  # fmt: skip
        assert 0 <= log["rollout/logprob_diff"] < LOGPROB_BOUND, (step, log)
        for name in ("loss", "reward", "completions/mean_length", "rollout/tokens_per_s"):
            assert math.isfinite(log[name]), (step, name, log[name])
        assert log["trained_tokens"] > 0
    # LoRA: the adapter alone went to vLLM each step, far less than the base's weights.
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(models["c0"])
    full = sum(p.numel() * 4 for p in base.parameters())
    assert all(0 < log["sync/bytes"] < full / 5 for log in logs.values())
    # Every completion written was sampled by the policy of its step.
    rollouts = tmp_path / "storage" / "grpo-vllm" / "rollouts.jsonl"
    lines = [json.loads(line) for line in rollouts.open()]
    assert {r["step"] for r in lines} == set(range(1, STEPS + 1))
    assert all(r["version"] == r["step"] - 1 for r in lines)
    # The engine's /dev/shm folder: its actor was killed with the worker group and its child
    # with it (Ray ends a dead worker's children), so no one removed it; the next engine's
    # start does (`shm.remove_stale`), once the actor's process is gone.
    from ray_trainer._rollout.shm import shm_folder

    left = f"ray-trainer-rollout-{engines[0]['pid']}-*"
    wait_until(lambda: not os.path.exists(f"/proc/{engines[0]['pid']}"), 60, "the engine's end")
    shm_folder().rmdir()  # a new engine's folder
    assert not list(Path("/dev/shm").glob(left))


def test_asynchronous_grpo_on_vllm_trains_completions_at_most_one_version_old(
    models, ray_session, tmp_path
):
    """`max_staleness=1` on a vLLM engine: the engine samples the next step's rollout while the
    step trains, each version's adapter posted to it without waiting (taken between two of
    vLLM's decoding steps when a request runs); every trained completion is at most one
    version behind its step's, newer weights inside a completion only newer than its first
    token's, and the probe's log-probs match the trainer's after every sync."""
    steps = 4
    result, records = _run(models, tmp_path, "grpo-vllm-async", 10, 24, 96, steps, max_staleness=1)
    assert result.global_step == steps
    logs = [r for r in records if r["kind"] == "log"]
    assert {r["backend"] for r in records if r["kind"] == "engine"} == {"vllm"}
    for log in logs:
        if "rollout/logprob_diff" in log:
            assert 0 <= log["rollout/logprob_diff"] < LOGPROB_BOUND, log
    assert max(log.get("rollout/age_max", 0) for log in logs) <= 1
    run = tmp_path / "storage" / "grpo-vllm-async"
    lines = [json.loads(line) for line in (run / "rollouts.jsonl").open()]
    assert {r["step"] for r in lines} == set(range(1, steps + 1))
    for r in lines:
        assert 0 <= (r["step"] - 1) - r["version"] <= 1, r
        for position, version in r["newer_versions"]:
            assert position > 0 and r["version"] < version <= r["step"] - 1, r
    crossed = sum(bool(r["newer_versions"]) for r in lines)
    print(f"\nasync GRPO on vLLM: {len(lines)} completions logged, {crossed} crossed a sync "
          f"inside their decoding; ages {[r['step'] - 1 - r['version'] for r in lines]}")  # fmt: skip
