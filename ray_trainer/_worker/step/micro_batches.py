"""Training worker: the loader, each step's micro-batches with their token counts known on the host.

Runs in each training worker. `StepLoader` turns the epoch's shuffled order into this rank's
micro-batches for every step (`ray_trainer._data.packing` decides which samples, the same on
every rank), fetches those samples only (from the run's token cache, or the user's ``Dataset``)
and batches them: padded (right padding, an attention mask: `collate_batch`) or packed
(`pack_row`: one row per micro-batch, ``position_ids`` restarting at each sample, each sample's
first label ignored, no attention mask). Each micro-batch carries its counts, taken on the host
before it reaches the device, so the loop never syncs with the GPU to count: sample tokens
(prompt tokens too), positions (padding and filler too) and targets (the labels the model
scores).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from ray_trainer._data.cache import TokenCache
from ray_trainer._data.encode import IGNORE_INDEX
from ray_trainer._data.packing import (
    epoch_order,
    micro_batches_per_rank,
    pack_step,
    round_robin,
    steps_per_epoch,
)
from ray_trainer._data.packing import layout as plan_layout
from ray_trainer._storage import Location
from ray_trainer._worker.step.throughput import count_tokens


@dataclass
class MicroBatch:
    """One micro-batch on the host, and its counts."""

    batch: dict[str, torch.Tensor]
    tokens: int  # sample tokens, prompt tokens included (not padding or filler)
    positions: int  # every position of the batch
    targets: int  # labels the model scores: not -100, after the causal shift


class CachedDataset(Dataset):
    """A source's token cache, as a Dataset: items are ``{"input_ids", "labels"}`` tensors;
    `lengths` and `targets` per sample come with it (read once, for the packing plans)."""

    def __init__(self, cache: TokenCache, pad_id: int, index: np.ndarray | None = None) -> None:
        self.cache = cache
        self.index = np.arange(len(cache)) if index is None else np.asarray(index)
        self.lengths = cache.lengths[self.index]
        self.targets = cache.targets[self.index]
        self.pad_id = pad_id

    @classmethod
    def open(cls, location: Location, pad_id: int) -> CachedDataset:
        return cls(TokenCache(location), pad_id)

    def subset(self, indices: list[int]) -> CachedDataset:
        """The samples at `indices` (e.g. a held-out split), lengths and all."""
        return CachedDataset(
            self.cache, self.pad_id, self.index[np.asarray(indices, dtype=np.int64)]
        )

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, labels = self.cache.sample(int(self.index[i]))
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}

    def fetch(self, indices: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.cache.samples([int(self.index[i]) for i in indices])

    def collate(self, items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return collate_batch(items, self.pad_id)


@dataclass
class StepLoader:
    """This rank's micro-batches, step by step (every rank takes as many per step).

    Args:
        max_tokens: pack into micro-batches of at most this many tokens (None: padded batches
            of ``batch_size``).
        pad_to: with packing, pad each packed row to a multiple of this (1: exact lengths; the
            run's ``max_tokens`` under ``compile=True``, for one shape).
    """

    dataset: Any
    world: int
    rank: int
    batch_size: int
    grad_accum: int
    seed: int
    pad_id: int
    shifts_labels: bool = True
    collate: Callable[[list[Any]], dict[str, torch.Tensor]] | None = None
    max_tokens: int | None = None
    pad_to: int = 1
    prefetch: bool = False
    layout: bool = False  # packed rows carry their `PackedLayout` (the model's attention uses it)
    #: Page-locked host memory for a CUDA device: a copy from pageable memory first waits for
    #: every kernel queued on the stream (CUDA stages it), so the host could never prepare a
    #: step while the previous one runs; from pinned memory the copy is queued like a kernel.
    pin: bool = False
    #: The worker count a step's samples are counted for (an elastic run's `max`; default:
    #: `world`). Fewer workers than that take more micro-batches each: the step is the same.
    logical_world: int | None = None

    @property
    def step_world(self) -> int:
        """The worker count a step's samples are counted for."""
        return self.logical_world or self.world

    @property
    def per_step(self) -> int:
        """Samples a step takes from the epoch, across every rank."""
        return self.batch_size * self.grad_accum * self.step_world

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(len(self.dataset), self.per_step)

    def left_out(self, epoch: int) -> list[int]:
        """The samples `epoch`'s order puts past its last whole step: too few for a step, no
        step takes them (the epoch's remainder, dropped as ``drop_last`` does)."""
        order = epoch_order(len(self.dataset), self.seed, epoch)
        return order[self.steps_per_epoch * self.per_step :].tolist()

    def steps(self, epoch: int, start: int = 0) -> Iterator[list[MicroBatch]]:
        """The micro-batches of each step of `epoch`, from step `start` (a resumed run)."""
        steps = self._steps(epoch, start)
        return _prefetched(steps) if self.prefetch else steps

    def _steps(self, epoch: int, start: int) -> Iterator[list[MicroBatch]]:
        order = epoch_order(len(self.dataset), self.seed, epoch)
        n = self.per_step
        for step in range(start, self.steps_per_epoch):
            samples = order[step * n : (step + 1) * n].tolist()
            yield self.micro_batches(samples)

    def micro_batches(self, samples: list[int]) -> list[MicroBatch]:
        """This rank's micro-batches of one step's `samples`."""
        if self.max_tokens is None:
            mine = [
                self._padded(ids)
                for ids in round_robin(samples, self.world, self.rank, self.batch_size)
            ]
            short = padded_micro_batches(len(samples), self.world, self.batch_size) - len(mine)
            micro = mine
            if short:  # only then: a filler copies the last micro-batch
                micro = mine + [_no_loss(mine[-1])] * short
        else:
            plan = pack_step(samples, self.dataset.lengths, self.world, self.max_tokens)
            mine = [self._packed(b) for b in plan[self.rank]]
            micro = mine + [self._filler()] * (micro_batches_per_rank(plan) - len(mine))
        return [_pinned(m) for m in micro] if self.pin else micro

    # ---- batching --------------------------------------------------------------------------

    # An objective's dataset over the token cache (DPO's pairs) lays out its own micro-batches:
    # `padded`, `packed`, and `fill_filler` for the keys a filler carries besides the inputs.

    def _padded(self, ids: list[int]) -> MicroBatch:
        if hasattr(self.dataset, "padded"):
            return self.dataset.padded(ids)
        if isinstance(self.dataset, CachedDataset):
            pairs = self.dataset.fetch(ids)
            items = [
                {"input_ids": torch.from_numpy(a), "labels": torch.from_numpy(b)} for a, b in pairs
            ]
            batch = self.dataset.collate(items)
            tokens = sum(len(a) for a, _ in pairs)
            targets = int(self.dataset.targets[ids].sum())
            return MicroBatch(batch, tokens, batch["input_ids"].numel(), targets)
        items = [self.dataset[i] for i in ids]
        batch = (self.collate or default_collate)(items)
        tokens, positions = count_tokens(batch, self.pad_id)
        targets = count_targets(batch, self.shifts_labels)
        return MicroBatch(batch, int(tokens), int(positions), targets)

    def _packed(self, ids: list[int]) -> MicroBatch:
        if hasattr(self.dataset, "packed"):
            return self.dataset.packed(ids, self.pad_to, self.layout)
        pairs = self.dataset.fetch(ids)
        batch, tokens = pack_row(pairs, self.pad_id, self.pad_to, self.layout)
        targets = int(self.dataset.targets[ids].sum())
        return MicroBatch(batch, tokens, batch["input_ids"].shape[1], targets)

    def _filler(self) -> MicroBatch:
        """For a rank with fewer micro-batches than another at this step: one that takes no
        loss (all labels ignored), so every rank runs the same collectives."""
        filler = np.full(max(2, self.pad_to), self.pad_id, dtype=np.int64)
        batch, _ = pack_row([], self.pad_id, len(filler), self.layout)
        fill = getattr(self.dataset, "fill_filler", None)
        if fill is not None:
            fill(batch)
        return MicroBatch(batch, 0, len(filler), 0)


def _pinned(micro: MicroBatch) -> MicroBatch:
    """`micro` with its tensors, and a packed row's layout, in page-locked host memory (torch's
    caching host allocator)."""
    batch = {k: v.pin_memory() if hasattr(v, "pin_memory") else v for k, v in micro.batch.items()}
    return MicroBatch(batch, micro.tokens, micro.positions, micro.targets)


def _no_loss(micro: MicroBatch) -> MicroBatch:
    """A filler for a padded step where this rank has fewer micro-batches than another (an
    elastic run on fewer workers than its `max`): a real micro-batch counted as no target and
    no token, so it takes no loss but runs the same collectives. Its integer labels are all
    ignored (a model that sums its own loss then adds zero); without them (no labels, or float
    labels) it is the same samples again, and the step takes its zero from the model's
    outputs (``workload.zero_loss``)."""
    batch = dict(micro.batch)
    if ignores_labels(batch):
        batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
    return MicroBatch(batch, 0, micro.positions, 0)


def ignores_labels(batch: dict[str, Any]) -> bool:
    """Whether a batch's labels can be ignored one by one (integer labels, -100 ignored). A
    micro-batch without such labels (none, or a regression's float labels) has no target only
    as an elastic run's filler: real samples again, on which the model's loss is finite."""
    labels = batch.get("labels")
    return torch.is_tensor(labels) and not labels.dtype.is_floating_point


def padded_micro_batches(samples: int, world: int, batch_size: int) -> int:
    """The micro-batches every rank takes at a padded step of `samples` samples dealt
    round-robin over `world` ranks (the most any rank has)."""
    most = -(-samples // world)
    return -(-most // batch_size)


def pack_row(
    pairs: list[tuple[np.ndarray, np.ndarray]], pad_id: int, pad_to: int = 1, layout: bool = False
) -> tuple[dict[str, Any], int]:
    """One packed row of samples ``(input_ids, labels)``: ``position_ids`` restarting at each
    sample, each sample's first label ignored (never predicted from the previous sample), the
    row padded to a multiple of `pad_to` by a filler that is a sample of its own and takes no
    loss; with `layout`, the row's `PackedLayout` under ``"packed"``. Returns (batch, tokens)."""
    tokens = sum(len(a) for a, _ in pairs)
    width = max(-(-tokens // pad_to) * pad_to, 1)
    input_ids = np.full(width, pad_id, dtype=np.int64)
    labels = np.full(width, IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros(width, dtype=np.int64)
    lengths, at = [], 0
    for a, b in pairs:
        k = len(a)
        input_ids[at : at + k] = a
        labels[at + 1 : at + k] = b[1:]
        positions[at : at + k] = np.arange(k)
        lengths.append(k)
        at += k
    if at < width:  # the filler
        positions[at:] = np.arange(width - at)
        lengths.append(width - at)
    batch: dict[str, Any] = {
        "input_ids": torch.from_numpy(input_ids)[None],
        "labels": torch.from_numpy(labels)[None],
        "position_ids": torch.from_numpy(positions)[None],
    }
    if layout:
        batch["packed"] = plan_layout(lengths)
    return batch, tokens


def collate_batch(items: Sequence[dict[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Stack variable-length items into a right-padded batch with an ``attention_mask``.

    ``input_ids`` are padded with ``pad_id``, ``labels`` with ``-100`` (no loss on padding) and
    the attention mask is 1 on real tokens, 0 on padding (an item's own ``attention_mask`` is
    kept). Other keys are batched by torch's ``default_collate``. Runs in the DataLoader of
    each training worker.
    """
    if not items:
        raise ValueError("collate_batch needs at least one item")
    ids = [torch.as_tensor(it["input_ids"], dtype=torch.long) for it in items]
    for it, x in zip(items, ids, strict=True):
        if x.dim() != 1:
            raise ValueError(f"input_ids must be 1-D per item, got shape {tuple(x.shape)}")
        if "labels" in it and len(it["labels"]) != len(x):
            raise ValueError(
                f"labels ({len(it['labels'])}) and input_ids ({len(x)}) differ in length"
            )
    width = max(len(x) for x in ids)
    batch_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, (it, x) in enumerate(zip(items, ids, strict=True)):
        n = len(x)
        batch_ids[row, :n] = x
        labels[row, :n] = torch.as_tensor(it.get("labels", x), dtype=torch.long)
        if "attention_mask" in it:
            mask[row, :n] = torch.as_tensor(it["attention_mask"], dtype=torch.long)
        else:
            mask[row, :n] = 1
    batch = {"input_ids": batch_ids, "labels": labels, "attention_mask": mask}
    rest = [k for k in items[0] if k not in batch]
    if rest:
        batch.update(default_collate([{k: it[k] for k in rest} for it in items]))
    return batch


def count_targets(batch: dict[str, torch.Tensor], shifts_labels: bool) -> int:
    """The labels a model scores in a host batch: those that are not -100 (after the causal
    shift for a causal LM: position 0 is never scored); every label for float labels (a
    regression); every sample without labels."""
    labels = batch.get("labels")
    if labels is None:
        return len(next(iter(batch.values())))
    if labels.dtype.is_floating_point:
        return labels.numel()
    if shifts_labels and labels.dim() >= 2:
        labels = labels[..., 1:]
    return int((labels != IGNORE_INDEX).sum())


def _prefetched(steps: Iterator[list[MicroBatch]]) -> Iterator[list[MicroBatch]]:
    """The next step's samples read in a background thread while this one trains (a cache on a
    bucket: each sample is a ranged read)."""
    ready: queue.Queue = queue.Queue(maxsize=1)
    done = object()

    def produce() -> None:
        try:
            for step in steps:
                ready.put(step)
        except BaseException as e:  # handed to the loop, raised there
            ready.put(e)
        ready.put(done)

    threading.Thread(target=produce, name="step-prefetch", daemon=True).start()
    while (item := ready.get()) is not done:
        if isinstance(item, BaseException):
            raise item
        yield item
