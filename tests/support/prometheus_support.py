"""The test process: a real Prometheus (Debian's ``prometheus``) scraping a local Ray cluster's
metrics endpoints on Ray's own scrape configuration, with a 1 s interval.

Used by ``tests/integration/test_prometheus.py`` (every SFT panel) and ``test_multinode.py``
(GRPO's RL row, on the submitted GRPO job). Installed by the set-up when missing (``apt-get
install prometheus``, as root), or the test is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml
from local_cluster import HOST, LocalCluster, _free_port
from waiting import wait_until


def prometheus_binary() -> str:
    """Debian's prometheus, installed here when missing (skip, with the reason, if it cannot)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("prometheus is not installed, and apt-get as root is not available to add it")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "prometheus"]
    for cmd in (install, ["apt-get", "update", "-q"], install):
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if cmd is install and done.returncode == 0:
            break
    found = shutil.which("prometheus")
    if not found:
        pytest.skip(f"could not install prometheus with apt-get: {done.stderr[-500:]}")
    return found


class Prometheus:
    """`prometheus` on Ray's scrape configuration, with a 1 s interval, on a free port."""

    def __init__(self, binary: str, cluster: LocalCluster, folder: str) -> None:
        session = os.path.join(cluster.temp_dir, "session_latest")
        ray_config = os.path.join(session, "metrics", "prometheus", "prometheus.yml")
        wait_until(lambda: os.path.isfile(ray_config), 60, f"Ray's {ray_config}", interval=0.2)
        with open(ray_config) as f:
            config = yaml.safe_load(f)
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        [discovery] = config["scrape_configs"][0]["file_sd_configs"][0]["files"]
        wait_until(lambda: os.path.isfile(discovery), 60, f"Ray's {discovery}", interval=0.2)
        path = os.path.join(folder, "prometheus.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.url = f"http://{HOST}:{_free_port(set(cluster.ports.values()))}"
        self.log = open(os.path.join(folder, "prometheus.log"), "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={folder}/data",
             f"--web.listen-address={self.url[len('http://'):]}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(self._ready, 60, f"Prometheus at {self.url}", interval=0.2)

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            with open(self.log.name) as f:
                raise RuntimeError(f"prometheus exited: {f.read()[-2000:]}")
        with (
            contextlib.suppress(OSError),
            urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r,
        ):
            return r.status == 200
        return False

    def get(self, path: str, **params: str) -> object:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
