"""One run per run folder: the lease, the fingerprint of what a run trains, and the start's cleanup.

The lease (`_driver/lease.py`, `_driver/lease_stores.py`) on a local folder, on S3 (moto's server: conditional puts) and on
a store without conditional writes (best effort); a second `run_training` on a live folder,
refused before Ray starts; the fingerprint (`_driver/run_fingerprint.py`) of factories and
Datasets by code and content; what crashed saves left, removed at the next start
(`_driver/retention.py`). No Ray.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pyarrow.fs as pafs
import pytest
import torch
from waiting import wait_until

from ray_trainer import TrainingArgs, TrainingArgsError, run_training
from ray_trainer._driver import lease_stores
from ray_trainer._driver.checks.inputs import check_storage, write_run_record
from ray_trainer._driver.lease import LEASE_FILE, Holder, RunFolderLeasedError, RunLease
from ray_trainer._driver.lease_stores import BestEffortStore, LocalStore, S3Store
from ray_trainer._driver.retention import record_run, remove_crashed_saves
from ray_trainer._driver.run_fingerprint import describe, fingerprint
from ray_trainer._storage import locate


class _Clock:
    """Wall-clock seconds that a test moves by hand."""

    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _holder(run) -> dict:
    return json.loads((run / LEASE_FILE).read_text())


# ---- the lease on a local (or NFS) folder -----------------------------------------------------


def test_a_second_holder_is_refused_naming_the_first_and_gets_it_after_release(tmp_path):
    run = locate(str(tmp_path / "run"))
    first = RunLease(run, "my-run")
    first.acquire()
    assert _holder(tmp_path / "run")["pid"] == os.getpid()
    with pytest.raises(RunFolderLeasedError) as refused:
        RunLease(run, "my-run").acquire()
    message = str(refused.value)
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started " in message
    assert "'my-run'" in message and f"delete {run.child(LEASE_FILE).name}" in message
    assert isinstance(refused.value, TrainingArgsError)  # the documented family of refusals
    assert _holder(tmp_path / "run")["owner"] == first.holder.owner  # the refusal wrote nothing
    first.release()
    assert not (tmp_path / "run" / LEASE_FILE).exists()
    second = RunLease(run, "my-run")
    second.acquire()
    assert _holder(tmp_path / "run")["owner"] == second.holder.owner
    second.release()
    assert not (tmp_path / "run").exists()  # the folder it made, left empty, is gone too


def test_a_crashed_runs_lease_is_taken_over_once_its_heartbeat_is_stale(tmp_path):
    run = locate(str(tmp_path / "run"))
    clock = _Clock()
    crashed = RunLease(run, "r", stale_after_s=120, clock=clock)
    crashed.acquire()  # and never released: its driver was killed
    clock.now += 100
    with pytest.raises(RunFolderLeasedError, match="last heartbeat 100 s ago"):
        RunLease(run, "r", stale_after_s=120, clock=clock).acquire()
    clock.now += 21
    resumed = RunLease(run, "r", stale_after_s=120, clock=clock)
    resumed.acquire()
    assert resumed.taken_over == crashed.holder
    assert _holder(tmp_path / "run")["owner"] == resumed.holder.owner
    # The old holder, if it was only stalled, learns that it lost the folder, and its release
    # leaves the new holder's lease alone.
    assert crashed.beat() is False and crashed.lost.is_set()
    crashed.release()
    assert _holder(tmp_path / "run")["owner"] == resumed.holder.owner
    assert resumed.beat() is True
    resumed.release()
    assert sorted(os.listdir(tmp_path / "run")) == []  # no file left aside


def test_a_lease_of_a_dead_process_on_this_machine_is_taken_over_after_two_heartbeats(tmp_path):
    run = locate(str(tmp_path / "run"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    clock = _Clock()
    for pid, refused in ((os.getpid(), True), (int(dead.stdout), False)):
        left = Holder("crashed", socket.gethostname(), pid, clock() - 300, clock() - 31, "r")
        run.child(LEASE_FILE).write_bytes(left.to_bytes())
        lease = RunLease(run, "r", heartbeat_s=15, stale_after_s=120, clock=clock)
        if refused:  # alive (this very process): the bound applies
            with pytest.raises(RunFolderLeasedError, match="last heartbeat 31 s ago"):
                lease.acquire()
        else:
            lease.acquire()
            assert lease.taken_over == left
            lease.release()


def test_of_two_runs_taking_over_one_stale_lease_only_one_wins(tmp_path):
    run = locate(str(tmp_path / "run"))
    run.fs.create_dir(run.path)
    store = LocalStore(run.child(LEASE_FILE))
    stale = store.create(b"stale")
    read_by_both = store.read()[1]
    assert read_by_both == stale and store.create(b"other") is None  # O_EXCL: exists
    assert store.take_over(read_by_both, b"first") == b"first"
    assert store.take_over(read_by_both, b"second") is None  # it moved a newer lease: put back
    assert store.read()[0] == b"first"
    assert store.rewrite(read_by_both, b"stalled holder") is None  # the stale one's heartbeat
    assert store.rewrite(b"first", b"first, beating") == b"first, beating"
    assert store.read()[0] == b"first, beating"
    assert sorted(os.listdir(tmp_path / "run")) == [LEASE_FILE]


def test_the_heartbeat_thread_beats_until_release(tmp_path):
    run = locate(str(tmp_path / "run"))
    with RunLease(run, "r", heartbeat_s=0.05) as held:
        started = _holder(tmp_path / "run")["heartbeat"]
        wait_until(lambda: _holder(tmp_path / "run")["heartbeat"] > started, 10, "a heartbeat")
        thread = held._thread
    assert not thread.is_alive()
    assert not (tmp_path / "run" / LEASE_FILE).exists()


_SOURCE = "def make():\n    return {'d': [1, 2.5, None], 's': {'a', 'b'}}\n"


def test_another_process_holding_the_lease_refuses_it_and_fingerprints_alike(tmp_path):
    # One child process for two cross-process facts (each costs an import of ray_trainer).
    script = textwrap.dedent(
        f"""
        import sys
        from ray_trainer._driver.lease import RunLease
        from ray_trainer._driver.run_fingerprint import describe
        from ray_trainer._storage import locate
        ns = {{}}
        exec(compile({_SOURCE!r}, "<user script>", "exec"), ns)
        print(describe(ns["make"]), flush=True)
        with RunLease(locate({str(tmp_path / "run")!r}), "other"):
            print("held", flush=True)
            sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        # The same code fingerprints alike in another process (no ids, addresses or set order).
        assert child.stdout.readline().strip() == describe(_function(_SOURCE))
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderLeasedError, match=f"pid {child.pid}, started "):
            RunLease(locate(str(tmp_path / "run")), "mine").acquire()
        child.stdin.write("end\n")
        child.stdin.flush()
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
    with RunLease(locate(str(tmp_path / "run")), "mine"):
        assert _holder(tmp_path / "run")["pid"] == os.getpid()


