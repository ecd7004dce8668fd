"""Training worker: a distributed sampler that can start part-way through an epoch.

Runs in each training worker.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data.distributed import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` (drop_last, so every rank gets the same count) plus `set_start`.

    `set_epoch(e)` reshuffles deterministically per epoch, as usual; `set_start(n)` skips the
    first `n` indices of this rank's shard in the current epoch, so a resumed run sees exactly the
    samples it had not yet seen. The skip applies to one epoch: `set_start(0)` for the next.
    """

    def __init__(self, dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int) -> None:
        super().__init__(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=True,
        )
        self.start = 0

    def set_start(self, start: int) -> None:
        self.start = max(0, min(start, self.num_samples))

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return self.num_samples - self.start
