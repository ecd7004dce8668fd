"""QLoRA's row-block quantization (issue 52, the load's memory): `nf4.quantize_rows` gives
torchao's ``to_nf4`` codes bit for bit, each rank's part as ``torch.chunk`` splits them, while
reading the weight a bounded block of rows at a time; `nf4.nearest` picks torchao's code."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao")

from ray_trainer._model.nf4 import (
    CHUNK_VALUES,
    nearest,
    quantize,
    quantize_rows,
    scaler_block,
    torchao_nf4,
)

INNER = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")


def _same(a, b) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and (a.n_blocks, a.scaler_block_size) == (b.n_blocks, b.scaler_block_size)
        and all(torch.equal(getattr(a, k), getattr(b, k)) for k in INNER)
    )


@pytest.mark.parametrize(
    ("shape", "dtype", "world"),
    [
        ((512, 1024), torch.float32, 1),  # several chunks of rows
        ((1024, 704), torch.float32, 2),  # rows of 11 blocks
        ((384, 96), torch.bfloat16, 4),  # 1.5 blocks a row: chunks of an even number of rows
        ((64, 200), torch.float32, 1),  # a row of 3.125 blocks
    ],
)
def test_quantize_rows_is_torchaos_to_nf4_bit_for_bit_each_rank_reading_bounded_blocks(
    shape, dtype, world
):
    whole = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    size = scaler_block(shape, world)
    reference = torchao_nf4().to_nf4(whole.to(dtype), 64, size)
    reads: list[tuple[int, int]] = []

    def read(a: int, b: int) -> torch.Tensor:
        reads.append((a, b))
        return whole[a:b]  # the files' dtype (bf16), converted by quantize_rows

    for rank in range(world):
        reads.clear()
        part = quantize_rows(read, shape, dtype, size, world, rank)
        assert _same(part, torch.chunk(reference, world, dim=0)[rank])
        assert torch.equal(
            part.get_original_weight(), reference.get_original_weight().chunk(world)[rank]
        )
        # Every row read once for the scales, then this rank's rows once for the codes; never
        # more than CHUNK_VALUES values (or one block-aligned group of rows) at a time.
        rows = shape[0]
        assert sum(b - a for a, b in reads) == rows + rows // world
        assert max((b - a) * shape[1] for a, b in reads) <= max(CHUNK_VALUES, 2 * 64 * shape[1])
    # `quantize` (a real weight, whole) goes the same way.
    assert _same(quantize(whole.to(dtype), world), reference)


def test_nearest_is_torchaos_nearest_code_on_codes_midpoints_and_their_neighbours():
    nf4 = torchao_nf4()
    for dtype in (torch.float32, torch.bfloat16):
        lut = nf4.to_nf4(torch.ones(64, dtype=dtype), 64, 1).nf4
        mids = (lut[1:] + lut[:-1]) / 2
        up, down = torch.tensor(2.0, dtype=dtype), torch.tensor(-2.0, dtype=dtype)
        values = torch.cat([
            torch.rand(200_000, generator=torch.Generator().manual_seed(1)).mul(2).sub(1).to(dtype),
            lut, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
            torch.nextafter(lut, up), torch.nextafter(lut, down),
        ])  # fmt: skip
        expected = nf4.NF4Tensor.quantize_tensor_nearest(values, lut).to(torch.uint8)
        assert torch.equal(nearest(values, lut), expected)
