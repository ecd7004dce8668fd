"""An S3-compatible server on localhost for storage tests: moto's server mode on 127.0.0.1.

Runs in the pytest process (the server is a child process, stopped by pid). Every client of a
test (the driver, Ray's workers, the callback actor, evaluation tasks) reaches it through
``AWS_ENDPOINT_URL`` and dummy credentials, which boto3 and pyarrow both honour.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from dataclasses import dataclass, field

from waiting import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    port: int = field(default_factory=_free_port)
    process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """What a client needs: the endpoint and (any) credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout_s: float = 30.0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

        def answers() -> bool:
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
                return True
            except OSError:
                if self.process.poll() is not None:
                    raise RuntimeError("moto's server exited at start") from None
                return False

        try:
            wait_until(answers, timeout_s, f"moto's server on {self.endpoint}", interval=0.2)
        except AssertionError:
            self.stop()
            raise

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, **_credentials(self.env()))

    def keys(self, bucket: str) -> list[str]:
        """Every object key in the bucket."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _credentials(env: dict[str, str]) -> dict[str, str]:
    return {
        "aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
        "region_name": env["AWS_DEFAULT_REGION"],
    }


def with_env(extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **extra}
