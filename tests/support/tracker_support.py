"""Trackers for tests: a real MLflow tracking server on 127.0.0.1, and W&B's offline files read.

Runs in the pytest process. The MLflow server (``mlflow server`` with a SQLite store and
artifacts in a temp folder) is a child process in its own session, stopped by its process
group id. W&B 0.31 keeps no Python reader of its ``.wandb`` files: ``wandb_records`` reads the
record log (7-byte header, then 32 KiB blocks of records with a 7-byte header each: CRC,
length, kind full/first/middle/last) into ``wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import glob
import os
import signal
import struct
import subprocess
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from s3_server import _free_port
from waiting import wait_until


@dataclass
class MlflowServer:
    folder: str
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 90.0) -> None:
        cmd = ["mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--workers", "1", "--backend-store-uri", f"sqlite:///{self.folder}/mlflow.db"]
        cmd += ["--artifacts-destination", f"{self.folder}/artifacts"]
        log = open(os.path.join(self.folder, "server.log"), "wb")  # noqa: SIM115
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

        def answers() -> bool:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).close()
                return True
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mlflow server exited; see {log.name}") from None
                return False

        try:
            wait_until(answers, timeout_s, f"mlflow server to answer on {self.uri}", interval=0.5)
        except AssertionError:
            self.stop()
            raise

    def client(self):
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=self.uri)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)  # the server and its uvicorn worker
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)


def wandb_records(path: str) -> list[Any]:
    """Every record of a ``run-<id>.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    block, pos, chunks, partial = 32768, 7, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            chunks.append(partial + chunk)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_run(sync_dir: str) -> dict[str, Any]:
    """One offline run folder, read back: id, name, config, step metric definitions, history
    rows (name -> value), summary updates and exit code."""
    import json

    (path,) = glob.glob(os.path.join(sync_dir, "run-*.wandb"))
    out: dict[str, Any] = {"history": [], "summary": {}, "metrics": [], "exit_code": None}
    for r in wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["id"], out["name"] = r.run.run_id, r.run.display_name
            out["config"] = {u.key: json.loads(u.value_json) for u in r.run.config.update}
        elif kind == "history":
            out["history"].append({_key(i): json.loads(i.value_json) for i in r.history.item})
        elif kind == "metric":
            out["metrics"].append((r.metric.name or r.metric.glob_name, r.metric.step_metric))
        elif kind == "summary":
            out["summary"].update(
                {u.key: json.loads(u.value_json) for u in r.summary.update if u.key}
            )
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    return out


def _key(item: Any) -> str:
    """A history or summary item's name (W&B stores a name with "/" as its parts)."""
    return item.key or "/".join(item.nested_key)


def wandb_offline_runs(folder: str) -> list[str]:
    """The offline run folders under a W&B ``dir`` (``<dir>/wandb/offline-run-*``), oldest first."""
    return sorted(glob.glob(os.path.join(folder, "wandb", "offline-run-*")))
