"""Weights in buckets (`_rollout/weights.py`, `_rollout/transport.py`): every bucket within its
bound, a tensor larger than a bucket cut into slices, what arrives equal bit for bit to what was
sent, and the receiver's refusals (a name it does not hold, a sync that missed a tensor or sent
one twice, a bucket outside a sync). Under FSDP2 on two real gloo ranks (no Ray), the chat
model sharded as a training worker shards it: the sender gathers one parameter at a time and the
hf engine then scores the probe as the sharded forward does (1e-5)."""

from __future__ import annotations

import pytest
import torch
from gloo_support import run_ranks

from ray_trainer._rollout.transport import LocalTransport, sync_weights, transport_of
from ray_trainer._rollout.weights import (
    Receiver,
    WeightSyncError,
    buckets,
    canonical,
    full_tensors,
)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(7, 5, generator=g),  # 140 bytes
        "b.bias": torch.randn(3, generator=g),  # 12 bytes
        "big": torch.randn(100, generator=g),  # 400 bytes: more than a bucket
        "steps": torch.arange(6, dtype=torch.int64),
        "empty": torch.zeros(0),
    }


class _Holder:
    """An engine's weights side, in this process: a Receiver over zeroed copies."""

    def __init__(self, like: dict[str, torch.Tensor]) -> None:
        self.tensors = {n: torch.zeros_like(t) for n, t in like.items()}
        self.receiver = Receiver(self.tensors)
        self.version = 0

    def begin_sync(self, version):
        self.receiver.begin(version)

    def load_bucket(self, bucket):
        return self.receiver.load(bucket)

    def finish_sync(self, version):
        summary = self.receiver.finish(version)
        self.version = version
        return summary


