"""Chat fine-tuning end to end: messages JSONL rendered with the model's own chat template,
encoded once into the run's token cache by Ray tasks, packed without padding on 2 gloo workers;
the loss falls, a resumed run trains on the same samples as an uninterrupted one, and a second
run on the same data reuses the cache while a changed template builds a new one. The
uninterrupted run's checkpoints are scored by `GenerationEval` (in a task, and kept in an
evaluator actor) while it trains."""

from __future__ import annotations

import hashlib
import json
import os
import sys

import pytest
from rt_support import StopAt, read_records
from waiting import wait_until

from callbacks import TrainerCallback

STEPS = 12  # 25 steps an epoch (400 conversations, 16 a step): all within epoch 0


class BatchDigest(TrainerCallback):
    """Every rank: a digest of each micro-batch it trains on, and the loss of each log."""

    runs_on = "all_ranks"

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def _write(self, **record) -> None:
        with open(os.path.join(self.folder, f"digest-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_before_forward(self, context, batch=None, micro_step=None, **kwargs):
        ids = batch["input_ids"].flatten().tolist()
        digest = hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]
        self._write(
            kind="batch", step=context.global_step + 1, rank=context.rank, micro=micro_step,
            digest=digest, packed="position_ids" in batch and "attention_mask" not in batch,
        )  # fmt: skip

    def on_log(self, context, **kwargs):
        if context.rank == 0:
            metrics = context.batch_metrics or {}
            self._write(
                kind="log", step=context.global_step, loss=context.loss,
                padding_share=metrics.get("padding_share"), tokens=context.tokens_seen,
            )  # fmt: skip


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model

    root = tmp_path_factory.mktemp("chat")
    model = make_tiny_chat_model(root / "model", style="chatml")
    data = root / "train.jsonl"
    with open(data, "w") as f:
        for messages in chat_conversations(400, seed=1):
            f.write(json.dumps({"messages": messages}) + "\n")
    return root, str(model), str(data)


def _fields(chat, folder, **overrides):
    root, model, data = chat
    os.makedirs(folder, exist_ok=True)
    fields = dict(
        model=model, data=data, packing=True, max_length=256, max_tokens_per_batch=512,
        batch_size=8, num_workers=2, max_steps=STEPS, learning_rate=1e-2, warmup_steps=0,
        log_every_steps=2, storage_path=str(root / "storage"), save_at_end=False,
        callbacks=[BatchDigest(folder)],
    )  # fmt: skip
    fields.update(overrides)
    return fields


#: The held-out chat rows the generation evaluations ask (the last assistant turn of each is the
#: reference): conversations the run never trains on.
HELD_OUT = {"n": 3, "seed": 2}


def _generation_evals() -> list:
    """One-off: a task per second checkpoint, transformers in the task. Kept: one evaluator
    actor for the run, the generation in a subprocess of an interpreter (`python=`, as for a
    vLLM environment), on every checkpoint."""
    from callbacks import EvalOnSave, GenerationEval
    from ray_trainer._demo.chat import chat_conversations

    prompts = [{"messages": m} for m in chat_conversations(**HELD_OUT)]
    kept = GenerationEval(prompts, name="kept", backend="hf", max_new_tokens=8,
                          python=sys.executable, keep_engine=True)  # fmt: skip
    return [
        EvalOnSave(
            GenerationEval(prompts, name="chat", backend="hf", max_new_tokens=8,
                           metrics=["exact_match", "contains"]),
            num_gpus=0, every_n_saves=2,
        ),
        EvalOnSave(kept, num_gpus=0),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def runs(ray_session, chat):
    from ray_trainer import run_training

    root = chat[0]
    whole = root / "whole"
    # The uninterrupted run also carries test_a_generation_eval...'s two `GenerationEval`s: its
    # saves at steps 6 and 12 (they change no sample and no loss) are evaluated while it trains.
    generation = _generation_evals()
    whole_result = run_training(**_fields(chat, whole, run_name="chat-whole", save_every_steps=6,
                                          callbacks=[BatchDigest(str(whole)), *generation]))  # fmt: skip
    cache_root = root / "storage" / ".ray_trainer" / "data-cache"
    (first_cache,) = os.listdir(cache_root)
    meta = cache_root / first_cache / "meta.json"
    built = meta.stat().st_mtime_ns
    part = root / "part"
    stopped = run_training(**_fields(chat, part, run_name="chat-resumed", callbacks=[
        BatchDigest(part), StopAt(5)]))  # fmt: skip
    resumed = run_training(**_fields(chat, part, run_name="chat-resumed"))
    return {
        "whole_result": whole_result,
        "whole": read_records(str(whole), "digest"),
        "part": read_records(str(part), "digest"),
        "stopped": stopped,
        "resumed": resumed,
        "caches": os.listdir(cache_root),
        "meta_rebuilt": meta.stat().st_mtime_ns != built,
        "meta": json.loads(meta.read_text()),
    }


def test_a_packed_chat_run_learns_with_almost_no_padding(runs):
    logs = [r for r in runs["whole"] if r["kind"] == "log"]
    assert [r["step"] for r in logs] == list(range(2, STEPS + 1, 2))
    assert logs[-1]["loss"] < logs[0]["loss"] * 0.8, logs
    assert all(r["padding_share"] < 0.05 for r in logs), logs
    batches = [r for r in runs["whole"] if r["kind"] == "batch"]
    assert batches and all(r["packed"] for r in batches)
    # Both ranks take as many micro-batches at every step (collectives stay matched).
    for step in range(1, STEPS + 1):
        per_rank = [sum(1 for r in batches if r["step"] == step and r["rank"] == k) for k in (0, 1)]
        assert per_rank[0] == per_rank[1] >= 1


def test_a_resumed_run_trains_on_the_same_samples_as_an_uninterrupted_one(runs):
    # StopAt(5) asks during step 5; the request is read one step late: it stops at step 6.
    assert runs["stopped"].global_step == 6 and runs["resumed"].global_step == STEPS

    def batches(records, first):
        return sorted(
            (r["step"], r["rank"], r["micro"], r["digest"])
            for r in records
            if r["kind"] == "batch" and r["step"] >= first
        )

    part = runs["part"]
    steps = [r["step"] for r in part if r["kind"] == "batch"]
    assert steps.count(6) == steps.count(7)  # step 6 once, then the continuation from 7
    assert batches(part, 1) == batches(runs["whole"], 1)  # every step, mid-epoch resume included
    whole_logs = {r["step"]: r["loss"] for r in runs["whole"] if r["kind"] == "log"}
    for r in part:
        if r["kind"] == "log" and r["step"] > 6:  # an exact resume: the same losses too
            assert r["loss"] == pytest.approx(whole_logs[r["step"]], abs=1e-4)


def test_the_checkpoint_export_carries_the_template_and_stops_at_the_end_of_a_turn(runs, chat):
    """The stopped run's checkpoint (step 6): `hf/` holds the tokenizer with the chat template
    the data was rendered with and a generation config that stops at <|im_end|>."""
    import transformers

    hf = os.path.join(runs["stopped"].checkpoint_path, "hf")
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert tok.chat_template == transformers.AutoTokenizer.from_pretrained(chat[1]).chat_template
    eos = transformers.GenerationConfig.from_pretrained(hf).eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in ([eos] if isinstance(eos, int) else eos)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert type(model).__name__ == "Qwen2ForCausalLM"


def test_later_runs_on_the_same_data_reuse_the_token_cache(runs):
    assert len(runs["caches"]) == 1 and not runs["meta_rebuilt"]
    meta = runs["meta"]
    assert meta["format"] == "messages" and meta["records"] == 400 and meta["samples"] == 400


def test_a_changed_template_encodes_again(ray_session, chat):
    from ray_trainer import TrainingArgs
    from ray_trainer._demo.chat import chat_template
    from ray_trainer._driver.data import plan_data, prepare_data

    root = chat[0]
    args = TrainingArgs(**_fields(chat, root / "other", callbacks=[]))
    (same,) = plan_data(args).values()
    assert same.meta is not None  # the first run's cache: nothing to encode
    changed = args.model_copy(update={"chat_template": chat_template("chatml", True)})
    plans = plan_data(changed)
    assert plans["data"].meta is None and plans["data"].fingerprint != same.fingerprint
    caches = prepare_data(plans, changed)  # Ray tasks encode it
    assert plans["data"].meta["samples"] == 400
    assert os.path.basename(caches["data"]) == plans["data"].fingerprint


def test_a_generation_eval_in_an_eval_task_scores_a_chat_checkpoint_and_keeps_its_samples(
    runs, ray_session
):
    from ray_trainer._demo.chat import chat_conversations

    held_out = chat_conversations(**HELD_OUT)
    result = runs["whole_result"]
    for e in result.evaluations:
        assert "error" not in e, e
        assert 0 < e["seconds_after_save"] < 120  # from its save to its metrics
    (evaluation,) = [e for e in result.evaluations if "chat/vllm" in e["metrics"]]
    assert evaluation["step"] == STEPS  # every second save: the second, at step 12
    kept_runs = [e for e in result.evaluations if "kept/vllm" in e["metrics"]]
    assert sorted(e["step"] for e in kept_runs) == [6, 12], result.evaluations
    assert all(0 <= e["metrics"]["kept/exact_match"] <= 1 for e in kept_runs)
    # The evaluator actor and its generation subprocess ended with the run.
    assert not _processes_running("run_generation_child.py")
    # It held a CPU for the whole run (num_cpus=1): every CPU is free again once it is gone.
    total = ray_session.cluster_resources()["CPU"]
    wait_until(lambda: ray_session.available_resources().get("CPU") == total, 30,
               "the evaluator actor to give its CPU back")  # fmt: skip
    metrics = evaluation["metrics"]
    assert 0.0 <= metrics["chat/exact_match"] <= metrics["chat/contains"] <= 1.0
    assert metrics["chat/vllm"] == 0.0 and 0 < metrics["chat/answer_tokens_mean"] <= 8
    samples_path = os.path.join(evaluation["checkpoint_path"], "eval", "chat.jsonl")
    assert metrics["chat/samples"] == samples_path
    with open(samples_path) as f:
        samples = [json.loads(line) for line in f]
    assert [s["reference"] for s in samples] == [m[-1]["content"] for m in held_out]
    assert [s["prompt"] for s in samples] == [m[:-1] for m in held_out]
    assert {s["step"] for s in samples} == {evaluation["step"]}


def _processes_running(needle: str) -> list[int]:
    """The pids whose command line holds `needle` (this machine's /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found
