"""`packed_attention`: each packed sample attends to itself alone, in the dtype SDPA gives, so a
bf16 autocast over an fp32 query (a rotary model's, in fp32) writes its bf16 result (the failure
the first packed run on an H100 hit: ``index_copy_`` of BFloat16 into a Float output)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ray_trainer._data.packing import layout
from ray_trainer._worker.model.packed_attention import packed_attention

HEADS, DIM = 2, 8


def _alone(q, k, v, lengths):
    """Each sample's causal attention on its own, laid back in the row: [1, T, H, D]."""
    parts, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        parts.append(
            F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True)
        )
        start += n
    return torch.cat(parts, dim=2).transpose(1, 2)


@pytest.mark.parametrize("autocast", [False, True])
def test_each_sample_attends_to_itself_alone_in_sdpa_s_dtype(autocast):
    lengths = [7, 3, 6, 2]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, HEADS, sum(lengths), DIM, generator=g) for _ in range(3))
    plan = layout(lengths).to("cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, _ = packed_attention(torch.nn.Module(), q, k, v, None, packed=plan)
        want = _alone(q, k, v, lengths)
    assert got.shape == (1, sum(lengths), HEADS, DIM)
    assert got.dtype == want.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert torch.allclose(got.float(), want.float(), atol=1e-2 if autocast else 1e-6)
