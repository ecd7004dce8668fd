"""Driver: how each kind of storage creates the run folder's lease file exactly once.

Runs in the driver process, for ``lease.py`` (before ``ray.init()`` and in its heartbeat
thread). A store offers `create` (None when the file exists), `read` (the bytes and a token),
`take_over` and `rewrite` (replace the file holding a token; None when it holds another by now)
and `delete` (only the file holding a token):

* `LocalStore`, a local or NFS path: a file written whole under a private name, then
  hard-linked into place (``link`` fails when the name exists, like ``O_EXCL``: NFS's own lock
  recipe); a take-over renames the file aside (one renamer wins) and checks what it moved;
* `S3Store`, through boto3: ``PutObject`` with ``If-None-Match: *`` and ``If-Match: <etag>``;
* `BestEffortStore`, any other store: written when absent, read back after `SETTLE_S`.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Any

import pyarrow.fs as pafs

from ray_trainer._storage import Location

#: Best-effort stores: how long to wait before reading a freshly written lease back.
SETTLE_S = 1.0


class NoConditionalWrites(OSError):
    """The store refused a conditional write for a reason other than its condition (boto3 has
    no credentials where pyarrow has, or the S3-compatible store does not implement it)."""


class LocalStore:
    """A local or NFS path: an exclusive create (a hard link); the token is the content."""

    def __init__(self, file: Location) -> None:
        self.path = file.path

    def create(self, data: bytes) -> Any:
        # Written whole under a private name, then linked into place: ``link`` fails when the
        # name exists, as ``O_EXCL`` does (also on NFS), and no reader ever sees half a lease.
        tmp = f"{self.path}.{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            os.unlink(tmp)
        return data

    def read(self) -> tuple[bytes, Any] | None:
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        return data, data

    def take_over(self, token: Any, data: bytes) -> Any:
        """Replace the (stale) lease that holds `token` with `data`; None when it holds
        something else by now. The lease is absent for a moment: a run starting then gets it,
        and this one fails to create it."""
        aside = f"{self.path}.{uuid.uuid4().hex[:12]}"
        try:
            os.rename(self.path, aside)  # atomic: of two runs renaming one file, one wins
        except FileNotFoundError:
            return None
        with open(aside, "rb") as f:
            moved = f.read()
        if moved != token:  # another run's newer lease: put it back, unless a third wrote one
            with contextlib.suppress(FileExistsError):
                os.link(aside, self.path)
            os.unlink(aside)
            return None
        os.unlink(aside)
        return self.create(data)

    def rewrite(self, token: Any, data: bytes) -> Any:
        """The holder's heartbeat: replace its own lease in one rename (never absent, so no
        starting run can create it meanwhile); None when the lease holds something else."""
        found = self.read()
        if found is None or found[1] != token:
            return None
        tmp = f"{self.path}.{uuid.uuid4().hex[:12]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path)
        return data

    def delete(self, token: Any) -> None:
        found = self.read()
        if found is not None and found[1] == token:
            os.unlink(self.path)


class S3Store:
    """S3 through boto3's conditional puts: the token is the object's ETag."""

    def __init__(self, file: Location, client: Any) -> None:
        self.bucket, self.key = file.path.lstrip("/").split("/", 1)
        self.client = client

    def _put(self, data: bytes, **condition: str) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            out = self.client.put_object(Bucket=self.bucket, Key=self.key, Body=data, **condition)
        except ClientError as e:
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status in (409, 412):  # PreconditionFailed, or a concurrent conditional write
                return None
            if status in (400, 403, 501):  # not allowed to boto3, or not implemented
                raise NoConditionalWrites(f"s3://{self.bucket}/{self.key}: {e}") from None
            raise OSError(f"s3://{self.bucket}/{self.key}: {e}") from None
        except BotoCoreError as e:  # no credentials for boto3, an endpoint it cannot reach
            raise NoConditionalWrites(f"s3://{self.bucket}/{self.key}: {e}") from None
        return out["ETag"]

    def create(self, data: bytes) -> Any:
        return self._put(data, IfNoneMatch="*")

    def read(self) -> tuple[bytes, Any] | None:
        from botocore.exceptions import ClientError

        try:
            out = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise OSError(f"s3://{self.bucket}/{self.key}: {e}") from None
        return out["Body"].read(), out["ETag"]

    def take_over(self, token: Any, data: bytes) -> Any:
        return self._put(data, IfMatch=token)

    rewrite = take_over

    def delete(self, token: Any) -> None:
        found = self.read()
        if found is not None and found[1] == token:
            self.client.delete_object(Bucket=self.bucket, Key=self.key)


class BestEffortStore:
    """A store without a conditional write: write when absent, then read back after `settle_s`
    and keep the lease only if it still holds what we wrote."""

    def __init__(self, file: Location, settle_s: float | None = None) -> None:
        self.file = file
        self.settle_s = SETTLE_S if settle_s is None else settle_s

    def create(self, data: bytes) -> Any:
        if self.file.exists():
            return None
        self.file.write_bytes(data)
        return self._confirm(data)

    def _confirm(self, data: bytes) -> Any:
        time.sleep(self.settle_s)  # let a concurrent writer's object land before reading back
        found = self.read()
        return data if found is not None and found[0] == data else None

    def read(self) -> tuple[bytes, Any] | None:
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return None
        return data, data

    def take_over(self, token: Any, data: bytes) -> Any:
        found = self.read()
        if found is None or found[1] != token:
            return None
        self.file.write_bytes(data)
        return self._confirm(data)

    rewrite = take_over

    def delete(self, token: Any) -> None:
        found = self.read()
        if found is not None and found[1] == token:
            self.file.delete()


def store_for(file: Location) -> Any:
    """The strongest way this file's store offers to create it once."""
    if file.is_local:
        return LocalStore(file)
    client = s3_client(file.fs)
    if client is not None:
        return S3Store(file, client)
    return BestEffortStore(file)


def s3_client(fs: Any) -> Any:
    """A boto3 client with `fs`'s endpoint and credentials when `fs` is a pyarrow S3 filesystem
    and boto3 is installed; else None."""
    if not isinstance(fs, pafs.S3FileSystem):
        return None
    try:
        import boto3
    except ImportError:
        return None
    # What the filesystem was built with: its pickling arguments (pyarrow exposes no getters).
    options = fs.__reduce__()[1][0]
    endpoint = options.get("endpoint_override") or None
    if endpoint and "://" not in endpoint:
        endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    kwargs = {
        "endpoint_url": endpoint,
        "region_name": options.get("region") or fs.region or None,
        "aws_access_key_id": options.get("access_key") or None,
        "aws_secret_access_key": options.get("secret_key") or None,
        "aws_session_token": options.get("session_token") or None,
    }
    return boto3.client("s3", **{k: v for k, v in kwargs.items() if v is not None})