def test_buckets_keep_their_bound_and_carry_every_tensor_exactly():
    sent = _tensors()
    out = list(buckets(sent.items(), max_bytes=128))
    assert all(b.nbytes <= 128 for b in out)
    total = sum(t.numel() * t.element_size() for t in sent.values())
    assert sum(b.nbytes for b in out) == total
    assert len(out) == -(-total // 128)  # full buckets but the last: no space wasted
    big = [e for b in out for e in b.entries if e.name == "big"]
    assert len(big) > 1 and sum(e.numel for e in big) == 100  # cut into slices
    holder = _Holder(sent)
    stats = sync_weights(LocalTransport(holder), sent.items(), 3, bucket_bytes=128)
    for name, tensor in sent.items():
        assert torch.equal(holder.tensors[name], tensor), name
    assert holder.version == 3
    assert (stats.buckets, stats.bytes, stats.tensors) == (len(out), total, len(sent))
    assert stats.largest_bucket <= 128 and stats.receiver["bytes"] == total
    assert set(stats.metrics()) == {"sync/seconds", "sync/bytes"}
    assert stats.metrics()["sync/bytes"] == total


def test_the_sender_reads_a_tensor_only_when_the_bucket_before_is_taken():
    # A generator that gathers one parameter at a time keeps its memory bound only if the
    # sender does not read ahead: a tensor is read once the previous bucket has been yielded.
    read = []

    def named():
        for i in range(4):
            read.append(i)
            yield f"t{i}", torch.full((8,), float(i))  # 32 bytes each

    seen = []
    for _ in buckets(named(), max_bytes=32):
        seen.append(len(read))
    assert seen == [1, 2, 3, 4]


def test_a_cast_halves_the_bytes_and_the_receiver_takes_its_own_dtype():
    sent = {"w": torch.randn(16, 4)}
    holder = _Holder(sent)  # float32 on the engine
    stats = sync_weights(LocalTransport(holder), sent.items(), 1, dtype=torch.bfloat16)
    assert stats.bytes == 16 * 4 * 2
    assert torch.equal(holder.tensors["w"], sent["w"].to(torch.bfloat16).float())


def test_names_match_without_the_wrappers_prefixes():
    assert canonical("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.w") == (
        "model.layers.0.mlp.w"
    )
    holder = _Holder({"model.w": torch.zeros(2)})
    sync_weights(LocalTransport(holder), [("module.model.w", torch.ones(2))], 1)
    assert torch.equal(holder.tensors["model.w"], torch.ones(2))


def test_the_receiver_refuses_what_it_cannot_apply():
    sent = _tensors()
    holder = _Holder(sent)
    one = next(iter(buckets([("a.weight", sent["a.weight"])])))
    with pytest.raises(WeightSyncError, match="outside a sync"):
        holder.load_bucket(one)
    transport = transport_of("local", holder)
    with pytest.raises(WeightSyncError, match=r"did not send every weight: b\.bias, big"):
        sync_weights(transport, [(n, sent[n]) for n in ("a.weight", "steps", "empty")], 1)
    assert holder.receiver.syncing  # left open: the engine will not sample from mixed weights
    with pytest.raises(WeightSyncError, match="nope: no such weight"):
        sync_weights(transport, [("nope", torch.zeros(3))], 2)
    with pytest.raises(WeightSyncError, match=r"a\.weight: 12 elements sent.*\(7, 5\)"):
        sync_weights(transport, [("a.weight", torch.zeros(12))], 3)
    twice = [*sent.items(), ("b.bias", sent["b.bias"])]
    with pytest.raises(WeightSyncError, match="sent more than once"):
        sync_weights(transport, twice, 4)
    holder.begin_sync(5)
    with pytest.raises(WeightSyncError, match=r"finish_sync\(6\) but the sync open is 5"):
        holder.finish_sync(6)
    stats = sync_weights(transport, sent.items(), 7)  # a complete sync after failed ones
    assert stats.version == holder.version == 7 and not holder.receiver.syncing
    adapter = Receiver({"q.lora_A.default.weight": torch.zeros(2)}, "the LoRA adapter")
    adapter.begin(1)
    with pytest.raises(WeightSyncError, match=r"not a LoRA adapter weight.*send the adapter only"):
        adapter.load(next(iter(buckets([("q.base_layer.weight", torch.zeros(2))]))))
    with pytest.raises(ValueError, match="unknown weight transport 'nccl'"):
        transport_of("nccl", holder)
    with pytest.raises(ValueError, match="cannot hold one float32 element"):
        list(buckets([("w", torch.zeros(2))], max_bytes=2))


def sharded_sync(rank: int, world: int, model_path: str) -> dict:
    """Both ranks: the chat model as a training worker shards it under FSDP2 (built on the meta
    device, filled per rank), its weights moved; its parameters gathered one at a time, rank 0
    sending them into an hf engine in buckets, then the probe against the sharded forward."""
    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._rollout.engine import EngineSpec
    from ray_trainer._rollout.engine_hf import HfEngine
    from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
    from ray_trainer._worker.model.build import build_model
    from ray_trainer._worker.model.parallel import _shard

    args = TrainingArgs(model=model_path, strategy="fsdp")
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    _shard(model, args, torch.device("cpu"), "no")
    fill(model, torch.device("cpu"))
    with torch.no_grad():  # the trainer's weights move away from the files'
        for p in model.parameters():
            p.to_local().mul_(1.5)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    probe = Probe((5, 6, 7, 8), (9, 10, 11, 12, 13))
    named = full_tensors(model.named_parameters())
    if rank != 0:
        for _ in named:  # the other ranks enter each gather beside rank 0
            pass
        trainer_logprobs(model, probe)  # the sharded forward: a collective too
        return {"kinds": kinds}
    engine = HfEngine.build(EngineSpec(spec, device="cpu"))
    scored = (list(probe.prompt_ids), list(probe.completion_ids), probe.temperature)
    before = engine.logprobs(*scored)
    stats = sync_weights(LocalTransport(engine), named, 1, bucket_bytes=16384)
    trainer = trainer_logprobs(model, probe)
    return {
        "kinds": kinds,
        "moved": logprob_diff(before, trainer),
        "diff": logprob_diff(engine.logprobs(*scored), trainer),
        "largest": stats.largest_bucket,
        "buckets": stats.buckets,
    }


def test_fsdp2_weights_are_gathered_one_at_a_time_into_the_engine(tmp_path):
    from ray_trainer._demo.chat import make_tiny_chat_model

    path = make_tiny_chat_model(tmp_path / "chat")
    r0, r1 = run_ranks(sharded_sync, 2, str(path))
    assert r0["kinds"] == r1["kinds"] == ["DTensor"]
    assert r0["moved"] > 1e-3  # the engine started from other weights
    assert r0["diff"] < 1e-5  # and holds the sharded trainer's after the sync
    assert r0["largest"] <= 16384 and r0["buckets"] > 1
