"""Training worker: asynchronous checkpoints (``async_checkpoint=True``), written while training goes on.

Runs in each training worker; every rank takes each step below at the same boundary.

1. **Stage** (the only pause): the state is copied into host buffers that are reused from
   save to save (DCP's ``StateDictStager``, which keeps one buffer per tensor it has seen): under
   FSDP every rank's shards of model and optimizer, under DDP rank 0's whole model and
   optimizer. The small files (trainer state, scheduler, callback state, RNG, the ``hf/``
   config and tokenizer) are written now, into a local folder.
2. **Write**, in a background thread: under FSDP ``dcp.save`` of the staged shards on a gloo
   process group of its own (created once, by every rank at a save boundary), never on the
   training group, which the loop keeps using; under DDP rank 0 ``torch.save``s the staged
   state. The ``hf/`` weights are written here too, off the pause: under FSDP each tensor is
   gathered from the staged shards over the same gloo group and rank 0 streams it into the
   safetensors file. On a bucket everything goes to a temporary folder first and is uploaded;
   on a local or shared path straight into the checkpoint folder. Each rank's manifest
   (``rank<r>.complete``) is written last, so nothing passes for complete before every rank's
   files are there (and a stale manifest of an earlier attempt is removed first).
3. **Publish**, at a later boundary, once every rank has written: each rank puts the step of
   the save it has written into the step's all-reduce (`numbers`), and when the sum says all
   of them, every rank registers the checkpoint with Ray Train (``ray.train.report`` with
   ``CheckpointUploadMode.NO_UPLOAD``: the files are already in the run's storage; a barrier
   across ranks) and rank 0 fires ``on_save`` with the checkpoint's own step. Only then does
   the checkpoint count: the callback actor, ``EvalOnSave``, ``status``, Ray Train's retention
   and ``ray.train.get_checkpoint`` see it.

At most one save is in flight: the next save, a stop, the end of the run and a save asked for
by a preemption notice wait for the write (then publish at once); so does the final save. A
crash while writing leaves a folder without every manifest: not a checkpoint, and a restart
resumes from the previous one.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray.train
import torch
import torch.distributed as dist

from ray_trainer import _checkpoint as ckpt
from ray_trainer._checkpoint.names import checkpoint_dir_name
from ray_trainer._model.nf4 import dequantized
from ray_trainer._storage import Location
from ray_trainer._worker.boundary import Decision
from ray_trainer._worker.checkpoints import export
from ray_trainer._worker.checkpoints.saving import (
    checkpoint_location,
    mark_published,
    rank_part,
    state_to_save,
    write_state,
)
from ray_trainer._worker.state import WorkerState

logger = logging.getLogger("ray_trainer")

#: The fields of the context that `on_save` reports as they were when the state was staged.
_SNAPSHOT = ("global_step", "epoch", "samples_seen", "tokens_seen", "loss")


@dataclass
class Pending:
    """One save in flight: staged, being written by `thread`."""

    step: int
    location: Location  # the checkpoint folder in the run's storage
    context: dict[str, Any]  # `_SNAPSHOT` of the context at the save
    staged_s: float  # how long staging paused training
    written_s: float = 0.0  # how long this rank's background write took
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def wait(self) -> None:
        """Wait for this rank's write; raise what it failed with."""
        self.done.wait()
        if self.error is not None:
            raise RuntimeError(f"writing {self.location.name} failed: {self.error}") from self.error


def host_stager(pinned: bool) -> Any:
    """What copies a state dict into host buffers that every later save reuses (pinned on a
    GPU machine). DCP's `StateDictStager` itself, kept for the whole run: in torch 2.11
    `DefaultStager` closes it after every stage, which drops the cached buffers (each save
    would allocate and pin them again) and empties its copy table, so the second save of a
    state that holds a class object fails with ``KeyError: <class 'type'>`` (seen on an H200).
    `DefaultStager` where that class is missing."""
    try:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
    except ImportError:  # pragma: no cover - a torch that has moved it
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        return DefaultStager(StagingOptions(pinned, False, False, False))
    return StateDictStager(pin_memory=pinned, share_memory=False)


