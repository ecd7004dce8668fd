"""liger-kernel's place (`liger_kernel`): where it is refused and with what words (the driver,
before Ray; each worker), which loss a Hugging Face causal LM gets (liger's, the chunked one,
the model's own) for each setting, GPU or not, triton and liger-kernel present or not, family
known or not; and, with liger's fused linear cross-entropy replaced by the same sum in plain
torch (liger needs triton and a GPU), that its forward gives the model's own loss and
gradients and leaves DPO's log-probs and ``compile=True``'s body to the chunked loss. What
liger's own kernels compute is measured on a GPU (bench/gpu tables 1 and 6)."""

from __future__ import annotations

import copy
import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

from ray_trainer import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._model import liger_probe
from ray_trainer._worker.model import liger
from ray_trainer._worker.model.chunked_loss import IGNORE_INDEX, chunked_body
from ray_trainer._worker.workload import _use_fused_loss

transformers = pytest.importorskip("transformers")
VOCAB = 97
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture
def installed(monkeypatch):
    """triton and liger-kernel found by the probes (not imported: they are not installed)."""
    real = importlib.util.find_spec

    def find_spec(name, *args):
        return object() if name in ("triton", "liger_kernel") else real(name, *args)

    monkeypatch.setattr(liger_probe.importlib.util, "find_spec", find_spec)


