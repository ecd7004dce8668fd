"""When an asynchronous checkpoint is published (issue 21, point 2), without Ray.

`AsyncSaves.numbers` is what a rank puts into the step's all-reduce; `settle` reads the sum at
a boundary. A checkpoint is published (registered with Ray Train, then `on_save`) only when the
sum says every rank has written it, or at a save or a stop, which wait for the write first.
Publishing itself is replaced by a recorder here; the real one runs in the integration test.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ray_trainer._storage import locate
from ray_trainer._worker.boundary import Decision
from ray_trainer._worker.checkpoints import async_save
from ray_trainer._worker.checkpoints.async_save import AsyncSaves, Pending

QUIET = Decision(log=False, evaluate=False, save=False, stop=False, abort=False)
SAVE = Decision(log=False, evaluate=False, save=True, stop=False, abort=False)
STOP = Decision(log=False, evaluate=False, save=False, stop=True, abort=False)


class Summed:
    """A step's agreement as `after_boundary` reads it: the extra numbers summed over ranks."""

    def __init__(self, *extra: float) -> None:
        self.extra = extra

    def result(self):
        return self


@pytest.fixture
def published(monkeypatch):
    done: list[int] = []
    monkeypatch.setattr(async_save, "publish", lambda s, step, *_: done.append(step))
    return done


def _in_flight(saves: AsyncSaves, step: int, written: bool) -> Pending:
    pending = Pending(step, locate("/tmp/run").child(f"checkpoint_{step:08d}"), {}, 0.01)
    if written:
        pending.done.set()
    saves.pending = pending
    return pending


def test_a_rank_says_which_save_it_has_written():
    saves = AsyncSaves()
    assert saves.numbers() == (0.0, 0.0)  # nothing in flight
    pending = _in_flight(saves, 4, written=False)
    assert saves.numbers() == (0.0, 0.0)  # still writing
    pending.done.set()
    assert saves.numbers() == (4.0, 0.0)


def test_published_once_the_sum_says_every_rank_has_written_it(published):
    saves, s = AsyncSaves(), SimpleNamespace(world_size=2, rank=1)
    _in_flight(saves, 4, written=True)
    saves.settle(s, Summed(4.0, 0.0), QUIET)  # one rank of two has written it
    assert published == [] and saves.pending is not None
    saves.settle(s, Summed(8.0, 0.0), QUIET)
    assert published == [4] and saves.pending is None
    saves.settle(s, Summed(8.0, 0.0), QUIET)  # a later agreement naming it again: nothing
    assert published == [4]


def test_a_save_or_a_stop_waits_for_the_write_in_flight(published):
    saves, state = AsyncSaves(), SimpleNamespace(world_size=2, rank=1)
    for decision in (SAVE, STOP):
        _in_flight(saves, 6, written=True)  # this rank is done; the report is the barrier
        saves.settle(state, Summed(0.0, 0.0), decision)
    assert published == [6, 6]


def test_a_failed_write_fails_the_rank_at_its_next_boundary(published):
    saves = AsyncSaves()
    pending = _in_flight(saves, 2, written=True)
    pending.error = OSError("bucket gone")
    with pytest.raises(RuntimeError, match="bucket gone"):
        saves.settle(SimpleNamespace(world_size=1), Summed(0.0, 0.0), QUIET)
    assert published == []


def test_a_preemption_save_waits_for_its_write():
    saves = AsyncSaves()
    notices = iter([False, True, False])
    noticed = saves.watch(lambda: next(notices))
    assert noticed() is False and saves.numbers() == (0.0, 0.0)
    assert noticed() is True
    assert saves.numbers() == (0.0, 1.0)  # rides with the save request it made
    assert saves.numbers() == (0.0, 0.0)  # once
    saves.settle(SimpleNamespace(world_size=2, rank=1), Summed(0.0, 1.0), SAVE)
    assert saves.wait_next  # the save at this boundary waits for its write
    assert saves.watch(None) is None


def test_the_host_buffers_outlive_each_save():
    """The staging copies go into the same host buffers at every save, and a state that holds
    a class object stages again (torch 2.11's DefaultStager, closed after each stage, failed the
    second save with ``KeyError: <class 'type'>`` and dropped its buffers)."""
    import torch

    stager = async_save.host_stager(pinned=False)
    weight = torch.randn(4, 4)
    state = {"model": {"w": weight}, "optim": {"param_groups": [{"cls": torch.optim.AdamW}]}}
    first = stager.stage(state)
    first_ptr = first["model"]["w"].data_ptr()
    weight.add_(1.0)
    second = stager.stage(state)
    assert second["model"]["w"].data_ptr() == first_ptr != weight.data_ptr()
    assert torch.equal(second["model"]["w"], weight)
    assert second["optim"]["param_groups"][0]["cls"] is torch.optim.AdamW


def test_the_newest_published_step_is_recorded_by_rank_0_and_a_newer_save_is_unpublished(tmp_path):
    """A resume publishes a complete checkpoint newer than the last `on_save` (an asynchronous
    save whose group died before the boundary that would have published it)."""
    from ray_trainer._worker.checkpoints import resume, saving

    run = locate(str(tmp_path))
    rank0, rank1 = SimpleNamespace(run=run, rank=0, world_size=1), SimpleNamespace(run=run, rank=1)
    assert saving.published_step(run) == -1 and resume._unpublished(rank0, 10)
    saving.mark_published(rank1, 10)  # only rank 0 records it
    assert saving.published_step(run) == -1
    saving.mark_published(rank0, 10)
    assert saving.published_step(run) == 10
    assert not resume._unpublished(rank0, 10) and resume._unpublished(rank0, 12)
