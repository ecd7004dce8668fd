"""Activation checkpointing as the runner applies it (`parallel.checkpoint_forward`): each block's
forward under non-reentrant `torch.utils.checkpoint`. Under torch.compile of the model's body
(what ``compile=True`` does under DDP with the chunked loss) and bf16 autocast, backward gives
the losses and gradients of the model without it; the composable ``checkpoint(block)`` it
replaced failed there ("recomputed metadata"), on CPU as on an H200. A copy of a checkpointed
model runs its own weights."""

from __future__ import annotations

import copy

import pytest
import torch

from ray_trainer._worker.model.parallel import checkpoint_forward

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     use_cache=False)  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _steps(model, n=3):
    """`n` AdamW steps in bf16 autocast: the losses, and the first step's gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    losses, grads = [], None
    for _ in range(n):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(float(loss))
    return losses, grads


#: Inductor's decompositions and its min-cut partitioner (which honours the checkpoint's recompute
#: tags), without its C++ code generation: ~6 CPU-seconds here against ~60 for "inductor". The
#: composable ``checkpoint(block)`` this replaced fails under it as under inductor ("recomputed
#: metadata"; under plain "aot_eager" too). Inductor's own kernels are `test_lora_compose.py`'s
#: and the compiled runs' of `tests/integration` (test_compile.py, test_dpo.py).
BACKEND = "aot_eager_decomp_partition"


def test_a_compiled_checkpointed_body_trains_as_without_checkpointing():
    plain, checkpointed = _gpt2(), _gpt2()
    for block in checkpointed.transformer.h:
        checkpoint_forward(block)
    assert [n for n, _ in checkpointed.named_parameters()] == [
        n for n, _ in plain.named_parameters()
    ]
    # As `compile=True` compiles it (dynamic shapes automatic); the reference runs eager.
    checkpointed.transformer.compile(backend=BACKEND)
    try:
        got_losses, got = _steps(checkpointed)  # first: nothing compiled before it
        want_losses, want = _steps(plain)
    finally:
        torch._dynamo.reset()
    assert got_losses == pytest.approx(want_losses, rel=1e-2)  # bf16: recomputed, refused
    for name in want:
        assert (got[name] - want[name]).norm() <= 5e-2 * want[name].norm() + 1e-6, name


def test_a_copy_of_a_checkpointed_model_runs_its_own_weights():
    model = _gpt2()
    for block in model.transformer.h:
        checkpoint_forward(block)
    copied = copy.deepcopy(model)
    block = copied.transformer.h[0]
    assert block.forward.__self__ is block
    assert block._ray_trainer_inner_forward.__self__ is block
    with torch.no_grad():
        for p in copied.transformer.h.parameters():
            p.mul_(2.0)
    ids = torch.arange(16)[None]
    assert copied(input_ids=ids).logits.ne(model(input_ids=ids).logits).any()