# ---- the lease on a bucket ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3():
    from s3_server import S3Server

    server = S3Server()
    server.start()
    server.client().create_bucket(Bucket="leases")
    yield server
    server.stop()


def test_on_s3_the_lease_is_created_and_taken_over_with_conditional_puts(s3):
    fs = pafs.S3FileSystem(
        endpoint_override=s3.endpoint,
        access_key="testing",
        secret_key="testing",
        region="us-east-1",
    )
    run = locate("leases/runs/r", fs)
    clock = _Clock()
    first = RunLease(run, "r", stale_after_s=60, clock=clock)
    assert isinstance(first.store, S3Store)
    first.acquire()
    key = "runs/r/" + LEASE_FILE
    with pytest.raises(RunFolderLeasedError, match=f"pid {os.getpid()}"):
        RunLease(run, "r", stale_after_s=60, clock=clock).acquire()
    # A put without the lease's ETag (another writer's If-None-Match: *) is refused by S3.
    assert first.store.create(b"intruder") is None
    clock.now += 61
    second = RunLease(run, "r", stale_after_s=60, clock=clock)
    second.acquire()  # If-Match on the stale lease's ETag
    body = s3.client().get_object(Bucket="leases", Key=key)["Body"].read()
    assert Holder.from_bytes(body).owner == second.holder.owner
    assert first.beat() is False  # its If-Match names an ETag that is gone
    first.release()
    assert key in s3.keys("leases")
    second.release()
    assert key not in s3.keys("leases")


def test_on_s3_without_credentials_for_boto3_the_lease_falls_back_to_best_effort(s3, monkeypatch):
    monkeypatch.setattr(lease_stores, "SETTLE_S", 0.05)
    # pyarrow has the keys; boto3, given wrong ones, is refused (403): the lease still works.
    fs = pafs.S3FileSystem(endpoint_override=s3.endpoint, access_key="testing",
                           secret_key="testing", region="us-east-1")  # fmt: skip
    lease = RunLease(locate("leases/runs/fallback", fs), "fallback")
    lease.store.client = s3.client()
    lease.store.client.put_object = _forbidden
    lease.acquire()
    assert isinstance(lease.store, BestEffortStore)
    assert "runs/fallback/" + LEASE_FILE in s3.keys("leases")
    lease.release()


