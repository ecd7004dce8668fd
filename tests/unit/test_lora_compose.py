"""LoRA composes with `compile=True` and with bf16 mixed precision (one process, no Ray): the
runner's own `apply_lora` on a base built on the meta device and filled, then the runner's
`_compile` (the whole model, as under DDP) gives the eager loss and adapter gradients; under
bf16 autocast the adapters get gradients, the frozen base gets none and stays fp32."""

from __future__ import annotations

import pytest
import torch

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    from ray_trainer._demo.tiny_hf import make_tiny_causal_lm

    path = tmp_path_factory.mktemp("lora_compose") / "base"
    return str(make_tiny_causal_lm(path, n_layer=2, dropout=0.0))


def _lora_model(base: str, **fields):
    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.model.adaptation import apply_lora
    from ray_trainer._worker.model.build import build_model

    args = TrainingArgs(model=base, lora=LORA, **fields)
    spec = ModelSpec.of(args)
    model, fill = build_model(spec)
    model, fill, _ = apply_lora(model, fill, spec, args)
    fill(model, torch.device("cpu"))
    return args, model


def _loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


def test_compiled_lora_gives_the_eager_loss_and_adapter_gradients(base):
    from ray_trainer._model.compile_probe import missing_compile_toolchain
    from ray_trainer._worker.model.parallel import _compile

    if missing_compile_toolchain(False):
        pytest.skip(missing_compile_toolchain(False))
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    _, eager = _lora_model(base)
    args, compiled = _lora_model(base, compile=True)
    loss_e, grads_e = _loss_and_grads(eager, ids)
    _compile(compiled, args)
    loss_c, grads_c = _loss_and_grads(compiled, ids)
    assert grads_e and all(".lora_" in n for n in grads_e)
    assert torch.allclose(loss_c, loss_e, atol=1e-5)
    for name, grad in grads_e.items():
        assert torch.allclose(grads_c[name], grad, atol=1e-5), name


def test_under_bf16_autocast_adapters_learn_and_the_frozen_base_stays_fp32(base):
    _, model = _lora_model(base)
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert trained and frozen
    assert all(p.grad is not None for p in trained.values())
    # lora_B starts at zero (so lora_A's first gradient is zero too): B is what learns first.
    assert all(p.grad.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)
    assert all(p.grad is None for p in frozen.values())
    assert all(p.dtype == torch.float32 for p in model.parameters())
