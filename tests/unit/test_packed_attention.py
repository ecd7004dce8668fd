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


def test_under_torch_compile_every_row_of_one_width_runs_one_graph():
    """compile=True pads every packed row to the packing budget: rows of other samples, so other
    groups, compile nothing anew (the attention reads the layout's per-position `segments`, one
    masked SDPA), and each sample still attends to itself alone."""
    from torch._dynamo.utils import counters

    def attend(q, k, v, plan):
        return packed_attention(torch.nn.Module(), q, k, v, None, packed=plan)[0]

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, backend="aot_eager", fullgraph=True)
    width = 24
    g = torch.Generator().manual_seed(1)
    for lengths in ([7, 3, 6, 2, 6], [20, 4], [1, 1, 5, 9, 8], [24]):  # the last part: a filler
        assert sum(lengths) == width
        q, k, v = (torch.randn(1, HEADS, width, DIM, generator=g) for _ in range(3))
        got = compiled(q, k, v, layout(lengths).to("cpu"))
        assert torch.allclose(got, _alone(q, k, v, lengths), atol=1e-6), lengths
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_the_layout_names_each_positions_sample_and_moves_in_one_copy(monkeypatch):
    plan = layout([3, 1, 2])
    assert plan.segments.tolist() == [0, 0, 0, 1, 2, 2]
    # Groups: [3, 2] (2 >= half of 3) padded to 3, then [1]: gather, keep, place, g, width.
    want = [
        ([0, 1, 2, 4, 5, 5], [0, 1, 2, 3, 4], [0, 1, 2, 4, 5], 2, 3),
        ([3], [0], [3], 1, 1),
    ]
    assert [(a.tolist(), b.tolist(), c.tolist(), g, w) for a, b, c, g, w in plan.groups] == want
    moved = plan.to("meta")  # where .to copies (an accelerator's transfer call, one per array
    # before); its views' offsets are the host's
    assert moved.buffer.device.type == "meta" and moved.buffer.shape == plan.buffer.shape
    on_cpu = plan.to("cpu")
    assert on_cpu.segments.tolist() == [0, 0, 0, 1, 2, 2]
    assert [(a.tolist(), b.tolist(), c.tolist(), g, w) for a, b, c, g, w in on_cpu.groups] == want
    # One copy: the segments (at offset 0, so a compiled graph sees the same input every row)
    # and every group's arrays are views of the one moved buffer.
    views = [on_cpu.segments, *(t for a, b, c, _, _ in on_cpu.groups for t in (a, b, c))]
    assert on_cpu.segments.storage_offset() == 0
    storage = on_cpu.buffer.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in views)
    moves = []
    real_to = torch.Tensor.to

    def counted(self, *args, **kwargs):
        moves.append(self.shape)
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", counted)
    plan = layout([5, 1, 9, 2, 30, 12])  # 59 positions; groups [30], [12, 9], [5], [2, 1]
    assert [g for _, _, _, g, _ in plan.groups] == [1, 2, 1, 2]
    plan.to("cpu")
    # One copy of 240 values: the segments (59), each group's gather (g x L: 30 + 24 + 5 + 4)
    # and its keep and place (59 each); 13 copies before.
    assert moves == [(240,)]
