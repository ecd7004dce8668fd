"""Training worker: DPO's batch layout, preference pairs from a token cache of sequences.

Runs in each training worker. The preparation tasks write a pair as two consecutive sequences
of the token cache (chosen ``2p``, rejected ``2p + 1``); :class:`PairDataset` deals whole pairs
to the loader's plans, so a pair's two sequences are always in one micro-batch (padded: 2 rows
per pair; packed: one row, each sequence attending to itself alone), with the keys the DPO loss
reads besides the model's inputs (``dpo.PAIR_KEYS``) and a filler's empty ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ray_trainer._data.cache import TokenCache
from ray_trainer._worker.step.micro_batches import (
    CachedDataset,
    MicroBatch,
    collate_batch,
    pack_row,
)


class PairDataset(Dataset):
    """Preference pairs (DPO) from a token cache of sequences laid out pair by pair: sequence
    ``2p`` is pair ``p``'s prompt + chosen answer, ``2p + 1`` its prompt + rejected answer
    (``_data/prepare.py``). Items are pairs: the loader's plans, packed or padded, move whole
    pairs, so a pair's two sequences are always in one micro-batch. `lengths` are a pair's
    tokens (both sequences), `targets` count 1 per pair (the step's agreement sums pairs: the
    loss is the mean over the global batch's pairs); `reference` holds each sequence's summed
    reference log-probability (None: the step computes it)."""

    def __init__(
        self, sequences: CachedDataset, reference: np.ndarray | None, index: Any = None
    ) -> None:
        if len(sequences) % 2:
            raise ValueError(
                f"{sequences.cache.location.name}: {len(sequences)} sequences is not a whole "
                "number of pairs (a token cache of preference pairs holds chosen, rejected, ...)"
            )
        self.sequences = sequences
        self.reference = reference
        self.index = np.arange(len(sequences) // 2) if index is None else np.asarray(index)
        both = sequences.lengths
        self.lengths = both[2 * self.index] + both[2 * self.index + 1]
        self.targets = np.ones(len(self.index), dtype=np.int64)
        self.answer_targets = sequences.targets  # per sequence: the answer's scored tokens
        self.pad_id = sequences.pad_id

    @property
    def cache(self) -> TokenCache:
        return self.sequences.cache

    def subset(self, indices: list[int]) -> PairDataset:
        return PairDataset(
            self.sequences, self.reference, self.index[np.asarray(indices, dtype=np.int64)]
        )

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> int:
        return int(i)  # `collate` reads the pairs (the validation DataLoader's items)

    def rows(self, ids: Sequence[int]) -> list[int]:
        """The cache's sequence numbers of pairs `ids`: chosen, rejected, chosen, ..."""
        return [int(2 * p + k) for p in self.index[np.asarray(ids, dtype=np.int64)] for k in (0, 1)]

    def fetch(self, ids: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        return self.sequences.cache.samples(self.rows(ids))

    def extras(self, ids: Sequence[int]) -> dict[str, torch.Tensor]:
        """What a micro-batch of pairs `ids` carries besides the model's inputs (``dpo.py``):
        each sequence's answer tokens and, when precomputed, its reference log-probability."""
        rows = self.rows(ids)
        out = {"answer_tokens": torch.from_numpy(self.answer_targets[rows].astype(np.float32))}
        if self.reference is not None:
            out["ref_logps"] = torch.from_numpy(self.reference[rows].astype(np.float32))
        return out

    def padded(self, ids: Sequence[int]) -> MicroBatch:
        """A padded micro-batch of pairs `ids`: 2 rows per pair."""
        seqs = self.fetch(ids)
        items = [{"input_ids": torch.from_numpy(a), "labels": torch.from_numpy(b)} for a, b in seqs]
        batch = collate_batch(items, self.pad_id)
        rows, width = batch["input_ids"].shape
        batch["sequence"] = torch.arange(rows)[:, None].expand(rows, width).contiguous()
        batch.update(self.extras(ids))
        tokens = sum(len(a) for a, _ in seqs)
        return MicroBatch(batch, tokens, rows * width, len(ids))

    def packed(self, ids: Sequence[int], pad_to: int, layout: bool) -> MicroBatch:
        """A packed row of pairs `ids`: every sequence attends to itself alone."""
        seqs = self.fetch(ids)
        batch, tokens = pack_row(seqs, self.pad_id, pad_to, layout)
        batch["sequence"] = sequence_index([len(a) for a, _ in seqs], batch["input_ids"].shape[1])
        batch.update(self.extras(ids))
        return MicroBatch(batch, tokens, batch["input_ids"].shape[1], len(ids))

    def collate(self, ids: list[int]) -> dict[str, torch.Tensor]:
        return self.padded(ids).batch

    def fill_filler(self, batch: dict[str, Any]) -> None:
        """A filler micro-batch's pair keys: no pair (its labels are all ignored)."""
        empty_pairs(batch)


def sequence_index(lengths: list[int], width: int) -> torch.Tensor:
    """``[1, width]``: which sequence of a packed row each position belongs to (the filler
    after them: the last one's, it has no target)."""
    index = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    out = np.full(width, max(len(lengths) - 1, 0), dtype=np.int64)
    out[: len(index)] = index
    return torch.from_numpy(out)[None]


def empty_pairs(batch: dict[str, Any]) -> dict[str, Any]:
    """A DPO filler's extra keys: no pair (its labels are all ignored)."""
    batch["sequence"] = torch.zeros_like(batch["input_ids"])
    batch["answer_tokens"] = torch.zeros(0)
    batch["ref_logps"] = torch.zeros(0)
    return batch
