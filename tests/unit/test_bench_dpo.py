"""The arithmetic of `bench/baselines/bench_dpo.py`: which tokens count on either side, tokens/s from a
step clock, the generated pairs and the report's targets (no Ray, no TRL)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _bench_path  # noqa: F401  (every bench folder on the path)
from bench_dpo import (
    LABELS,
    batch_tokens,
    memory_report,
    padded_positions,
    preference_pairs,
    summarise,
    tokens_per_s,
)

from ray_trainer._worker.objectives.dpo_pairs import sequence_index
from ray_trainer._worker.step.micro_batches import pack_row


def test_a_padded_batch_counts_its_attention_mask():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    batch = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask}
    assert batch_tokens(batch) == (5, 8, 2)


@pytest.mark.parametrize("pad_to", [1, 16])
def test_a_packed_row_counts_its_pairs_tokens_and_not_its_filler(pad_to):
    seqs = [(np.arange(n), np.arange(n)) for n in (5, 3, 4, 6)]  # two pairs: 18 tokens
    batch, tokens = pack_row(seqs, pad_id=0, pad_to=pad_to)
    batch["sequence"] = sequence_index([5, 3, 4, 6], batch["input_ids"].shape[1])
    batch["answer_tokens"] = torch.ones(4)
    width = 18 if pad_to == 1 else 32
    assert tokens == 18 and batch_tokens(batch) == (18, width, 4)


def test_a_filler_micro_batch_counts_no_token():
    batch, _ = pack_row([], pad_id=0, pad_to=4)  # the loader's filler is a row of its own
    batch["answer_tokens"] = torch.zeros(0)
    assert batch_tokens(batch) == (0, 1, 0)


def test_tokens_per_s_times_from_the_skipped_steps_to_the_last_begin():
    clock = {
        "begins": [0.0, 5.0, 6.0, 7.0, 8.0],  # a slow first step, then 1 s each
        "cpu": [0.0, 4.0, 4.5, 5.0, 5.5],  # half of each second on a CPU
        "tokens": [999, 100, 300, 200, 7],  # the last step is not timed
        "positions": [999, 200, 400, 400, 7],
        "sequences": [4] * 5,
    }
    out = tokens_per_s(clock, skip=1, pairs=2)
    assert out["tokens_per_s"] == pytest.approx(600 / 3)
    assert out["tokens_per_cpu_s"] == pytest.approx(600 / 1.5)
    assert out["padding_share"] == pytest.approx(1 - 600 / 1000)
    assert (out["step_s"], out["steps_timed"], out["tokens_per_step"]) == (1.0, 3, 200)
    with pytest.raises(ValueError, match="leave none"):
        tokens_per_s(clock, skip=4, pairs=2)
    with pytest.raises(ValueError, match=r"\(step, sequences\) \[\(0, 4\), \(1, 4\)"):
        tokens_per_s(clock, skip=1, pairs=4)  # every step trained 2 pairs, not 4


def test_the_pairs_are_deterministic_conversations_of_uneven_lengths():
    pairs = preference_pairs(200, seed=3)
    assert pairs == preference_pairs(200, seed=3)
    assert [m["role"] for m in pairs[0]["prompt"] + pairs[0]["chosen"]] == ["user", "assistant"]
    words = [len(p["chosen"][0]["content"].split()) for p in pairs]
    assert max(words) > 3 * min(words) and max(words) <= 260


def test_padded_positions_pad_both_rows_of_every_pair_to_the_longest():
    assert padded_positions([(10, 20)] * 8 + [(5, 7)] * 8, batch=1) == pytest.approx(
        2 * (20 * 8 + 7 * 8) / 16, rel=0.1
    )
    assert padded_positions([(10, 20), (30, 5)], batch=2) == 2 * 2 * 30


def _run(tps, rss=100 * 2**20, reference_s=1.0):
    return {
        "tokens_per_s": tps, "tokens_per_cpu_s": tps, "step_s": 1.0, "tokens_per_step": 10.0,
        "padding_share": 0.5, "torch_threads": 1, "peak_rss": rss, "peak_rss_begin": rss,
        "train_wall_s": 10.0, "steps": 10, "reference_s": reference_s,
    }  # fmt: skip


def test_the_report_gives_ratios_to_trl_padded_and_the_targets():
    rows = {
        "trl": [_run(100.0), _run(120.0)],
        "trl_ref_model": [_run(80.0)],
        "padded": [_run(99.0)],
        "packed": [_run(180.0)],
        "in_step": [_run(88.0)],
    }
    opts = argparse.Namespace(batch_size=4, steps=10, skip=2, rounds=2)
    phase = SimpleNamespace(lengths=[(10, 12)] * 40, max_tokens=96, hidden=64, layers=2,
                            weights_bytes=2**20)  # fmt: skip
    meta = {"wall_s": 5.0, "task_s": 8.0, "tasks": 2}
    out = summarise(rows, meta, phase, opts)
    assert out["ratios"][LABELS["padded"]] == pytest.approx(0.9)  # against the median, 110
    assert out["ratios"][LABELS["packed"]] == pytest.approx(180 / 110)
    assert out["in_step_ratio"] == pytest.approx(1.1)
    assert not out["target_met"] and "0.900x (>= 1.0: MISSED)" in out["table"]
    assert "1.636x (>= 1.5: met)" in out["table"]
    # The pass scored 40 pairs in 5 s; training 40 pairs (10 steps of 4) in 10 s.
    assert "| 5.0 | 8.0 | 40 | 10.0 | 40 | 0.500 | 0.500 |" in out["table"]


def test_the_memory_report_gives_each_sides_rise_with_the_reference_in_the_step():
    peaks = {"trl": _run(1, rss=100 * 2**20), "trl_ref_model": _run(1, rss=110 * 2**20),
             "padded": _run(1, rss=90 * 2**20), "in_step": _run(1, rss=93 * 2**20)}  # fmt: skip
    phase = SimpleNamespace(lengths=[(10, 12)] * 8, hidden=64, layers=2, weights_bytes=2**20)
    out = memory_report(peaks, phase)
    assert out["memory_rise_bytes"] == {"trl": 10 * 2**20, "ray-trainer": 3 * 2**20}
    assert "| 93 | +3 |" in out["memory_table"]
