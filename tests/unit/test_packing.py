"""Which samples each rank trains on at each step: padded like DistributedSampler, or packed
best-fit-decreasing and balanced across ranks; resumable mid-epoch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from ray_trainer._data.packing import epoch_order, micro_batches_per_rank, pack, pack_step
from ray_trainer._worker.step.micro_batches import StepLoader, collate_batch


class Lengths(torch.utils.data.Dataset):
    """A dataset of token samples of given lengths, with the fetch/lengths interface of the
    token cache (sample i is [i, i, ..., i] with its first token unlabelled)."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)
        self.targets = np.maximum(self.lengths - 1, 0)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        ids, labels = self.fetch([i])[0]
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def fetch(self, indices):
        out = []
        for i in indices:
            ids = np.full(int(self.lengths[i]), 1000 + i, dtype=np.int64)
            labels = ids.copy()
            labels[0] = -100
            out.append((ids, labels))
        return out


def test_the_epoch_order_is_distributed_samplers():
    data = list(range(37))
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=5)
    sampler.set_epoch(3)
    assert epoch_order(37, seed=5, epoch=3).tolist() == list(sampler)


def test_padded_steps_are_what_distributed_sampler_and_a_data_loader_gave():
    data = Lengths([3] * 50)
    for rank in (0, 1):
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, seed=7, drop_last=True)
        sampler.set_epoch(1)
        loader = DataLoader(range(50), batch_size=4, sampler=sampler, drop_last=True)
        expected = [b.tolist() for b in loader]
        steps = StepLoader(data, world=2, rank=rank, batch_size=4, grad_accum=2, seed=7, pad_id=0)
        assert steps.steps_per_epoch == 50 // (4 * 2 * 2) == 3
        got = [m.batch["input_ids"][:, 0].sub(1000).tolist() for s in steps.steps(1) for m in s]
        assert got == expected[: 3 * 2]


def test_a_resumed_epoch_continues_with_the_same_samples():
    data = Lengths([random.Random(i).randint(2, 9) for i in range(64)])
    for max_tokens in (None, 16):
        loader = StepLoader(
            data, world=2, rank=1, batch_size=2, grad_accum=2, seed=3, pad_id=0,
            max_tokens=max_tokens, collate=lambda items: collate_batch(items, 0),
        )  # fmt: skip
        full = [[m.batch["input_ids"].tolist() for m in s] for s in loader.steps(epoch=2)]
        resumed = [[m.batch["input_ids"].tolist() for m in s] for s in loader.steps(2, start=3)]
        assert resumed == full[3:] and len(full) == loader.steps_per_epoch == 8


