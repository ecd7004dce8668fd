"""The arithmetic of `bench/memory/bench_memory.py`: what counts as a rank's bytes
(`bench/memory/_memory_counting.py`), how the ranks' reports become one configuration's figures, and
the target (no process group, no Ray)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_path  # noqa: F401  (every bench folder on the path)
from _memory_counting import local_bytes, state_bytes
from bench_memory import PHASES, compare, summarise, target_ratio


class _Shard:
    """Stands in for a DTensor: its local shard is what a rank holds."""

    def __init__(self, local: torch.Tensor) -> None:
        self.local = local

    def to_local(self) -> torch.Tensor:
        return self.local


def test_a_dtensor_counts_its_local_shard_and_a_tensor_counts_whole():
    assert local_bytes(torch.zeros(10, 4)) == 160
    assert local_bytes(torch.zeros(3, dtype=torch.bfloat16)) == 6
    assert local_bytes(_Shard(torch.zeros(5, 4))) == 80


def test_state_bytes_after_an_adamw_step_counts_a_tied_weight_once():
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(8, 4)  # 32 floats
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight  # tied, as GPT-2's lm_head and wte
            self.norm = torch.nn.LayerNorm(4)  # 8 floats

    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters())
    before = state_bytes(model, optimizer)
    assert before == {"params": 160, "grads": 0, "optimizer": 0}
    out = model.head(model.norm(model.embed(torch.tensor([1, 2]))))
    out.sum().backward()
    optimizer.step()
    # AdamW: exp_avg and exp_avg_sq per parameter (2 x 160) plus a 4-byte step per parameter.
    assert state_bytes(model, optimizer) == {"params": 160, "grads": 160, "optimizer": 320 + 3 * 4}


def _rank(params, save_s, disk, rss=100, cuda=None, numel=10):
    return {
        "params": params,
        "grads": params,
        "optimizer": 2 * params,
        "numel": numel,
        "save_s": save_s,
        "disk_bytes": disk,
        "files": 1,
        "peak_rss": {phase: rss for phase in PHASES},
        "cuda_peak": cuda,
    }


def test_a_configuration_is_its_largest_rank_and_its_slowest_saves_over_every_run():
    first = [_rank(30, [1.0, 5.0], 300, rss=7), _rank(29, [4.0, 1.0], 290, rss=9)]
    second = [_rank(30, [2.0, 6.0], 300, rss=11), _rank(29, [0.5, 0.5], 290, rss=3)]
    s = summarise([first, second])
    assert (s["params"], s["state"]) == (30, 120)  # rank 0 holds the larger shard
    # Per save the slowest rank: 4, 5 (first run), 2, 6 (second); their median and range.
    assert (s["save_s"], s["save_range"]) == (4.5, (2.0, 6.0))
    assert (s["disk_bytes"], s["files"], s["cuda_peak"]) == (590, 2, None)
    assert s["peak_rss"] == dict.fromkeys(PHASES, 11)
    assert summarise([[_rank(1, [1.0], 1, cuda=5), _rank(1, [1.0], 1, cuda=8)]])["cuda_peak"] == 8


@pytest.mark.parametrize(("world", "target"), [(1, 1.1), (2, 0.55), (4, 0.275)])
def test_the_target_is_one_over_n_plus_ten_percent(world, target):
    assert target_ratio(world) == pytest.approx(target)


def test_compare_gives_ratios_to_ddp_and_whether_the_target_is_met():
    ddp = summarise([[_rank(100, [2.0], 400), _rank(100, [0.0], 0)]])
    met = compare(ddp, summarise([[_rank(54, [3.0], 250), _rank(50, [3.0], 240)]]), 2)
    assert met["state"] == pytest.approx(0.54) and met["met"]
    assert met["save_s"] == pytest.approx(1.5) and met["disk_bytes"] == pytest.approx(490 / 400)
    missed = compare(ddp, summarise([[_rank(56, [1.0], 1), _rank(50, [1.0], 1)]]), 2)
    assert missed["state"] == pytest.approx(0.56) and not missed["met"]


def test_the_load_target_is_a_share_of_the_fp32_model_and_one_tensor():
    from _memory_load import load_target, summarise_load

    model = {"fp32_bytes": 1000, "largest_bytes": 100}
    assert load_target(model, 2, "fsdp") == 650  # 500 x 1.1 + 100
    assert load_target(model, 4, "fsdp") == 375
    assert load_target(model, 2, "ddp") == 1200  # every DDP worker holds the whole model
    ranks = [
        {
            "added": 5,
            "after_load": 4,
            "hwm": 9,
            "load_s": 1.0,
            "first_step_s": 2.0,
            "param_bytes": 3,
            "base_bytes": 2,
        },
        {
            "added": 7,
            "after_load": 3,
            "hwm": 8,
            "load_s": 1.5,
            "first_step_s": 1.0,
            "param_bytes": 3,
            "base_bytes": 1,
        },
    ]
    assert summarise_load(ranks) == {
        "added": 7, "after_load": 4, "hwm": 9, "load_s": 1.5, "first_step_s": 2.0, "param_bytes": 3,
        "base_bytes": 2,  # the frozen parameters' (QLoRA's 4-bit base): the largest rank's
    }  # fmt: skip


def test_a_save_pause_is_the_boundaries_excess_over_a_run_without_saves():
    from bench_save import boundary_gaps, pause_per_save

    clock = {"begins": [0.0, 1.1, 2.2, 4.0, 5.1], "ends": [1.0, 2.1, 3.0, 5.0, 6.0]}
    gaps = boundary_gaps(clock)
    assert gaps == pytest.approx([0.1, 0.1, 1.0, 0.1])
    # A save every 3 steps: boundary 3 took 0.9 s more than usual; nothing was published later.
    assert pause_per_save(gaps, 0.1, 3) == pytest.approx((0.9, 0.0))
    assert pause_per_save([0.1, 0.5, 0.1, 0.1], 0.1, 3) == pytest.approx((0.0, 0.4))


def test_the_loss_phase_compares_the_rise_with_the_logits_and_finds_the_fitting_length():
    from _memory_loss import VOCAB, MiB, summarise_loss

    def row(length, chunked, added_mib, step_s=1.0, chunk=None):
        return {"length": length, "chunked": chunked, "added": added_mib * MiB,
                "step_s": step_s, "chunk": chunk}  # fmt: skip

    logits = VOCAB * 4 / MiB  # MiB of fp32 logits per token
    rows = [
        row(1024, False, 1000), row(2048, False, 1000 + 4 * 1024 * logits),
        row(4096, False, 1000 + 12 * 1024 * logits),
        row(1024, True, 400, chunk=65), row(2048, True, 410, chunk=65),
        row(4096, True, 430, chunk=65), row(8192, True, 470, chunk=65),
    ]  # fmt: skip
    share = {"conversations": 2, "positions": 100, "targets": 25, "share": 0.25}
    sweep = [row(1024, True, 400, step_s=1.5, chunk=16), row(1024, True, 400, chunk=256)]
    out = summarise_loss(rows, share, sweep)
    # From 1k to 4k: the full loss rose 12 x 1k tokens of logits over 3 x 1k of growth: 4x.
    assert out["ratios"]["loss_rise_full_x_logits"] == pytest.approx(4.0)
    assert out["ratios"]["loss_rise_chunked_x_logits"] == pytest.approx(30 / (3 * 1024 * logits))
    # Every chunked length stays under the full loss's peak at 2k: 8k fits, 4x the length.
    assert out["ratios"]["loss_length_at_budget_x"] == 4.0
    assert out["ratios"]["loss_chunk_16_step_x"] == 1.5
    assert out["ratios"]["loss_chunk_256_step_x"] == 1.0
    assert "target <= 0.3x: met" in out["table"] and "25.0%" in out["table"]
