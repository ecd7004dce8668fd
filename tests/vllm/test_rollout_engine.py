"""The ``"vllm"`` rollout engine (`_rollout/engine_vllm.py`) on real vLLM (`make test-vllm`).

The engine drives the generation child under the vLLM env's python (RAY_TRAINER_VLLM_PYTHON);
the trainer's side is transformers in this process. Two engines start (about a minute each on 2
cores): one for full weights in this process, one with LoRA in a Ray actor as a run holds it.
Shown: vLLM's completions and log-probs against the trainer's teacher-forced forward (``rollout/logprob_diff``, reported
and bounded), a full-weight sync through shared memory that makes the engine sample the new
weights' completions and, synced back, exactly its first ones again (never restarted), LoRA
syncs of the adapter only, each a new LoRA id, the base untouched, and weights posted during a
request taken between two of vLLM's decoding steps (a third engine, in a Ray actor).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ray_trainer._model.spec import ModelSpec
from ray_trainer._rollout.engine import EngineSpec, SamplingParams
from ray_trainer._rollout.engine_vllm import VllmEngine
from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
from ray_trainer._rollout.transport import LocalTransport, sync_weights

ENGINE = {"enforce_eager": True, "kv_cache_memory_bytes": 256 << 20, "max_model_len": 256}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41], [300, 301, 302, 303]]
#: fp32 on CPU: vLLM's kernels against transformers' forward on the same weights.
LOGPROB_BOUND = 1e-3
CERTAIN = 100  # the token the "certain" weights always say
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def _spec(model, **fields) -> EngineSpec:
    return EngineSpec(ModelSpec(model=str(model)), device="cpu",
                      python=os.environ["RAY_TRAINER_VLLM_PYTHON"], vllm=ENGINE, **fields)  # fmt: skip


def _sample(engine, seed=3, **params):
    params = {"num_generations": 2, "max_completion_length": 8, "seed": seed, **params}
    return engine.generate(PROMPTS, SamplingParams(**params), prompt_indices=[7, 8, 9])


def _worst(model, completions, temperature=1.0) -> float:
    """The largest difference of the completions' recorded log-probs to the trainer's."""
    return max(
        logprob_diff(c.logprobs, trainer_logprobs(model, Probe.of(c, temperature)))
        for c in completions
    )


def _engine_probe(engine, probe: Probe) -> list[float]:
    return engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), probe.temperature)


def _certain(model, token: int = CERTAIN):
    """`model` (a copy's weights changed in place) made to say `token` whatever came before:
    attention and MLP add nothing, every token embeds alike, and the head sees only `token`."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.model.embed_tokens.weight.fill_(1.0)
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[token] = 1.0
    return model


def test_completions_logprobs_and_a_full_sync_in_place(models):
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(models["c0"]).eval()
    engine = VllmEngine.build(_spec(models["c0"]))
    try:
        print(f"\nvLLM rollout engine start: {engine.start_seconds:.1f} s")
        first = _sample(engine)
        assert [c.prompt_index for c in first] == [7, 7, 8, 8, 9, 9]
        assert all(c.version == 0 and 1 <= len(c.completion_ids) <= 8 for c in first)
        assert any(c.truncated for c in first) and _sample(engine) == first  # seeded
        assert len({tuple(c.completion_ids) for c in first}) > 1
        sampled = _worst(trainer, first)
        hot = _sample(engine, temperature=0.7)
        sampled_hot = _worst(trainer, hot, 0.7)
        # The probe: vLLM's teacher-forced prompt log-probs, at 1.0 and at a temperature.
        probe = Probe.of(first[0])
        diff = logprob_diff(_engine_probe(engine, probe), trainer_logprobs(trainer, probe))
        probe_hot = Probe.of(hot[1], 0.7)
        diff_hot = logprob_diff(
            _engine_probe(engine, probe_hot), trainer_logprobs(trainer, probe_hot)
        )
        print(f"logprob_diff fp32 CPU: sampled {sampled:.2e} (T=0.7 {sampled_hot:.2e}), "
              f"probe {diff:.2e} (T=0.7 {diff_hot:.2e})")  # fmt: skip
        assert max(sampled, sampled_hot, diff, diff_hot) < LOGPROB_BOUND

        # Full weights through /dev/shm: the engine now says CERTAIN, whatever the prompt.
        certain = _certain(AutoModelForCausalLM.from_pretrained(models["c0"]))
        stats = sync_weights(LocalTransport(engine), certain.named_parameters(), 1,
                             bucket_bytes=64 << 10)  # fmt: skip
        print(f"full sync: {stats.metrics()} in {stats.buckets} buckets")
        assert stats.bytes == sum(p.numel() * 4 for p in certain.parameters())
        said = _sample(engine)
        assert all(c.version == 1 and c.truncated for c in said)
        assert all(c.completion_ids == [CERTAIN] * 8 for c in said)
        assert max(abs(v) for c in said for v in c.logprobs) < 1e-4
        # Weights certain of the end token: each completion is that token alone, ended.
        eos = trainer.generation_config.eos_token_id
        ending = _certain(AutoModelForCausalLM.from_pretrained(models["c0"]), eos)
        sync_weights(LocalTransport(engine), ending.named_parameters(), 2)
        ended = _sample(engine)
        assert all(c.completion_ids == [eos] and not c.truncated for c in ended)
        # Back to the first weights, in place: exactly the first completions again.
        sync_weights(LocalTransport(engine), trainer.named_parameters(), 3)
        again = _sample(engine)
        assert [c.completion_ids for c in again] == [c.completion_ids for c in first]
        assert all(c.version == 3 for c in again) and _worst(trainer, again) < LOGPROB_BOUND
    finally:
        engine.close()
    assert not engine.shm.exists()


@pytest.fixture(scope="module")
def ray_session():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_lora_syncs_the_adapter_only_under_new_ids_the_base_untouched(models, ray_session):
    """In a Ray actor, as a run holds it: the adapter's buckets through Ray's object store,
    then shared memory into the child."""
    from transformers import AutoModelForCausalLM

    from ray_trainer._lora.config import wrap
    from ray_trainer._rollout.actor import RemoteEngine

    trainer = wrap(AutoModelForCausalLM.from_pretrained(models["c0"]), LORA).eval()
    adapter = [(n, p) for n, p in trainer.named_parameters() if ".lora_" in n]
    engine = RemoteEngine("auto", _spec(models["c0"], lora=LORA), {"CPU": 1})
    try:
        assert engine.info()["backend"] == "vllm"  # auto: the spec names a vLLM env
        base = _sample(engine)  # no adapter yet: the base (a fresh adapter adds zero)
        assert _worst(trainer, base) < LOGPROB_BOUND
        outputs, ids = [], []
        for version, seed in ((1, 1), (2, 2)):
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for name, param in adapter:
                    if "lora_B" in name:
                        param.normal_(0, 0.5)
            stats = engine.sync(adapter, version)
            full = sum(p.numel() * 4 for p in trainer.get_base_model().parameters())
            assert stats.bytes == sum(p.numel() * 4 for _, p in adapter) < full / 5
            ids.append(stats.receiver["lora_id"])
            tuned = _sample(engine)
            assert all(c.version == version for c in tuned)
            diff = _worst(trainer, tuned)
            print(f"\nLoRA sync v{version}: {stats.metrics()}, lora_id {ids[-1]}, "
                  f"logprob_diff {diff:.2e}")  # fmt: skip
            assert diff < LOGPROB_BOUND  # the engine samples the trainer's adapter
            outputs.append([c.completion_ids for c in tuned])
        assert ids == [1, 2]
        base_ids = [c.completion_ids for c in base]
        assert outputs[0] != base_ids and outputs[1] != outputs[0]
        # An adapter of zeros: the base's own completions, exactly: the base was never touched.
        with torch.no_grad():
            for name, param in adapter:
                if "lora_B" in name:
                    param.zero_()
        assert engine.sync(adapter, 3).receiver["lora_id"] == 3
        assert [c.completion_ids for c in _sample(engine)] == base_ids
    finally:
        engine.close()
    assert not list(Path("/dev/shm").glob("ray-trainer-rollout-*"))  # the engine's files went


def test_weights_posted_during_a_request_are_taken_between_two_decoding_steps(models, ray_session):
    """vLLM's pause inside a request: weights posted while a long request samples (the
    asynchronous run's `post`, answered at once) are loaded by the child between two of vLLM's
    decoding steps, its rows kept in the batch; the request goes on, on the new weights, and
    each completion records the version of its first token and the token from which the new
    weights sampled it. Here the new weights say CERTAIN whatever came before, so every token
    after the change shows which weights sampled it, and its log-prob is 0."""
    from transformers import AutoModelForCausalLM

    from ray_trainer._rollout.actor import RemoteEngine
    from ray_trainer._rollout.transport import post_weights

    engine = RemoteEngine("vllm", _spec(models["c0"]), {"CPU": 1})
    try:
        long = SamplingParams(num_generations=2, max_completion_length=240, seed=5)
        passed = engine.info()["boundaries"]  # the request's weights fixed once one more passed
        ref = engine.submit(PROMPTS, long, [7, 8, 9])
        certain = _certain(AutoModelForCausalLM.from_pretrained(models["c0"]))
        posted = post_weights(certain.named_parameters(), 1, bucket_bytes=64 << 10)
        probe = Probe(prompt_ids=(5, 6), completion_ids=(CERTAIN,) * 4, temperature=1.0)
        from waiting import wait_until

        wait_until(lambda: engine.info()["boundaries"] > passed, 120,
                   "the request's first boundary", interval=0.01)  # fmt: skip
        assert engine.post(posted, probe) == 0  # answered while version 0 samples
        completions, began, ended = engine.result(ref)
        print(f"\nlong request: {ended - began:.2f} s; changes at "
              f"{[c.newer_versions for c in completions]}")  # fmt: skip
        changed = [c for c in completions if c.newer_versions]
        assert changed, "no completion crossed the load: the request ended before it"
        assert all(c.version == 0 for c in completions)
        for c in changed:
            ((at, version),) = c.newer_versions
            assert version == 1 and 0 < at < len(c.completion_ids)
            assert c.completion_ids[at:] == [CERTAIN] * (len(c.completion_ids) - at)
            assert max(abs(v) for v in c.logprobs[at:]) < 1e-4
        # the rows ran in one batch: the ones still running at the pause changed at one step
        assert len({c.newer_versions[0][0] for c in changed}) == 1
        assert any(CERTAIN not in c.completion_ids[: c.newer_versions[0][0]] for c in changed)
        assert max(abs(v) for v in engine.probed(1)) < 1e-4  # scored on the new weights
        # The next request: all of it version 1's, the prefix cache of version 0 reset.
        after = _sample(engine)
        assert all(c.version == 1 and not c.newer_versions for c in after)
        assert all(c.completion_ids == [CERTAIN] * 8 for c in after)
    finally:
        engine.close()


def test_an_adapter_posted_during_a_request_replaces_the_rows_adapter_under_its_id(
    models, ray_session
):
    """LoRA: weights posted during a request are an adapter, loaded between two decoding steps
    under the LoRA id the request's rows hold, so they decode on it from their next step. The
    request starts on a zero adapter (the base); its tokens before the change are the base's
    (their recorded log-probs are the base's, teacher-forced), those after are not; the next
    request samples the new adapter exactly (the prefix cache of the old one was reset)."""
    from transformers import AutoModelForCausalLM
    from waiting import wait_until

    from ray_trainer._lora.config import wrap
    from ray_trainer._rollout.actor import RemoteEngine
    from ray_trainer._rollout.transport import post_weights

    trainer = wrap(AutoModelForCausalLM.from_pretrained(models["c0"]), LORA).eval()
    adapter = [(n, p) for n, p in trainer.named_parameters() if ".lora_" in n]
    engine = RemoteEngine("vllm", _spec(models["c0"], lora=LORA), {"CPU": 1})
    try:
        assert engine.sync(adapter, 1).receiver["lora_id"] == 1  # zeros: the base's outputs
        long = SamplingParams(num_generations=2, max_completion_length=240, seed=5)
        passed = engine.info()["boundaries"]  # the request's weights fixed once one more passed
        ref = engine.submit(PROMPTS, long, [7, 8, 9])
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            for name, param in adapter:
                if "lora_B" in name:
                    param.normal_(0, 0.5)
        posted = post_weights(adapter, 2)
        wait_until(lambda: engine.info()["boundaries"] > passed, 120,
                   "the request's first boundary", interval=0.01)  # fmt: skip
        engine.post(posted)
        completions, began, ended = engine.result(ref)
        print(f"\nlong LoRA request: {ended - began:.2f} s; changes at "
              f"{[c.newer_versions for c in completions]}")  # fmt: skip
        changed = [c for c in completions if c.newer_versions]
        assert changed, "no completion crossed the load: the request ended before it"
        with trainer.disable_adapter():
            for c in changed:
                ((at, version),) = c.newer_versions
                assert c.version == 1 and version == 2 and 0 < at < len(c.completion_ids)
                base = trainer_logprobs(trainer, Probe.of(c))
                before = logprob_diff(c.logprobs[:at], base[:at])
                after = logprob_diff(c.logprobs[at:], base[at:])
                print(f"vs the base: before the change {before:.2e}, after {after:.2e}")
                assert before < LOGPROB_BOUND < after  # the new adapter sampled the rest
        tuned = _sample(engine)
        assert all(c.version == 2 and not c.newer_versions for c in tuned)
        assert _worst(trainer, tuned) < LOGPROB_BOUND  # the new adapter, its cache fresh
        assert engine.info()["version"] == 2
    finally:
        engine.close()