def _forbidden(**kwargs):
    from botocore.exceptions import ClientError

    error = {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}
    raise ClientError(error, "PutObject")


def test_a_store_without_conditional_writes_reads_its_lease_back(tmp_path, monkeypatch):
    # A filesystem that is neither local nor S3: the documented best effort.
    fs = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    run = locate("run", fs)
    monkeypatch.setattr(lease_stores, "SETTLE_S", 0.0)
    first = RunLease(run, "r")
    assert isinstance(first.store, BestEffortStore)
    first.acquire()
    with pytest.raises(RunFolderLeasedError, match=f"pid {os.getpid()}"):
        RunLease(run, "r").acquire()
    first.release()
    # Another run's lease lands while this one settles: reading back shows it, so it is refused.
    late = RunLease(run, "r")
    other = Holder("other-owner", "elsewhere", 42, late.clock(), late.clock(), "r")
    monkeypatch.setattr(
        lease_stores.time, "sleep", lambda s: late.file.write_bytes(other.to_bytes())
    )
    with pytest.raises(RunFolderLeasedError, match="host elsewhere, pid 42"):
        late.acquire()


# ---- run_training on a live folder --------------------------------------------------------------


def test_a_second_run_training_on_a_live_folder_is_refused_before_ray_starts(tmp_path, monkeypatch):
    import ray

    def refuse(*a, **k):
        raise AssertionError("ray.init() was called although the folder is leased")

    monkeypatch.setattr(ray, "init", refuse)
    cut_off = tmp_path / "live" / "checkpoint_00000004"
    cut_off.mkdir(parents=True)  # a crashed save's folder: only the lease holder may clean it
    with RunLease(locate(str(tmp_path / "live")), "live"):
        with pytest.raises(RunFolderLeasedError, match=f"pid {os.getpid()}, started "):
            run_training(run_name="live", storage_path=str(tmp_path), max_steps=2)
        assert cut_off.exists() and not (tmp_path / "live" / "run.json").exists()


# ---- the fingerprint of what a run trains -------------------------------------------------------


def _function(source: str, name: str = "make", **namespace):
    exec(compile(source, "<user script>", "exec"), namespace)
    return namespace[name]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n, scale=1):
        self.n, self.scale = n, scale

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"x": torch.tensor([i, i * self.scale])}


def test_factories_are_told_apart_by_code_not_name():
    a = describe(lambda: torch.nn.Linear(2, 3))
    b = describe(lambda: torch.nn.Linear(2, 4))
    assert "<lambda>#" in a and "<lambda>#" in b and a != b
    # Moving the function down the script or commenting it changes nothing ...
    src = "def make():\n    return width * 2\n"
    moved = "\n\n# a comment\n" + src
    assert describe(_function(src, width=3)) == describe(_function(moved, width=3))
    # ... but what it closes over or calls from its own module does.
    assert describe(_function(src, width=3)) != describe(_function(src, width=4))
    calls = "def helper():\n    return {}\ndef make():\n    return helper()\n"
    assert describe(_function(calls.format(1))) != describe(_function(calls.format(2)))
    assert describe(None) == "None" and describe("org/model") == "org/model"