def test_best_fit_decreasing_fills_bins_and_keeps_every_sample_once():
    rng = random.Random(0)
    lengths = [rng.randint(1, 60) for _ in range(200)]
    bins = pack(range(200), lengths, max_tokens=64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    sizes = [sum(lengths[i] for i in b) for b in bins]
    assert max(sizes) <= 64
    # Any-fit packing leaves at most one bin half empty (two such bins would have merged).
    assert sum(1 for size in sizes if size <= 32) <= 1
    assert pack(range(200), lengths, 64) == bins  # deterministic: every rank computes the same


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_step_is_dealt_to_the_ranks_balanced_by_count_and_tokens(world):
    rng = random.Random(world)
    lengths = [int(rng.lognormvariate(3.5, 0.8)) % 120 + 1 for _ in range(96)]
    plan = pack_step(list(range(96)), lengths, world, max_tokens=128)
    seen = sorted(i for bins in plan for b in bins for i in b)
    assert seen == list(range(96))
    counts = [len(bins) for bins in plan]
    assert max(counts) - min(counts) <= 1 and micro_batches_per_rank(plan) == max(counts)
    tokens = [sum(lengths[i] for b in bins for i in b) for bins in plan]
    assert max(tokens) - min(tokens) <= 128  # within one micro-batch's worth


def test_packed_rows_restart_positions_and_ignore_each_samples_first_label():
    data = Lengths([3, 5, 2, 7, 4, 6, 1, 8])
    loader = StepLoader(
        data, world=2, rank=0, batch_size=2, grad_accum=2, seed=0, pad_id=0, max_tokens=10
    )
    (step,) = list(loader.steps(0))
    plan = pack_step(epoch_order(8, 0, 0).tolist(), data.lengths, 2, 10)
    assert len(step) == micro_batches_per_rank(plan)
    for micro, bin_ in zip(step, plan[0], strict=False):
        ids = micro.batch["input_ids"][0].tolist()
        labels = micro.batch["labels"][0].tolist()
        positions = micro.batch["position_ids"][0].tolist()
        assert "attention_mask" not in micro.batch
        at = 0
        for i in bin_:
            n = int(data.lengths[i])
            assert ids[at : at + n] == [1000 + i] * n
            assert positions[at : at + n] == list(range(n))
            assert labels[at] == -100 and labels[at + 1 : at + n] == [1000 + i] * (n - 1)
            at += n
        assert micro.tokens == micro.positions == at  # exact length: no padding
        assert micro.targets == sum(int(data.lengths[i]) - 1 for i in bin_)


def test_a_rank_short_of_micro_batches_gets_a_filler_without_loss():
    data = Lengths([9, 9, 9])  # three bins of 9 tokens for two ranks

    def step(rank, **kw):
        return StepLoader(
            data, world=2, rank=rank, batch_size=1, grad_accum=1, seed=0, pad_id=0, **kw
        ).micro_batches([0, 1, 2])

    ranks = [step(r, max_tokens=9) for r in (0, 1)]
    assert [len(m) for m in ranks] == [2, 2]  # every rank takes as many micro-batches
    fillers = [m for micro in ranks for m in micro if m.tokens == 0]
    assert len(fillers) == 1
    assert (fillers[0].batch["labels"] == -100).all() and fillers[0].targets == 0
    # compile=True pads every packed row to max_tokens: one shape, no recompilation.
    for micro in step(0, max_tokens=12, pad_to=12):
        assert micro.batch["input_ids"].shape == (1, 12) and micro.positions == 12
        assert micro.tokens == 9


def test_an_elastic_step_on_fewer_workers_takes_the_same_samples_with_fillers():
    data = Lengths([4] * 40)

    def ranks(world, logical):
        def collate(items):
            return collate_batch(items, 0)

        options = dict(batch_size=1, grad_accum=1, seed=5, pad_id=0, collate=collate)
        return [
            StepLoader(data, world=world, rank=r, logical_world=logical, **options)
            for r in range(world)
        ]

    full, smaller = ranks(3, 3), ranks(2, 3)
    assert smaller[0].per_step == full[0].per_step == 3
    assert smaller[0].steps_per_epoch == full[0].steps_per_epoch == 13
    for max_tokens in (None, 4):
        for loaders in (full, smaller):
            for loader in loaders:
                loader.max_tokens = max_tokens
        want = sorted(
            int(m.batch["input_ids"][0, 0]) for lo in full for m in next(lo.steps(1)) if m.targets
        )
        steps = [next(lo.steps(1)) for lo in smaller]
        # Every rank takes as many micro-batches; the one short of a sample gets a filler.
        assert [len(s) for s in steps] == [2, 2]
        real = [m for s in steps for m in s if m.targets]
        fillers = [m for s in steps for m in s if not m.targets]
        assert sorted(int(m.batch["input_ids"][0, 0]) for m in real) == want  # the same samples
        assert len(fillers) == 1 and fillers[0].tokens == 0
        assert (fillers[0].batch["labels"] == -100).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory needs a GPU")
def test_steps_for_a_gpu_come_in_page_locked_memory_with_the_same_values():
    # From pageable memory a copy to the GPU first waits for the queued kernels: every tensor of
    # every micro-batch (fillers too) is pinned, padded and packed, and nothing else changes.
    data = Lengths([9, 9, 9])  # three bins of 9 tokens for two ranks: rank 1 gets a filler
    for max_tokens, packed in ((None, False), (10, False), (10, True)):
        # With `layout`, a packed row's layout too, its one buffer (`PackedLayout.pin_memory`).
        kw = dict(world=2, rank=1, batch_size=1, grad_accum=1, seed=0, pad_id=0, layout=packed)
        plain = StepLoader(data, max_tokens=max_tokens, **kw).micro_batches([0, 1, 2])
        pinned = StepLoader(data, max_tokens=max_tokens, pin=True, **kw).micro_batches([0, 1, 2])
        assert len(pinned) == len(plain) >= 2
        for a, b in zip(plain, pinned, strict=True):
            assert (a.tokens, a.positions, a.targets) == (b.tokens, b.positions, b.targets)
            assert a.batch.keys() == b.batch.keys()
            for key, value in b.batch.items():
                want = a.batch[key]
                if key == "packed":  # a packed row's layout: its one buffer
                    value, want = value.buffer, torch.as_tensor(want.buffer)
                assert value.is_pinned() and torch.equal(value, want), key
