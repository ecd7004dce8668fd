"""The ``hf`` rollout engine (`_rollout/engine_hf.py`, `engines.py`, `probe.py`) in this process
on the tiny chat model: reproducible sampling under a seed; the recorded log-probs (taken from
``generate``'s own logits, before top-k and top-p) equal a teacher-forced forward's at the
temperature within 1e-5, and the probe's teacher-forced ones too; a padded batch samples what each prompt alone
would; completions end at their first end token or are truncated; a full sync and a LoRA sync
(adapter only) make the engine sample and score exactly as a fresh engine holding the new
weights, recorded under the new version, and the probe's difference to the trainer's forward
stays under 1e-5 in fp32; the refusals."""

from __future__ import annotations

import pytest
import torch

from ray_trainer._model.spec import ModelSpec
from ray_trainer._rollout.engine import EngineSpec, SamplingParams
from ray_trainer._rollout.engine_hf import HfEngine
from ray_trainer._rollout.engines import build_engine, resolve_backend
from ray_trainer._rollout.probe import (
    PROBE_METRIC,
    Probe,
    logprob_diff,
    probe_metrics,
    trainer_logprobs,
)
from ray_trainer._rollout.transport import LocalTransport, sync_weights
from ray_trainer._rollout.weights import WeightSyncError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [300, 301, 302, 303]]
LORA = {"r": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> EngineSpec:
    from ray_trainer._demo.chat import make_tiny_chat_model

    path = make_tiny_chat_model(tmp_path_factory.mktemp("rollout") / "chat")
    return EngineSpec(ModelSpec(model=str(path)), device="cpu", batch_size=4)


def _trained(model, lr: float = 2.0):
    """`model` after one SGD step on a short sequence: every trainable weight moves."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr).step()
    return model.eval()


def _sampled(engine, seed: int = 3, **params):
    params = {"num_generations": 2, "max_completion_length": 6, "seed": seed, **params}
    return engine.generate(PROMPTS, SamplingParams(**params), prompt_indices=[20, 21, 22])


def test_sampling_is_reproducible_with_a_seed_and_grouped_by_prompt(spec):
    engine = build_engine("hf", spec)
    first = _sampled(engine, num_generations=3)
    assert [c.prompt_index for c in first] == [20, 20, 20, 21, 21, 21, 22, 22, 22]
    assert [c.prompt_ids for c in first] == [p for p in PROMPTS for _ in range(3)]
    assert all(c.version == 0 and 1 <= len(c.completion_ids) <= 6 for c in first)
    again = _sampled(engine, num_generations=3)
    assert [(c.completion_ids, c.logprobs) for c in again] == [
        (c.completion_ids, c.logprobs) for c in first
    ]
    other = _sampled(engine, seed=4, num_generations=3)
    assert [c.completion_ids for c in other] != [c.completion_ids for c in first]
    # The generations of one prompt differ from each other (sampled, not copied).
    assert len({tuple(c.completion_ids) for c in first[:3]}) > 1


def test_the_logprobs_are_a_teacher_forced_forwards_at_the_temperature(spec):
    engine = build_engine("hf", spec)
    trainer = spec.model.build_model().eval()
    # Taken while sampling, before the filters: top-p and top-k shape the sampling only.
    completions = _sampled(engine, temperature=0.7, top_p=0.6, top_k=20)
    for c in completions:
        probe = Probe.of(c, temperature=0.7)
        expected = trainer_logprobs(trainer, probe)
        assert logprob_diff(c.logprobs, expected) < 1e-5
        assert logprob_diff(engine.logprobs(c.prompt_ids, c.completion_ids, 0.7), expected) < 1e-5
    # One sequence per forward (its logits bounded to 1 byte) gives the same numbers.
    narrow = HfEngine.build(EngineSpec(spec.model, batch_size=4, logits_bytes=1))
    pairs = [(c.prompt_ids, c.completion_ids) for c in completions]
    for c, logprobs in zip(completions, narrow.sequence_logprobs(pairs, 0.7), strict=True):
        assert logprob_diff(logprobs, c.logprobs) < 1e-5
    c = completions[0]
    at_one = trainer_logprobs(trainer, Probe.of(c, temperature=1.0))
    assert logprob_diff(c.logprobs, at_one) > 1e-3  # the temperature is in them


def test_a_padded_batch_samples_what_each_prompt_alone_would(spec):
    # At a temperature near 0 sampling is the argmax: the left-padded batch (prompts of 9, 2
    # and 4 tokens) must pick each prompt's own argmax, the one its recorded log-probs rank
    # first, and what an engine of one sequence per batch picks.
    batched = _sampled(build_engine("hf", spec), temperature=1e-5)
    alone = _sampled(HfEngine.build(EngineSpec(spec.model, batch_size=1)), temperature=1e-5)
    assert [c.completion_ids for c in batched] == [c.completion_ids for c in alone]
    assert all(lp > -1e-3 for c in batched for lp in c.logprobs)


def test_a_completion_ends_at_its_first_end_token_or_is_truncated(spec):
    ends = list(range(0, 1024, 5))  # one token in five ends a completion
    engine = build_engine("hf", EngineSpec(spec.model, eos_token_ids=ends))
    completions = _sampled(engine, num_generations=8, max_completion_length=4)
    ended = [c for c in completions if not c.truncated]
    cut = [c for c in completions if c.truncated]
    assert ended and cut
    for c in ended:
        assert c.completion_ids[-1] % 5 == 0
        assert all(t % 5 for t in c.completion_ids[:-1])
    for c in cut:
        assert len(c.completion_ids) == 4 and all(t % 5 for t in c.completion_ids)
    assert all(len(c.logprobs) == len(c.completion_ids) for c in completions)


def test_a_full_sync_gives_the_new_weights_samples_and_logprobs(spec):
    engine = build_engine("hf", spec)
    before = _sampled(engine)
    trainer = _trained(spec.model.build_model())
    full = sum(p.numel() * p.element_size() for p in trainer.parameters())
    stats = sync_weights(LocalTransport(engine), trainer.named_parameters(), 1, bucket_bytes=16384)
    assert stats.bytes == full and stats.buckets == -(-full // 16384)
    assert stats.largest_bucket <= 16384 and stats.metrics()["sync/bytes"] == full
    after = _sampled(engine)
    fresh = _sampled(HfEngine.build(spec, state_dict=trainer.state_dict()))
    assert [(c.completion_ids, c.logprobs) for c in after] == [
        (c.completion_ids, c.logprobs) for c in fresh
    ]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert {c.version for c in after} == {1} and {c.version for c in fresh} == {0}
    probe = Probe.of(before[0])
    engine_side = engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0)
    diff = probe_metrics(engine_side, trainer_logprobs(trainer, probe))
    assert set(diff) == {PROBE_METRIC} and diff[PROBE_METRIC] < 1e-5


def test_a_lora_sync_sends_the_adapter_only_and_keeps_the_base(spec):
    import peft

    from ray_trainer._lora.config import wrap

    lora = EngineSpec(spec.model, lora=LORA, batch_size=4)
    engine = build_engine("hf", lora)
    before = _sampled(engine)
    torch.manual_seed(1)
    trainer = _trained(wrap(spec.model.build_model(), LORA), lr=20.0)
    adapter = [(n, p) for n, p in trainer.named_parameters() if p.requires_grad]
    assert adapter and all(".lora_" in n for n, _ in adapter)
    stats = sync_weights(LocalTransport(engine), adapter, 1, bucket_bytes=4096)
    full = sum(p.numel() * p.element_size() for p in trainer.parameters())
    assert stats.bytes == sum(p.numel() * 4 for _, p in adapter) < full / 10
    # A fresh engine: the base, then the trainer's adapter loaded by peft itself.
    fresh_model = wrap(spec.model.build_model(), LORA)
    peft.set_peft_model_state_dict(fresh_model, peft.get_peft_model_state_dict(trainer))
    fresh = _sampled(HfEngine(fresh_model, lora))
    after = _sampled(engine)
    assert [(c.completion_ids, c.logprobs) for c in after] == [
        (c.completion_ids, c.logprobs) for c in fresh
    ]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert {c.version for c in after} == {1}
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    held = dict(engine.model.named_parameters())[base]
    assert torch.equal(held, dict(fresh_model.named_parameters())[base])  # the base stayed
    probe = Probe.of(after[0])
    engine_side = engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0)
    assert logprob_diff(engine_side, trainer_logprobs(trainer, probe)) < 1e-5
    # A second version is loaded the same way, in place.
    _trained(trainer, lr=20.0)
    sync_weights(LocalTransport(engine), adapter, 2)
    assert {c.version for c in _sampled(engine)} == {2}
    engine_side = engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0)
    assert logprob_diff(engine_side, trainer_logprobs(trainer, probe)) < 1e-5
    with pytest.raises(WeightSyncError, match="not a LoRA adapter weight"):
        sync_weights(LocalTransport(engine), [(base, held)], 3)


def test_weights_posted_during_a_request_are_taken_between_its_batches(spec):
    """The rollout actor's pause-and-update (`RolloutActor.post`, here in this process):
    weights posted while a request samples are loaded at its next batch boundary, a version
    posted and not taken yet passed over for a newer one; the rest of the request samples on
    them, each completion recording its version; the probe is scored right after the load.
    Posted to an idle engine, they are loaded at once."""
    from ray_trainer._rollout.actor import RolloutActor
    from ray_trainer._rollout.weights import buckets

    actor = RolloutActor("hf", EngineSpec(spec.model, device="cpu", batch_size=2))
    trainer = _trained(spec.model.build_model())
    probe = Probe.of(_sampled(actor.engine)[0])
    take, calls = actor.engine.on_boundary, []
    older = list(buckets(spec.model.build_model().named_parameters()))

    def boundary():  # the trainer posts twice while the request's second batch is due
        calls.append(actor.engine.version)
        if len(calls) == 2:  # (a post comes from another thread: the request is running)
            assert actor.post(5, older, probe) == 0
            assert actor.post(6, list(buckets(trainer.named_parameters(), 16384)), probe) == 0
        take()

    actor.engine.on_boundary = boundary
    params = SamplingParams(num_generations=2, max_completion_length=6, seed=3)
    mixed = actor.generate(PROMPTS, params)  # 6 rows: 3 batches of 2
    assert calls == [0, 0, 6]
    assert [c.version for c in mixed] == [0, 0, 6, 6, 6, 6]
    held = dict(actor.engine.model.named_parameters())
    assert all(torch.equal(held[n], p) for n, p in trainer.named_parameters())
    assert logprob_diff(actor.probed(6), trainer_logprobs(trainer, probe)) < 1e-5
    assert actor.probed(5) is None  # passed over: never loaded
    # Posted to an idle engine: loaded at once, before the answer.
    actor.engine.on_boundary = take
    _trained(trainer)
    assert actor.post(7, list(buckets(trainer.named_parameters())), probe) == 7
    held = dict(actor.engine.model.named_parameters())
    assert all(torch.equal(held[n], p) for n, p in trainer.named_parameters())
    assert logprob_diff(actor.probed(7), trainer_logprobs(trainer, probe)) < 1e-5
    assert {c.version for c in actor.generate(PROMPTS[:1], params)} == {7}


def test_a_qlora_engine_samples_from_the_4_bit_base_the_trainer_trains_on(spec):
    pytest.importorskip("torchao")
    from ray_trainer._lora.config import quantize_base, wrap
    from ray_trainer._model.nf4 import is_nf4

    qlora = {**LORA, "quantize_base": "nf4"}
    engine = build_engine("hf", EngineSpec(spec.model, lora=qlora, batch_size=4))
    base = "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"
    assert is_nf4(dict(engine.model.named_parameters())[base])
    # The trainer's QLoRA model, the adapter trained, synced into the engine: the engine's
    # log-probs are the trainer's (the same 4-bit base), not a full-precision base's.
    trainer = spec.model.build_model()
    quantize_base(trainer, qlora)
    torch.manual_seed(1)
    trainer = _trained(wrap(trainer, qlora), lr=20.0)
    adapter = [(n, p) for n, p in trainer.named_parameters() if p.requires_grad]
    sync_weights(LocalTransport(engine), adapter, 1)
    probe = Probe.of(_sampled(engine)[0])
    engine_side = engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0)
    assert logprob_diff(engine_side, trainer_logprobs(trainer, probe)) < 1e-5
    full = wrap(spec.model.build_model(), LORA)  # the same adapter on the full-precision base
    full.load_state_dict(
        {n: p for n, p in trainer.state_dict().items() if ".lora_" in n}, strict=False
    )
    assert logprob_diff(engine_side, trainer_logprobs(full, probe)) > 1e-5


def test_the_engine_refuses_what_it_cannot_do(spec):
    engine = build_engine("hf", spec)
    engine.begin_sync(1)  # open, not finished: part old, part new weights
    with pytest.raises(WeightSyncError, match="version 1 are being synced"):
        _sampled(engine)
    with pytest.raises(ValueError, match="prompt 1 has no token"):
        HfEngine.build(spec).generate([[4], []], SamplingParams(num_generations=1))
    with pytest.raises(ValueError, match="has none: use a Hugging Face causal LM"):
        HfEngine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown rollout backend 'vlm'.*auto, hf, vllm"):
        resolve_backend("vlm")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        SamplingParams(temperature=0.0)
    with pytest.raises(ValueError, match="num_generations must be an integer >= 1"):
        SamplingParams(num_generations=0)
    with pytest.raises(ValueError, match="the probe's log-probs differ in length"):
        logprob_diff([0.1], [0.1, 0.2])
