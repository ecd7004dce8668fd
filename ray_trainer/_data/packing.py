"""Workers (and benchmarks): which samples each rank trains on at each step, packed or padded.

Runs in every training worker, the same on every rank: each rank computes the whole plan of a
step from the epoch's shuffled order and the samples' lengths (known to every rank from the
token cache), so no rank waits for another to agree on it. A step takes the next
``batch_size x grad_accum_steps x num_workers`` samples of the epoch, packed or not, so steps,
epochs and schedules mean the same either way.

* Padded (`round_robin`): rank r takes every W-th sample of the step, in micro-batches of
  ``batch_size`` (what ``DistributedSampler`` and a ``DataLoader`` did).
* Packed (`pack_step`): the step's samples are packed best-fit-decreasing into bins of at most
  ``max_tokens`` tokens, and the bins are dealt to the ranks so that every rank gets the same
  number of micro-batches (give or take one: `pack_step` tells how many each must take; a rank
  short of one trains on a filler whose labels are all ignored) and about the same tokens.

A packed row's `layout` (a `PackedLayout`: which positions belong to which sample, by groups of
similar lengths) is planned here too, on the host, for the worker's packed attention
(``ray_trainer._worker.model.packed_attention``), which runs each group of samples on its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's sample order: the permutation ``DistributedSampler`` uses (same seed and
    epoch, same order), so resumed and earlier runs see the same samples."""
    if not shuffle:
        return np.arange(n)
    import torch

    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator).numpy()


def steps_per_epoch(n: int, per_step: int) -> int:
    """Whole steps in an epoch of n samples (the incomplete last step is dropped)."""
    return n // per_step


def round_robin(step: Sequence[int], world: int, rank: int, batch_size: int) -> list[list[int]]:
    """This rank's micro-batches of a step, padded batching: every W-th sample from `rank`."""
    mine = list(step[rank::world])
    return [mine[i : i + batch_size] for i in range(0, len(mine), batch_size)]


def pack(
    ids: Sequence[int], lengths: Sequence[int] | np.ndarray, max_tokens: int
) -> list[list[int]]:
    """Best-fit-decreasing: the samples `ids` in bins of at most `max_tokens` tokens, each
    sample into the fullest bin it still fits (ties broken by position, so every rank computes
    the same bins). A sample longer than `max_tokens` gets a bin of its own."""
    order = sorted(ids, key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin number), sorted
    for i in order:
        size = int(lengths[i])
        at = bisect.bisect_left(room, (size, -1))
        if at < len(room):
            left, b = room.pop(at)
            bins[b].append(i)
            bisect.insort(room, (left - size, b))
        else:
            bins.append([i])
            bisect.insort(room, (max_tokens - size, len(bins) - 1))
    return bins


def pack_step(
    step: Sequence[int], lengths: Sequence[int] | np.ndarray, world: int, max_tokens: int
) -> list[list[list[int]]]:
    """Every rank's packed micro-batches of a step: ``plan[rank]`` is a list of bins. Bins go,
    largest first, to the rank with the fewest bins (then the fewest tokens), so the counts
    differ by at most one and the tokens are balanced."""
    bins = pack(step, lengths, max_tokens)
    sized = sorted(((sum(int(lengths[i]) for i in b), b) for b in bins), key=lambda t: -t[0])
    plan: list[list[list[int]]] = [[] for _ in range(world)]
    tokens = [0] * world
    for size, b in sized:
        rank = min(range(world), key=lambda r: (len(plan[r]), tokens[r], r))
        plan[rank].append(b)
        tokens[rank] += size
    return plan


def micro_batches_per_rank(plan: list[list[list[int]]]) -> int:
    """How many micro-batches every rank takes at this step (the most any rank has)."""
    return max(len(bins) for bins in plan)


# ---- the layout of a packed row ------------------------------------------------------------

#: A group's samples are padded to its longest; a sample joins a group while its length is at
#: least this share of the group's longest (so padding at most doubles a sample's attention).
GROUP_RATIO = 0.5


@dataclass
class PackedLayout:
    """Where each sample of a packed row is, two ways. By groups of similar lengths (what an
    eager model's attention reads): for each group of g samples padded to L, the row positions
    to gather (``gather``, g*L), the entries that are real (``keep``) and their row positions
    (``place``). And by position (what a compiled model's attention reads): ``segments``, the
    sample of each position of the row, one array of the row's width whatever its samples, so
    that a new row compiles nothing anew (the groups' sizes and count change from row to row).

    All of them are views of one int64 array, `buffer` (the segments first, at offset 0, then
    each group's three arrays), planned on the host: `to` copies it to the model's device once,
    not once per array (a row of 5 groups was 16 copies, each a host-to-device transfer call on
    a GPU), and `pin_memory` page-locks it, so that the copy is queued like a kernel. `index`
    holds each group's g, L and real entries, in order; `width` is the row's."""

    buffer: Any
    index: tuple[tuple[int, int, int], ...]
    width: int
    groups: list[tuple[Any, Any, Any, int, int]] = field(init=False, repr=False)
    segments: Any = field(init=False, repr=False)

    def __post_init__(self) -> None:
        sizes = [self.width]
        for g, width, real in self.index:
            sizes += [g * width, real, real]
        if isinstance(self.buffer, np.ndarray):  # planned: slices (np.split is slower)
            parts, at = [], 0
            for n in sizes:
                parts.append(self.buffer[at : at + n])
                at += n
        else:  # a tensor: its views in one call (faster than a slice each)
            parts = self.buffer.split(sizes)
        self.segments = parts[0]
        self.groups = [(*parts[1 + 3 * i : 4 + 3 * i], g, width)
                       for i, (g, width, _) in enumerate(self.index)]  # fmt: skip

    def to(self, device: Any, non_blocking: bool = False) -> PackedLayout:
        """The layout as tensors on `device` (the loop moves every value of a batch so): one
        copy of `buffer`, the arrays views of it."""
        import torch

        buffer = torch.as_tensor(self.buffer).to(device, non_blocking=non_blocking)
        return PackedLayout(buffer, self.index, self.width)

    def pin_memory(self) -> PackedLayout:
        """The layout in page-locked host memory (as a tensor's ``pin_memory``)."""
        import torch

        return PackedLayout(torch.as_tensor(self.buffer).pin_memory(), self.index, self.width)


def layout(lengths: list[int]) -> PackedLayout:
    """The layout of a row whose samples have `lengths`, in order (on the host, no sync)."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, current = [], []
    for i in order:
        if current and lengths[i] < GROUP_RATIO * lengths[current[0]]:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    width = sum(lengths)
    parts = [np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)]  # the segments
    index = []
    for members in groups:
        longest = lengths[members[0]]
        steps = np.arange(longest, dtype=np.int64)
        gather = np.concatenate([starts[i] + np.minimum(steps, lengths[i] - 1) for i in members])
        real = np.concatenate([steps < lengths[i] for i in members])
        keep = np.flatnonzero(real)
        parts += [gather, keep, gather[keep]]
        index.append((len(members), longest, len(keep)))
    return PackedLayout(np.concatenate(parts), tuple(index), width)