class AsyncSaves:
    """This rank's asynchronous checkpoints: the one in flight, the staging buffers, the
    checkpoint process group. Lives in `WorkerState.saves` when ``async_checkpoint=True``."""

    def __init__(self) -> None:
        self.pending: Pending | None = None
        self.urgent = False  # a preemption notice asked for a save since the last step
        self.wait_next = False  # the save at this boundary was asked for by one: it waits
        self._stager: Any = None
        self._group: Any = None

    # ---- at every step and boundary ----------------------------------------------------------

    def numbers(self) -> tuple[float, float]:
        """This rank's numbers for the step's all-reduce: the step of the save in flight once
        this rank has written it (else 0: every rank must say the same step), and 1 when a
        preemption notice asked for a save that must wait for its write."""
        p, urgent = self.pending, self.urgent
        self.urgent = False
        written = p.step if p is not None and p.done.is_set() and p.error is None else 0
        return float(written), 1.0 if urgent else 0.0

    def watch(self, notice: Any) -> Any:
        """`notice` (rank 0's preemption notice) that also marks the save it asks for as one
        that waits for its write."""
        if notice is None:
            return None

        def noticed() -> bool:
            if notice():
                self.urgent = True
                return True
            return False

        return noticed

    def settle(self, s: WorkerState, agreement: Any, decision: Decision) -> None:
        """At a boundary, before its save: publish the save in flight once the agreement says
        every rank has written it; at a save (one in flight at most) or a stop, wait for this
        rank's write first. Every rank decides the same: all or none publish (a barrier)."""
        extra = agreement.result().extra if agreement is not None else ()
        self.wait_next = len(extra) > 1 and extra[1] > 0
        p = self.pending
        if p is None:
            return
        if p.error is not None:
            p.wait()  # raises: this rank's write failed
        written = len(extra) > 0 and extra[0] == p.step * s.world_size
        if written or decision.save or decision.stop:
            self.finish(s)

    def finish(self, s: WorkerState) -> None:
        """Wait for this rank's write of the save in flight, then publish it (every rank)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        p.wait()
        publish(s, p.step, p.location, p.context)
        if s.rank == 0:
            logger.info(
                "%s: training paused %.2f s to stage it; rank 0 wrote it in %.1f s, in the "
                "background", p.location.name, p.staged_s, p.written_s,
            )  # fmt: skip

    # ---- a save --------------------------------------------------------------------------------

    def save(self, s: WorkerState, final: bool) -> None:
        """Stage the state and start writing it; with `final` (or after a preemption notice)
        wait for the write and publish. Every rank calls it at the same boundary."""
        self.finish(s)  # at most one in flight (settle has normally done it already)
        started = time.perf_counter()
        p = s.progress
        location = s.run.child(checkpoint_dir_name(p.global_step))
        folder = location.path if location.is_local else tempfile.mkdtemp(prefix="rt_ckpt_")
        if location.is_local:  # a manifest of an earlier attempt must not vouch for new files
            os.makedirs(folder, exist_ok=True)
            location.child(ckpt.manifest_name(s.rank)).delete()
        big, write_hf = self._stage(s), s.export is not None
        if write_hf and s.rank == 0:
            s.export.write_files(folder)  # config, tokenizer: small
        part = rank_part(s)
        files = ckpt.write_rank_part(folder, **part, complete=False)
        context = {k: getattr(s.ctx, k) for k in _SNAPSHOT}
        pending = Pending(p.global_step, location, context, time.perf_counter() - started)
        s.last_saved_step = p.global_step
        pending.thread = threading.Thread(
            target=self._write,
            args=(
                s.rank,
                s.world_size,
                s.parallel.sharded,
                pending,
                folder,
                big,
                write_hf,
                files,
                part["save_id"],
            ),
            name=f"ray-trainer-save-{p.global_step}",
            daemon=True,  # a crash ends the process; the partial folder is no checkpoint
        )
        self.pending = pending
        pending.thread.start()
        if final or self.wait_next:
            self.finish(s)

    def _stage(self, s: WorkerState) -> dict[str, Any] | None:
        """Copy what the background writes into the reused host buffers: FSDP's shards of
        model and optimizer (every rank), DDP's whole model and optimizer (rank 0)."""
        if self._stager is None:
            self._stager = host_stager(pinned=torch.cuda.is_available())
            if s.parallel.sharded:  # DCP's and the gather's collectives, off the training group
                self._group = dist.new_group(backend="gloo")  # a collective: every rank
        state = state_to_save(s)
        if state is None:
            return None
        staged = self._stager.stage(state)
        # The export's weights from the staged copies (a LoRA run's: the staged adapters and
        # the frozen base, read live).
        staged["hf"] = s.export.weights(staged["model"]) if s.export is not None else None
        return staged

    def _write(
        self,
        rank: int,
        world: int,
        sharded: bool,
        p: Pending,
        folder: str,
        staged: Any,
        hf: bool,
        files: dict[str, int],
        save_id: str,
    ) -> None:
        """The background thread: this rank's big files, the upload, the manifest last."""
        started = time.perf_counter()
        try:
            remote = not p.location.is_local
            if remote:
                p.location.child(ckpt.manifest_name(rank)).delete()
            written = []
            if staged is not None:  # the same assembly as the synchronous save's
                state = {"model": staged["model"], "optim": staged["optim"]}
                written += write_state(folder, state, rank, sharded, self._group)
            if hf:
                if staged is not None:
                    whole = _Gather(self._group, rank, world) if sharded else _same
                    staged["hf"].write(folder, whole, rank == 0)
                written += export.files(folder) if rank == 0 else []
            for name in written:
                files[name] = ckpt.file_entry(folder, name)
            if remote:
                p.location.upload(folder)
            manifest = ckpt.manifest(rank, world, files, save_id)
            p.location.child(ckpt.manifest_name(rank)).write_bytes(manifest)
        except BaseException as e:  # handed to the loop: raised at its next boundary
            p.error = e
        finally:
            if not p.location.is_local:
                shutil.rmtree(folder, ignore_errors=True)
            p.written_s = time.perf_counter() - started
            p.done.set()


