"""Preference tuning end to end (issue 35): DPO on 2 gloo workers of a real local Ray, its
reference log-probs computed once by Ray tasks into the token cache.

Run A: DDP, QLoRA (LoRA on a 4-bit NF4 base, issue 52; adapter checkpoints), packed pairs, asynchronous checkpoints, validation pairs
ranking the checkpoints by ``val_rewards/accuracies``, an ``EvalOnSave`` task on every
checkpoint, and rank 1 killed once (the run resumes from its checkpoint and the reference is
read again, not recomputed); its reference is the 4-bit base with the adapters off (the first
step's loss is ln 2 exactly, and the reference cache records the quantized base). Run B: FSDP2 and an elastic size (1 to 2 workers): the reference
pass is a forward-only phase of the worker group. Then a second plan of run A's data reuses its
reference. DPO under ``compile=True`` (the reference pass and the steps equal eager's, no graph
break) is `tests/unit/test_dpo_step.py`'s, without inductor's code generation (run B compiled
with inductor until then: 30-50 s of this module).
"""

from __future__ import annotations

import json
import math
import os
import random

import pytest
from rt_support import KillRank1Once, read_records

from callbacks import EvalOnSave, TrainerCallback

OPPOSITES = [("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("wet", "dry")]
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}
#: Run A's: LoRA on the base quantized to NF4 (QLoRA) under DDP.
QLORA = {**LORA, "quantize_base": "nf4"}


def pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = [w for p in OPPOSITES for w in p]
    out = []
    for _ in range(n):
        a, b = rng.choice(OPPOSITES)
        if rng.random() < 0.5:
            a, b = b, a
        wrong = rng.choice([w for w in words if w not in (a, b)])
        say = f"The opposite of {a} is"
        out.append(
            {
                "prompt": [{"role": "user", "content": f"What is the opposite of {a}?"}],
                "chosen": [{"role": "assistant", "content": f"{say} {b}."}],
                "rejected": [{"role": "assistant", "content": f"{say} {wrong}" + "!" * (n % 3)}],
            }
        )
    return out


class Logs(TrainerCallback):
    """Rank 0 (in the training process): every log's loss and metrics, with the attempt."""

    runs_on = "rank0"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_log(self, context, **kwargs):
        with open(os.path.join(self.folder, f"logs-{os.getpid()}.jsonl"), "a") as f:
            record = {"step": context.global_step, "loss": context.loss, "attempt": context.attempt}
            f.write(json.dumps({**record, **(context.batch_metrics or {})}) + "\n")


def checkpoint_steps(checkpoint_path: str, step: int) -> dict:
    """An `EvalOnSave` task: what it was given (the DPO checkpoint is complete, on any node)."""
    from ray_trainer._checkpoint import check_complete
    from ray_trainer._storage import locate

    state = check_complete(locate(checkpoint_path))
    return {"seen_step": float(state.global_step), "dpo": float(state.extra["objective"] == "dpo")}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from ray_trainer._demo.chat import make_tiny_chat_model

    root = tmp_path_factory.mktemp("dpo")
    model = str(make_tiny_chat_model(root / "model", style="chatml"))
    for name, n, seed in (("train", 96, 0), ("val", 16, 1)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in pairs(n, seed))
    return root, model


def _fields(data, folder, **overrides) -> dict:
    root, model = data
    os.makedirs(folder, exist_ok=True)
    fields = dict(
        objective="dpo", model=model, data=str(root / "train.jsonl"),
        val_data=str(root / "val.jsonl"), max_length=64, num_workers=2, batch_size=4,
        max_steps=8, learning_rate=5e-3, warmup_steps=0, log_every_steps=1,
        storage_path=str(root / "storage"), dashboard=False, callbacks=[Logs(str(folder))],
    )  # fmt: skip
    fields.update(overrides)
    return fields


def _references(root) -> dict[str, dict]:
    """Every reference folder under the storage: its meta and the meta's mtime."""
    cache = root / "storage" / ".ray_trainer" / "data-cache"
    found = {}
    for fp in sorted(os.listdir(cache)):
        for name in os.listdir(cache / fp):
            if name.startswith("reference-"):
                meta = cache / fp / name / "meta.json"
                found[f"{fp}/{name}"] = {
                    **json.loads(meta.read_text()),
                    "mtime": meta.stat().st_mtime_ns,
                }
    return found


@pytest.fixture(scope="module")
def runs(ray_session, data):
    from ray_trainer import run_training

    root = data[0]
    a = root / "a"
    result_a = run_training(
        **_fields(
            data, a, run_name="dpo-a", lora=QLORA, packing=True, max_tokens_per_batch=256,
            async_checkpoint=True, save_every_steps=4, eval_every_steps=4, max_failures=1,
            checkpoint_score_attribute="val_rewards/accuracies",
            callbacks=[Logs(str(a)), KillRank1Once(6), EvalOnSave(checkpoint_steps, num_gpus=0, num_cpus=0)],
        )
    )  # fmt: skip
    after_a = _references(root)
    b = root / "b"
    # Another max_length: other token caches, so no reference of run A's to reuse.
    fsdp = dict(strategy="fsdp", max_steps=4, num_workers=(1, 2), max_length=60)
    result_b = run_training(**_fields(data, b, run_name="dpo-b", **fsdp))
    return {
        "a": result_a, "a_logs": read_records(str(a), "logs"), "after_a": after_a,
        "b": result_b, "b_logs": read_records(str(b), "logs"), "after_b": _references(root),
    }  # fmt: skip


def test_dpo_starts_at_ln2_and_learns_with_trls_metrics(runs):
    logs = sorted(runs["a_logs"], key=lambda r: (r["attempt"], r["step"]))
    first = logs[0]
    assert first["step"] == 1 and abs(first["loss"] - math.log(2)) < 1e-4  # policy = reference
    assert abs(first["rewards/margins"]) < 1e-4
    last = logs[-1]
    assert last["step"] == 8 and last["loss"] < first["loss"]
    assert last["rewards/margins"] > 0 and 0 <= last["rewards/accuracies"] <= 1
    for name in ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert name in last


def test_a_crash_resumes_and_reads_the_reference_again(runs):
    result = runs["a"]
    assert result.attempts == 2 and result.global_step == 8
    assert {r["attempt"] for r in runs["a_logs"]} == {0, 1}
    # Computed once, by Ray tasks on CPUs, before the first attempt: the restart read it.
    computed = [m for m in runs["after_a"].values() if m["tasks"] > 0]
    assert len(computed) == 2  # data and val_data
    assert all(m["device"] == "cpu" and m["dtype"] == "float32" for m in computed)
    # QLoRA: the reference is the policy's 4-bit base with its adapters off (ln 2 at step 1).
    assert all(m["quantize_base"] == "nf4" for m in computed)
    data_ref = max(computed, key=lambda m: m["sequences"])
    assert data_ref["sequences"] == 2 * 96


def test_validation_pairs_rank_the_checkpoints_and_evaluations_run_on_them(runs):
    result = runs["a"]
    assert "val_rewards/accuracies" in result.metrics and "val_loss" in result.metrics
    assert result.best_metrics is not None and "val_rewards/accuracies" in result.best_metrics
    with open(os.path.join(os.path.dirname(result.checkpoint_path), "ranking.json")) as f:
        ranking = json.load(f)
    assert ranking["attribute"] == "val_rewards/accuracies"
    good = [e for e in result.evaluations if not e.get("error")]
    assert good and all(e["metrics"]["dpo"] == 1.0 for e in good)
    assert all(e["metrics"]["seen_step"] == e["step"] for e in good)
    assert 8.0 in {e["metrics"]["seen_step"] for e in good}
    # A (Q)LoRA run's checkpoint holds the adapters, and its hf/ the PEFT adapter.
    assert os.path.exists(os.path.join(result.checkpoint_path, "hf", "adapter_config.json"))


def test_fsdp_elastic_dpo_computes_its_reference_in_the_workers(runs):
    result = runs["b"]
    assert result.global_step == 4
    new = {k: m for k, m in runs["after_b"].items() if k not in runs["after_a"]}
    assert len(new) == 2 and all(
        m["computed_by"].startswith("2 training worker") for m in new.values()
    )
    logs = sorted(runs["b_logs"], key=lambda r: r["step"])
    assert abs(logs[0]["loss"] - math.log(2)) < 1e-4
    assert logs[-1]["loss"] < logs[0]["loss"]


def test_a_second_run_on_the_same_data_and_model_reuses_the_reference(runs, data):
    from ray_trainer import TrainingArgs
    from ray_trainer._driver.data import plan_data
    from ray_trainer._driver.reference import prepare_references

    root = data[0]
    args = TrainingArgs(**_fields(data, root / "c", run_name="dpo-c", lora=QLORA, callbacks=[]))
    before = _references(root)
    folders = prepare_references(plan_data(args), args)  # no Ray task: both found complete
    assert _references(root) == before
    assert {
        os.path.relpath(p, root / "storage" / ".ray_trainer" / "data-cache")
        for p in folders.values()
    } <= set(before)
    assert set(prepare_references_plan(args).values()) == set(folders.values())
    # Another dtype is another reference, and so is the full-precision base: the key covers it.
    other = args.model_copy(update={"use_gpu": True})
    assert set(prepare_references_plan(other).values()).isdisjoint(folders.values())
    full = args.model_copy(update={"lora": LORA})
    assert set(prepare_references_plan(full).values()).isdisjoint(folders.values())


def prepare_references_plan(args) -> dict[str, str]:
    """The reference folders a run would use, without computing them."""
    from ray_trainer._driver.data import plan_data
    from ray_trainer._driver.reference import reference_dtype, reference_quantize
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._reference import reference_key, reference_location

    spec = ModelSpec.of(args)
    return {
        field: reference_location(
            plan.cache,
            reference_key(
                plan.fingerprint, spec, reference_dtype(args), args.seed, reference_quantize(args)
            ),
        ).name
        for field, plan in plan_data(args).items()
    }