@pytest.fixture
def gpu_worker(installed, monkeypatch):
    """A GPU worker with liger-kernel, whose kernels and fused linear cross-entropy are the
    same computations in plain torch (the wiring around them is what is tested here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    patched: list[torch.nn.Module] = []
    monkeypatch.setattr(liger, "_apply_kernels", patched.append)
    calls: list[tuple[int, ...]] = []

    def same_sum(hidden, weight, bias, targets):
        calls.append(tuple(hidden.shape))
        return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")

    monkeypatch.setattr(liger, "fused_linear_ce_sum", same_sum)
    return {"patched": patched, "calls": calls}


# ---- refusals ------------------------------------------------------------------------------


def test_the_probe_names_the_field_and_the_fix_for_each_missing_piece(monkeypatch):
    on_cpu = liger_probe.missing_liger_kernel(use_gpu=False)
    assert "liger_kernel=True" in on_cpu and "use_gpu=True" in on_cpu
    assert "liger_kernel=False" in on_cpu and "chunked" in on_cpu
    present: set[str] = set()
    monkeypatch.setattr(
        liger_probe.importlib.util, "find_spec", lambda n, *a: object() if n in present else None
    )
    assert "pip install triton" in liger_probe.missing_liger_kernel(use_gpu=True)
    present.add("triton")
    assert "ray-trainer[gpu]" in liger_probe.missing_liger_kernel(use_gpu=True)
    present.add("liger_kernel")
    assert liger_probe.missing_liger_kernel(use_gpu=True) is None
    assert liger_probe.unsupported_family("llama") is None
    gpt2 = liger_probe.unsupported_family("gpt2")
    assert "'gpt2'" in gpt2 and "llama" in gpt2 and "liger_kernel=False" in gpt2


def test_liger_with_a_loss_of_its_own_or_the_full_logits_is_refused_at_construction():
    with pytest.raises(ValueError, match="liger_kernel=True with chunked_loss=False"):
        TrainingArgs(liger_kernel=True, chunked_loss=False)
    with pytest.raises(ValueError, match="liger_kernel=True with loss_fn"):
        TrainingArgs(liger_kernel=True, loss_fn=lambda outputs, batch: outputs)
    assert TrainingArgs(liger_kernel=False, chunked_loss=False).liger_kernel is False
    assert TrainingArgs().liger_kernel is None


def test_run_training_refuses_liger_on_cpu_workers_before_ray_starts():
    import ray

    from ray_trainer import run_training

    with pytest.raises(TrainingArgsError, match="use_gpu=True") as refusal:
        run_training(model=_llama, liger_kernel=True, max_steps=1)
    assert "liger_kernel=False" in str(refusal.value)
    assert not ray.is_initialized()


def test_the_driver_refuses_models_liger_does_not_patch(installed):
    from ray_trainer._driver.checks.model import check_model_inputs

    with pytest.raises(TrainingArgsError, match="built-in model"):
        check_model_inputs(TrainingArgs(liger_kernel=True, use_gpu=True))
    with pytest.raises(TrainingArgsError, match="'gpt2'"):
        check_model_inputs(TrainingArgs(model=_gpt2, liger_kernel=True, use_gpu=True))
    check_model_inputs(TrainingArgs(model=_llama, liger_kernel=True, use_gpu=True))  # passes


# ---- which loss the worker picks -----------------------------------------------------------


def _picked(model, **fields) -> str:
    _use_fused_loss(model, TrainingArgs(model=_llama, **fields))
    if liger.liger_applied(model):
        return "liger"
    return "chunked" if chunked_body(model) is not None else "own"


def test_the_default_and_false_keep_the_chunked_loss(gpu_worker):
    assert liger_probe.LIGER_BY_DEFAULT is False  # until a GPU lease shows liger faster
    assert _picked(_llama(), use_gpu=True) == "chunked"
    assert _picked(_llama(), use_gpu=True, liger_kernel=False) == "chunked"
    assert _picked(_llama(), use_gpu=True, liger_kernel=False, chunked_loss=False) == "own"
    assert _picked(_llama(), use_gpu=True, liger_kernel=True) == "liger"


def test_a_worker_that_cannot_run_liger_refuses_true_and_falls_back_from_the_default(
    installed, monkeypatch, caplog
):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        _picked(_llama(), use_gpu=True, liger_kernel=True)
    with pytest.raises(RuntimeError, match="use_gpu=True"):
        _picked(_llama(), liger_kernel=True)
    monkeypatch.setattr(liger, "LIGER_BY_DEFAULT", True)  # the default, once measured faster
    with caplog.at_level(logging.INFO, logger="ray_trainer"):
        assert _picked(_llama(), use_gpu=True) == "chunked"
    assert "liger-kernel off (liger_kernel=None): liger_kernel=True: this worker sees no GPU" in caplog.text  # fmt: skip


def test_a_family_or_head_liger_does_not_take_is_refused_or_left_to_the_chunked_loss(
    gpu_worker, monkeypatch
):
    with pytest.raises(RuntimeError, match="model type 'gpt2'"):
        _picked(_gpt2(), use_gpu=True, liger_kernel=True)
    monkeypatch.setattr(liger, "LIGER_BY_DEFAULT", True)
    assert _picked(_gpt2(), use_gpu=True) == "chunked"
    assert _picked(_llama(), use_gpu=True) == "liger"
    peft = pytest.importorskip("peft")
    lora_head = peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(RuntimeError, match="not a plain linear layer"):
        _picked(lora_head, use_gpu=True, liger_kernel=True)


# ---- liger's forward, its fused loss in plain torch ----------------------------------------


def _batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :4] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _loss_and_grads(model, batch, **extra):
    model.zero_grad()
    out = model(**batch, **extra)
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm", [None, 7.0])
def test_ligers_forward_gives_the_models_own_loss_and_gradients(gpu_worker, norm):
    own = _llama()
    fused = copy.deepcopy(own)
    assert liger.use_liger(fused, TrainingArgs(model=_llama, use_gpu=True, liger_kernel=True)) is None  # fmt: skip
    batch = _batch()
    extra = {} if norm is None else {"num_items_in_batch": norm}
    want, want_grads = _loss_and_grads(own, batch, **extra)
    got, got_grads = _loss_and_grads(fused, batch, **extra)
    assert gpu_worker["calls"] == [(2 * 12, 32)]  # every position, flat, through liger's loss
    assert gpu_worker["patched"] == [fused]  # its kernels on the model itself
    assert torch.allclose(got, want, rtol=1e-6)
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, rtol=1e-5, atol=1e-7), name
    # A copy (DPO's frozen reference) runs its own forward, through its own weights.
    twin = copy.deepcopy(fused)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)
        assert not torch.allclose(twin(**batch)["loss"], fused(**batch)["loss"])


def test_dpo_log_probs_generation_and_compile_stay_with_the_chunked_loss(gpu_worker):
    model = _llama()
    liger.use_liger(model, TrainingArgs(model=_llama, use_gpu=True, liger_kernel=True))
    assert chunked_body(model) is model.model  # compile=True compiles the body only
    batch = _batch()
    sequence = torch.tensor([[0] * 12, [1] * 12])
    logps = model(**batch, sequences=(sequence, 2))["logps"]
    logits = model(input_ids=batch["input_ids"]).logits  # no labels: the model's own forward
    nll = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")
    assert torch.allclose(logps, -nll.sum(1), rtol=1e-5)
    assert gpu_worker["calls"] == []  # neither went through liger's loss