def _same(tensor: Any) -> Any:
    return tensor


class _Gather:
    """A staged FSDP tensor made whole on rank 0 (None elsewhere), gathered from every rank's
    dim-0 shard over the checkpoint group (not the DTensor's own mesh: that is the training
    group, which the loop is using from the other thread). A collective: every rank calls it
    for every tensor, in the same order."""

    def __init__(self, group: Any, rank: int, world: int) -> None:
        self.group, self.rank, self.world = group, rank, world

    def __call__(self, tensor: Any) -> Any:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        local = local.cpu()  # a LoRA run's frozen base is read live, from the device
        local = dequantized(local)  # QLoRA's NF4 rows: their values (blocks never span ranks)
        placements = getattr(tensor, "placements", ())
        if self.world == 1 or tensor.ndim == 0 or all(p.is_replicate() for p in placements):
            return local
        chunk = -(-tensor.shape[0] // self.world)  # torch.chunk's rows per rank, as FSDP2
        padded = local.new_zeros((chunk, *tensor.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(padded, gather_list=parts, dst=0, group=self.group)
        return torch.cat(parts)[: tensor.shape[0]] if parts is not None else None


def publish(s: WorkerState, step: int, location: Location, context: dict[str, Any]) -> None:
    """Every rank: register the written checkpoint of `step` with Ray Train (a barrier across
    ranks: when it returns, every rank's files are written); then `on_save`, with `context` (the
    `_SNAPSHOT` of the step the checkpoint holds); then rank 0 records it as published."""
    storage = ray.train.get_context().get_storage()
    checkpoint = None
    if s.rank == 0:
        checkpoint = ray.train.Checkpoint(
            path=f"{storage.experiment_fs_path.rstrip('/')}/{location.basename}",
            filesystem=storage.storage_filesystem,
        )
    metrics = {k: context.get(k) for k in ("global_step", "epoch", "loss")}
    ray.train.report(
        metrics,
        checkpoint=checkpoint,
        checkpoint_dir_name=location.basename,
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
    )
    ctx = s.ctx
    now = {k: getattr(ctx, k) for k in _SNAPSHOT}
    for k, v in context.items():
        setattr(ctx, k, v)
    path = checkpoint_location(s, step)
    ctx.checkpoint_path = path
    try:
        s.hooks.fire("on_save", checkpoint_path=path)
    finally:
        for k, v in now.items():
            setattr(ctx, k, v)
    mark_published(s, step)
