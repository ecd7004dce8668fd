"""GRPO under QLoRA (issue 52): the trainer's 4-bit base, loaded as a worker loads it (on the
meta device, each weight quantized as it is read), syncs its adapter alone into an ``hf``
rollout engine that quantized the same base, and the probe's difference is fp32's noise.

What the GRPO objective sends is its own selection (`grpo_engines.Engines._named`, the rank's
module), through the transport the runner uses (`sync_weights`); no Ray, one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("torchao")

QLORA = {"r": 4, "lora_alpha": 8, "quantize_base": "nf4"}
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41]]


@pytest.fixture(scope="module")
def chat(tmp_path_factory) -> str:
    from ray_trainer._demo.chat import make_tiny_chat_model

    return str(make_tiny_chat_model(tmp_path_factory.mktemp("qlora_rollout") / "chat"))


def _worker_model(path: str):
    """The QLoRA policy as a training worker builds it: on meta, quantized, wrapped, filled."""
    from ray_trainer import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.adaptation import apply_lora
    from ray_trainer._worker.model.build import build_model

    args = TrainingArgs(model=path, lora=QLORA)
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    model, fill, _ = apply_lora(model, fill, spec, args)
    fill(model, torch.device("cpu"))
    return args, model


def test_a_qlora_trainer_syncs_its_adapter_alone_and_the_probe_matches_the_engine(chat):
    from ray_trainer._model.nf4 import is_nf4, resident_bytes
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._rollout.engine import EngineSpec, SamplingParams
    from ray_trainer._rollout.engines import build_engine
    from ray_trainer._rollout.probe import Probe, logprob_diff, trainer_logprobs
    from ray_trainer._rollout.transport import LocalTransport, sync_weights
    from ray_trainer._worker.objectives.grpo_engines import Engines

    engine = build_engine("hf", EngineSpec(ModelSpec(model=chat), lora=QLORA, batch_size=4))
    args, trainer = _worker_model(chat)
    # One step moves the adapter (B from zero): the engine's old adapter is now stale.
    torch.manual_seed(1)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    trainer(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD([p for p in trainer.parameters() if p.requires_grad], lr=20.0).step()
    trainer.eval()
    params = SamplingParams(num_generations=2, max_completion_length=6, seed=3)
    probe = Probe.of(engine.generate(PROMPTS, params, prompt_indices=[0, 1])[0])
    before = logprob_diff(engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0), trainer_logprobs(trainer, probe))  # fmt: skip
    assert before > 1e-3  # the stale adapter: a difference the probe sees

    state = SimpleNamespace(args=args, rank=0, parallel=SimpleNamespace(module=lambda: trainer))
    named = list(Engines(state, engine.spec, probe)._named())
    adapter = {n for n, p in trainer.named_parameters() if p.requires_grad}
    assert {n for n, _ in named} == adapter and all(".lora_" in n for n in adapter)
    assert not any(is_nf4(t) for _, t in named)  # no 4-bit base weight is sent
    stats = sync_weights(LocalTransport(engine), named, 1)
    adapter_bytes = sum(t.numel() * t.element_size() for _, t in named)
    base_bytes = sum(resident_bytes(p) for p in trainer.parameters() if not p.requires_grad)
    assert stats.tensors == len(adapter) and stats.bytes == adapter_bytes < base_bytes
    # The engine now samples from the trainer's policy: the same 4-bit base, the new adapter.
    after = logprob_diff(engine.logprobs(list(probe.prompt_ids), list(probe.completion_ids), 1.0), trainer_logprobs(trainer, probe))  # fmt: skip
    assert after < 1e-5
    engine_base = dict(engine.model.named_parameters())
    layer = "base_model.model.model.layers.0.mlp.down_proj.base_layer.weight"
    assert is_nf4(engine_base[layer]) and torch.equal(
        engine_base[layer].get_original_weight(),
        dict(trainer.named_parameters())[layer].get_original_weight(),
    )  # the engine's own 4-bit base is the trainer's, code for code
