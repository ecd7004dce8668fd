"""`chunked_loss`: the loss and the targets' log-probabilities from the last hidden states, a
chunk of positions at a time, equal the full-logits computation (fp32: 1e-6) with its gradients,
keep no logits for backward, and reach the head's parameters with no target at all."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ray_trainer._worker.model.chunked_loss import (
    IGNORE_INDEX,
    _fused_sum,
    chunked_loss_sum,
    default_chunk_size,
    sequence_logprobs,
    shifted_targets,
    token_nll,
)

VOCAB, DIM = 101, 16


class LoraHead(nn.Module):
    """A projection with a low-rank adapter beside it, as peft puts one on ``lm_head``."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(DIM, VOCAB, bias=False)
        self.a = nn.Linear(DIM, 4, bias=False)
        self.b = nn.Linear(4, VOCAB, bias=False)
        nn.init.normal_(self.b.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


def _batch(seed=0, rows=3, length=40, masked=0.6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, length, DIM, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, VOCAB, (rows, length), generator=g)
    labels[torch.rand(rows, length, generator=g) < masked] = IGNORE_INDEX  # user turns
    return hidden, labels


def _full_loss_sum(hidden, labels, head):
    """Today's path: every position's logits, upcast, Hugging Face's shift."""
    logits = head(hidden).float()
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), shifted_targets(labels).reshape(-1), reduction="sum"
    )


def _grads(loss_fn, hidden, head):
    hidden = hidden.clone().requires_grad_(True)
    head.zero_grad()
    loss = loss_fn(hidden)
    loss.backward()
    return loss.detach(), hidden.grad, {n: p.grad.clone() for n, p in head.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 7, 32, 10_000])
@pytest.mark.parametrize("head_kind", ["linear", "lora"])
def test_loss_and_gradients_equal_the_full_logits_path(chunk, head_kind):
    torch.manual_seed(0)
    head = nn.Linear(DIM, VOCAB, bias=False) if head_kind == "linear" else LoraHead()
    hidden, labels = _batch()
    targets = shifted_targets(labels)
    full = _grads(lambda h: _full_loss_sum(h, labels, head), hidden, head)
    chunked = _grads(lambda h: chunked_loss_sum(h, targets, head, chunk), hidden, head)
    assert _within(chunked[0], full[0])
    assert _within(chunked[1], full[1])  # the hidden states' gradient (to the body)
    for name, grad in full[2].items():
        assert _within(chunked[2][name], grad), name


def _within(got, want, tol=1e-6):
    """Equal within `tol` relative to the whole tensor's norm (fp32 matmuls of other shapes
    round single elements differently, by an ulp: ~1e-7 of the norm here)."""
    return (got - want).norm() <= tol * want.norm()


def test_the_sum_does_not_depend_on_how_the_rows_are_split():
    head = nn.Linear(DIM, VOCAB)
    hidden, labels = _batch(seed=1, rows=4)
    targets = shifted_targets(labels)
    whole = chunked_loss_sum(hidden, targets, head, 16)
    parts = sum(chunked_loss_sum(hidden[i : i + 1], targets[i : i + 1], head, 16) for i in range(4))
    assert torch.allclose(whole, parts, rtol=1e-6)


def test_packed_and_padded_rows_give_the_same_sum():
    """Two sequences packed in one row, or each in its own row padded with no target: the same
    targets, the same sum (the hidden states are given; the body's masking is not at stake)."""
    head = nn.Linear(DIM, VOCAB)
    hidden, labels = _batch(seed=2, rows=2, length=20, masked=0.3)
    packed_h = torch.cat([hidden[0], hidden[1]]).unsqueeze(0)
    packed_t = torch.cat([shifted_targets(labels[0]), shifted_targets(labels[1])]).unsqueeze(0)
    pad_h = torch.cat([hidden, torch.zeros(2, 5, DIM)], dim=1)
    pad_t = torch.cat([shifted_targets(labels), torch.full((2, 5), IGNORE_INDEX)], dim=1)
    a = chunked_loss_sum(packed_h, packed_t, head, 8)
    b = chunked_loss_sum(pad_h, pad_t, head, 8)
    assert torch.allclose(a, b, rtol=1e-6)


def test_no_logits_are_kept_for_backward():
    """What autograd saves in forward: the chunked path keeps the chunks' inputs only; the full
    path keeps a ``[positions, vocab]`` tensor (so the check can fail)."""
    head = nn.Linear(DIM, VOCAB)
    hidden, labels = _batch(seed=3, rows=2, length=64, masked=0.0)
    targets = shifted_targets(labels)

    def largest_vocab_tensor(loss_fn):
        seen = []

        def pack(t):
            if t.shape and t.shape[-1] == VOCAB and t.dim() > 1 and t.shape[0] != VOCAB:
                seen.append(t.numel() // VOCAB)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(hidden.clone().requires_grad_(True))
        return max(seen, default=0)

    assert largest_vocab_tensor(lambda h: _full_loss_sum(h, labels, head)) >= 2 * 63
    assert largest_vocab_tensor(lambda h: chunked_loss_sum(h, targets, head, 16)) == 0


def test_no_target_is_an_exact_zero_that_reaches_the_head():
    head = LoraHead()
    hidden = torch.randn(2, 5, DIM, requires_grad=True)
    targets = torch.full((2, 5), IGNORE_INDEX)
    loss = chunked_loss_sum(hidden, targets, head, 4)
    assert loss.item() == 0.0
    loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in head.parameters())
    assert token_nll(hidden, targets, head, 4).shape == (0,)


