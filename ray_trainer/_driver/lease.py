"""Driver: the lease a run holds on its run folder, so that one run at a time writes it.

Runs in the driver process, before ``ray.init()`` (`RunLease.acquire`), in a heartbeat thread
of the driver while the run lives, and in the driver's ``finally`` (`RunLease.release`). The
lease is ``lease.json`` in the run folder: the holder's owner id, host, pid, start time and last
heartbeat (wall-clock seconds of the holder's machine). The actor's unique name protects a run
only within one Ray cluster; this file protects it across machines, embedded Rays and clusters
that share the storage.

How the file is created so that exactly one of two starting runs gets it (``lease_stores.py``):

* a local or NFS path: an exclusive create (``link`` of a file written whole under a private
  name fails when the name exists, like ``O_EXCL``, and is NFS's own lock recipe); a stale lease
  is taken over by renaming it aside (one renamer wins) and checking that what was moved is the
  stale lease that was read;
* S3 (``s3://`` or a ``pyarrow.fs.S3FileSystem``), when ``boto3`` is installed: a conditional
  ``PutObject`` (``If-None-Match: *`` to create, ``If-Match: <etag>`` to take over and to beat);
  when boto3 may not write there (no credentials of its own) or the store does not implement
  conditional puts, the best effort below, with a warning;
* any other store (``gs://``, a custom filesystem): best effort, documented as such: the lease
  is written when absent, then read back after `SETTLE_S`; a run that reads back another owner
  is refused. Two runs starting within the same fraction of a second can both pass there.

A lease whose heartbeat is older than `STALE_AFTER_S` (its driver crashed or was killed) is
taken over by the next start of the run, and so is one older than two heartbeats whose holder
was a process of this machine that is gone; any other refuses the start, naming its holder.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from ray_trainer._driver.lease_stores import BestEffortStore, NoConditionalWrites, store_for
from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import Location

logger = logging.getLogger("ray_trainer")

LEASE_FILE = "lease.json"
#: How often the holder's driver rewrites its heartbeat.
HEARTBEAT_S = 15.0
#: A lease whose heartbeat is older than this is a crashed run's, taken over on the next start.
#: Generous against clock skew between the machines that share the storage.
STALE_AFTER_S = 120.0


class RunFolderLeasedError(TrainingArgsError):
    """Another live run holds the run folder's lease (the message names it and how to take
    over)."""


@dataclass(frozen=True)
class Holder:
    """What ``lease.json`` says: who holds the run folder, since when, last seen when."""

    owner: str
    host: str
    pid: int
    started: float
    heartbeat: float
    run_name: str = ""

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), indent=1, sort_keys=True).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Holder | None:
        """The holder a lease file names; None when it is unreadable (written half by a best-effort
        store, or not ours): such a file is treated as stale."""
        try:
            fields = json.loads(data)
            return Holder(**{k: fields[k] for k in Holder.__dataclass_fields__ if k in fields})
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self, now: float) -> str:
        since = datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds")
        return (
            f"host {self.host}, pid {self.pid}, started {since} "
            f"(last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago)"
        )


class RunLease:
    """The lease of the run folder `run`, for this driver (`owner`).

    Example:
        >>> with RunLease(run_folder, run_name="my-run"):  # RunFolderLeasedError if held
        ...     train()  # the lease beats in a driver thread, and is released at the end
    """

    def __init__(
        self,
        run: Location,
        run_name: str = "",
        stale_after_s: float = STALE_AFTER_S,
        heartbeat_s: float = HEARTBEAT_S,
        clock: Any = time.time,
    ) -> None:
        self.run = run
        self.file = run.child(LEASE_FILE)
        self.stale_after_s = stale_after_s
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        now = clock()
        self.holder = Holder(
            owner=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            started=now,
            heartbeat=now,
            run_name=run_name,
        )
        self.store = store_for(self.file)
        self.lost = threading.Event()  # set when another run took the lease from under us
        self.taken_over: Holder | None = None  # the stale holder this start replaced, if any
        self._token: Any = None
        self._made_folder = False  # this start created the run folder (removed if left empty)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLease:
        """Acquire (or refuse) and beat until the block ends, however it ends."""
        self.acquire()
        try:
            self.start_heartbeat()
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ---- the driver, before Ray ------------------------------------------------------------

    def acquire(self) -> None:
        """Hold the lease, or raise `RunFolderLeasedError` naming the live holder. A stale
        holder's lease is taken over (logged)."""
        self._made_folder = self.run.is_local and not self.run.exists()
        self.run.fs.create_dir(self.run.path, recursive=True)
        for _ in range(3):  # a lost race with another starting run: look again
            try:
                token = self.store.create(self.holder.to_bytes())
            except NoConditionalWrites as e:
                logger.warning("%s: %s; falling back to a best-effort lease", self.file.name, e)
                self.store = BestEffortStore(self.file)
                token = self.store.create(self.holder.to_bytes())
            if token is not None:
                self._token = token
                return
            found = self.store.read()
            if found is None:  # released between our create and our read
                continue
            data, token = found
            other = Holder.from_bytes(data)
            now = self.clock()
            if other is not None and not self._stale(other, now):
                raise RunFolderLeasedError(self._refusal(other, now))
            new = self.store.take_over(token, self.holder.to_bytes())
            if new is not None:
                self._token = new
                self.taken_over = other
                described = other.describe(now) if other else "an unreadable lease"
                logger.warning(
                    "%s: took over the lease of a run that stopped beating (%s)",
                    self.run.name,
                    described,
                )
                return
        found = self.store.read()
        other = Holder.from_bytes(found[0]) if found else None
        if other is None:
            raise RunFolderLeasedError(f"{self.run.name}: another run is taking its lease; retry")
        raise RunFolderLeasedError(self._refusal(other, self.clock()))

    def _remove_empty_folder(self) -> None:
        """A start refused before it wrote anything leaves no empty run folder behind."""
        if self._made_folder and not self.run.listdir():
            with contextlib.suppress(OSError):
                os.rmdir(self.run.path)

    def _stale(self, other: Holder, now: float) -> bool:
        """No heartbeat for `stale_after_s`; or, for a holder on this machine whose process is
        gone, for two heartbeat periods (a process of that pid in another container of the same
        host name still beats, so it is never taken for dead)."""
        silent = now - other.heartbeat
        if silent > self.stale_after_s:
            return True
        here = other.host == self.holder.host
        return here and silent > 2 * self.heartbeat_s and not _process_alive(other.pid)

    def _refusal(self, other: Holder, now: float) -> str:
        """The refusal, with when the lease can be taken over as `_stale` decides it: a holder
        of this machine whose process is gone, two heartbeat periods after its last one (it is
        refused only until then); any other, `stale_after_s` after it."""
        gone = other.host == self.holder.host and not _process_alive(other.pid)
        wait_s = 2 * self.heartbeat_s if gone else self.stale_after_s
        free_at = datetime.datetime.fromtimestamp(other.heartbeat + wait_s)
        at = f"the lease is taken over from {free_at.isoformat(timespec='seconds')} on"
        if gone:
            takeover = (
                f"Its process (pid {other.pid}) is gone from this machine: {at} "
                f"({wait_s:.0f} s after its last heartbeat)"
            )
        else:
            takeover = (
                f"If that run is gone (its process killed, its machine dead), {at} "
                f"({wait_s:.0f} s without a heartbeat; for a process of this machine that is "
                f"gone, {2 * self.heartbeat_s:.0f} s)"
            )
        return (
            f"run_name {other.run_name or self.run.basename!r}: {self.run.name} is in use by "
            f"another run ({other.describe(now)}); two runs writing one folder delete each "
            "other's checkpoints. Wait for it to end, stop it (Ctrl-C where it runs, or "
            f"`ray-trainer stop` on its cluster), or pick a new run_name. {takeover}, or at "
            f"once if you delete {self.file.name}"
        )

    # ---- the driver, while the run lives ---------------------------------------------------

    def beat(self) -> bool:
        """Rewrite the heartbeat; False (and `lost` set) when another run holds the lease now."""
        if self.lost.is_set() or self._token is None:
            return False
        holder = Holder(**{**asdict(self.holder), "heartbeat": self.clock()})
        token = self.store.rewrite(self._token, holder.to_bytes())
        if token is None:
            self.lost.set()
            found = self.store.read()
            other = Holder.from_bytes(found[0]) if found else None
            logger.error(
                "%s: this run lost its lease to %s; the other run may delete this run's "
                "checkpoints: stop one of them",
                self.run.name,
                other.describe(self.clock()) if other else "nobody (the file is gone)",
            )
            return False
        self.holder, self._token = holder, token
        return True

    def start_heartbeat(self) -> None:
        """Beat every `heartbeat_s` in a daemon thread of the driver until `release`."""

        def loop() -> None:
            while not self._stop.wait(self.heartbeat_s):
                try:
                    if not self.beat():
                        return
                except OSError as e:  # storage briefly away: the next beat retries
                    logger.warning("%s: heartbeat failed: %s", self.file.name, e)

        self._thread = threading.Thread(target=loop, name="run-lease-heartbeat", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop beating and remove the lease if it is still ours. Never raises: it runs in the
        driver's ``finally``, on every exit path."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.heartbeat_s + 5)
        if self._token is None or self.lost.is_set():
            return
        try:
            self.store.delete(self._token)
        except OSError as e:
            logger.warning("could not remove %s: %s", self.file.name, e)
        self._token = None
        self._remove_empty_folder()


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, as another user's
        return True
    return True