def _local_classes(width: int):
    """A model and a dataset defined inside a function that imports torch itself: their
    methods close over the `torch` module (and `super()`'s class cell)."""
    import enum

    import torch as local_torch

    class Kind(enum.Enum):
        A = 1

    class LocalModel(local_torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.kind = Kind.A
            self.net = local_torch.nn.Linear(width, 1)

    class LocalRows(local_torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": local_torch.full((width,), float(i)), "kind": Kind.A}

    return LocalModel, LocalRows


def test_classes_defined_in_a_function_are_fingerprinted_by_their_code():
    # Found by bench_host_step's whole runs: the walk went into the torch module's globals
    # from a closure cell and failed on an Enum member (TypeError: no len()).
    model, rows = _local_classes(8)
    assert describe(model) == describe(_local_classes(8)[0])
    assert describe(rows()) == describe(_local_classes(8)[1]())
    assert describe(model) != describe(_local_classes(9)[0])
    assert describe(rows()) != describe(_local_classes(9)[1]())


def test_datasets_are_told_apart_by_length_and_sampled_items():
    assert describe(_Rows(10)) == describe(_Rows(10))
    assert describe(_Rows(10)) != describe(_Rows(11))
    assert describe(_Rows(10)) != describe(_Rows(10, scale=3))
    assert describe(_Rows(10)).startswith("_Rows#")


def test_a_different_lambda_under_a_reused_run_name_is_refused(tmp_path):
    def args(model):
        return TrainingArgs(model=model, run_name="reused", storage_path=str(tmp_path))

    first = args(lambda: torch.nn.Linear(2, 3))
    run = locate(str(tmp_path / "reused"))
    run_id = record_run(run, first)
    (tmp_path / "reused" / "checkpoint_00000002").mkdir()  # that run has checkpoints to protect
    with pytest.raises(TrainingArgsError, match="already holds a different run"):
        check_storage(args(lambda: torch.nn.Linear(2, 5)))
    assert check_storage(first).name == run.name  # the same run continues ...
    assert record_run(run, first) == run_id  # ... under the same id (its saves stay its own)
    write_run_record(run, {"fingerprint": fingerprint(first), "run_name": "reused"})
    assert record_run(run, first) != run_id  # a record without an id: a new one
    # A record from before code fingerprints (the lambda's name only) still continues, and the
    # next launch records the full fingerprint; a different name does not.
    old = {"fingerprint": "model=" + first.model.__qualname__ + ";data=None;demo=[]"}
    write_run_record(run, old)
    assert check_storage(first).name == run.name
    write_run_record(run, {"fingerprint": "model=make_other;data=None;demo=[]"})
    with pytest.raises(TrainingArgsError, match="already holds a different run"):
        check_storage(first)


# ---- what crashed saves left, removed at the next start -----------------------------------------


def _manifest(folder, rank, world_size):
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {"format": 1, "rank": rank, "world_size": world_size, "files": {}}
    (folder / f"rank{rank}.complete").write_text(json.dumps(manifest))


def test_a_start_removes_cut_off_saves_and_temporary_files_never_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    _manifest(run / "checkpoint_00000002", 0, 1)  # complete
    _manifest(run / "checkpoint_00000004", 0, 2)
    _manifest(run / "checkpoint_00000004", 1, 2)  # complete, two ranks
    _manifest(run / "checkpoint_00000006", 0, 2)  # rank 1 never finished writing
    (run / "checkpoint_00000008").mkdir()  # cut off before any manifest
    (run / "checkpoint_00000008" / "model.pt").write_bytes(b"half")
    (run / "checkpoint_00000010").mkdir()
    (run / "checkpoint_00000010" / "rank0.complete").write_text("a format this code cannot read")
    for name in ("ranking.json.tmp123-456", "lease.json.0123456789ab", "notes.txt", "run.json"):
        (run / name).write_text("x")
    removed = remove_crashed_saves(locate(str(run)))
    assert sorted(removed) == [
        "checkpoint_00000006",
        "checkpoint_00000008",
        "lease.json.0123456789ab",
        "ranking.json.tmp123-456",
    ]
    assert sorted(os.listdir(run)) == [
        "checkpoint_00000002",
        "checkpoint_00000004",
        "checkpoint_00000010",
        "notes.txt",
        "run.json",
    ]
    assert remove_crashed_saves(locate(str(run))) == []


def test_the_refusal_gives_the_takeover_time_the_code_applies(tmp_path):
    """Issue 74, point 5: the message's takeover time is `_stale`'s. A holder of this machine
    whose process is gone is refused only until 30 s (two 15 s heartbeats) after its last
    heartbeat, and the message says 30 s and that time; a live one (this very process), or one
    of another host, 120 s, with the 30 s case named."""
    import datetime

    run = locate(str(tmp_path / "run"))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    clock = _Clock()
    beat = clock() - 10
    cases = [
        (socket.gethostname(), int(dead.stdout), 30, "is gone from this machine"),
        (socket.gethostname(), os.getpid(), 120, "If that run is gone"),
        ("another-host", int(dead.stdout), 120, "If that run is gone"),
    ]
    for host, pid, wait_s, said in cases:
        left = Holder("other", host, pid, clock() - 300, beat, "r")
        run.child(LEASE_FILE).write_bytes(left.to_bytes())
        lease = RunLease(run, "r", heartbeat_s=15, stale_after_s=120, clock=clock)
        with pytest.raises(RunFolderLeasedError) as refused:
            lease.acquire()
        message = str(refused.value)
        at = datetime.datetime.fromtimestamp(beat + wait_s).isoformat(timespec="seconds")
        assert said in message and f"taken over from {at} on ({wait_s} s " in message, message
        assert "for a process of this machine that is gone, 30 s" in message or wait_s == 30
        clock.now = beat + wait_s + 1  # the time it named: taken over
        RunLease(run, "r", heartbeat_s=15, stale_after_s=120, clock=clock).acquire()
        clock.now = beat + 10
        os.remove(tmp_path / "run" / LEASE_FILE)  # the taker's, never released