def test_sequence_logprobs_sum_each_sequences_targets():
    head = nn.Linear(DIM, VOCAB)
    hidden, labels = _batch(seed=4, rows=1, length=30, masked=0.2)
    targets = shifted_targets(labels)
    sequence = torch.tensor([[0] * 12 + [1] * 18])  # two sequences packed in one row
    got = sequence_logprobs(hidden, targets, sequence, 2, head, 5)
    logp = torch.log_softmax(head(hidden).float(), dim=-1)[0]
    want = torch.zeros(2)
    for t in range(30):
        if targets[0, t] != IGNORE_INDEX:
            want[sequence[0, t]] += logp[t, targets[0, t]]
    assert torch.allclose(got, want, rtol=1e-6)


def test_bf16_stays_close_to_fp32():
    """Under bf16 the chunks' logits are upcast as the full path's are: the sum stays within
    bf16's rounding of the fp32 one (the head's matmul is bf16 either way)."""
    head = nn.Linear(DIM, VOCAB)
    hidden, labels = _batch(seed=5)
    targets = shifted_targets(labels)
    fp32 = chunked_loss_sum(hidden, targets, head, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = chunked_loss_sum(hidden, targets, head, 16)
        full_bf16 = _full_loss_sum(hidden, labels, head)
    assert bf16.dtype == torch.float32
    assert torch.allclose(bf16, full_bf16, rtol=1e-6)  # the same rows, the same rounding
    assert torch.allclose(bf16, fp32, rtol=2e-2)


@pytest.mark.parametrize("chunk", [7, 10_000])
@pytest.mark.parametrize("bias", [False, True])
def test_every_position_at_fixed_shapes_gives_the_same_loss_and_gradients(chunk, bias):
    """The GPU's way (no selection of the targets' positions, so no host-device sync): those
    without a target add an exact zero, to the loss and to every gradient."""
    torch.manual_seed(0)
    head = nn.Linear(DIM, VOCAB, bias=bias)
    hidden, labels = _batch(seed=6)
    targets = shifted_targets(labels)
    full = _grads(lambda h: _full_loss_sum(h, labels, head), hidden, head)
    fixed = _grads(lambda h: _fused_sum(h, targets, head, chunk, select=False), hidden, head)
    assert _within(fixed[0], full[0])
    assert _within(fixed[1], full[1])
    assert not fixed[1][targets == IGNORE_INDEX].any()  # a position without a target: no gradient
    for name, grad in full[2].items():
        assert _within(fixed[2][name], grad), name
    none = torch.full_like(targets, IGNORE_INDEX)
    zero = _grads(lambda h: _fused_sum(h, none, head, chunk, select=False), hidden, head)
    assert zero[0].item() == 0.0 and not zero[1].any()
    assert all(not g.any() for g in zero[2].values()) and len(zero[2]) == (2 if bias else 1)


@pytest.mark.parametrize("bias", [False, True])
def test_a_vocabulary_padded_for_the_gpu_gives_the_same_loss_and_gradients(bias):
    """On a GPU the head is padded to a multiple of 64 rows (zero rows, logits -inf) so that its
    products run on aligned kernels: the loss and every gradient are the unpadded ones, and the
    head's gradients keep the head's shape."""
    torch.manual_seed(0)
    head = nn.Linear(DIM, VOCAB, bias=bias)
    assert VOCAB % 64  # the padding is exercised
    hidden, labels = _batch(seed=8)
    targets = shifted_targets(labels)
    full = _grads(lambda h: _full_loss_sum(h, labels, head), hidden, head)
    padded = _grads(lambda h: _fused_sum(h, targets, head, 7, select=False, align=64), hidden, head)
    assert _within(padded[0], full[0])
    assert _within(padded[1], full[1])
    for name, grad in full[2].items():
        assert padded[2][name].shape == grad.shape and _within(padded[2][name], grad), name


def test_the_fused_gradients_under_bf16_match_the_head_s_own_backward():
    """Under autocast the fused pass multiplies in bf16 as the head's own backward does, and sums
    the weight's gradient in fp32: close to the full path's gradients at bf16's rounding."""
    torch.manual_seed(0)
    head = nn.Linear(DIM, VOCAB, bias=False)
    hidden, labels = _batch(seed=7)
    targets = shifted_targets(labels)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        full = _grads(lambda h: _full_loss_sum(h, labels, head), hidden, head)
        fused = _grads(lambda h: _fused_sum(h, targets, head, 16, select=False), hidden, head)
    assert fused[1].dtype == hidden.dtype and fused[2]["weight"].dtype == torch.float32
    assert _within(fused[0], full[0], 1e-2)
    assert _within(fused[1], full[1], 2e-2)
    assert _within(fused[2]["weight"], full[2]["weight"], 2e-2)


def test_the_default_chunk_keeps_a_chunks_logits_near_32_mib_and_is_never_tiny():
    # GPUs take 1 GiB, in whole multiples of 64 positions (5,340 and 2,092 rounded down)
    assert default_chunk_size(50_257, "cuda") == 5_312
    assert default_chunk_size(128_256, "cuda") == 2_048
    assert default_chunk_size(32_000) == 262
    assert default_chunk_size(128_256) == 256  # 128 MiB of logits: tiny chunks are slow
    assert default_chunk_size(50) == 167_772  # a tiny vocabulary: one chunk in practice
    assert default_chunk_size(10**9) == 256
    with pytest.raises(ValueError, match="loss_chunk_size"):
        token_nll(torch.zeros(1, 2, DIM), torch.zeros(1, 2, dtype=torch.long), nn.Identity(), 0)
