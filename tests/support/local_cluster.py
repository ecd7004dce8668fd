"""A real single-node Ray cluster for tests: `ray start --head`, then kill it by process id.

Runs in the pytest process, which never joins the cluster (no `ray.init` here): tests talk to
it through subprocesses (`ray-trainer submit` / `status`) and HTTP, so it cannot collide with
the embedded Ray session that other integration tests share.

Isolation from other Ray instances on the machine (see RAY_FACTS.md, "A real local cluster in
tests"): the head listens on 127.0.0.2 (Ray would replace 127.0.0.1 by the network address),
every port is explicit and free, `AUTOSCALER_METRIC_PORT` / `DASHBOARD_METRIC_PORT` move the
two otherwise fixed ports, the session lives in a private `--temp-dir`, token auth is off
(`RAY_AUTH_MODE=disabled`: a `~/.ray/auth_token` left by another test would turn it on), the
cluster's own processes know their dashboard (`node_env`), and teardown kills only this
cluster's processes: those started with its mark in their environment (`CLUSTER_MARK`) or its
temp dir on their command line, with their children. Never by a port on a command line: a port
this cluster chose but no process of it listens on (the dashboard's, with the dashboard off) is
free for another cluster on the machine to take, whose processes would then look like this
one's. Never `ray stop`: it ends every Ray on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import psutil
from waiting import wait_until

HOST = "127.0.0.2"
#: In the environment of every daemon a `LocalCluster` starts (`node_env`; they pass it on to the
#: workers they start): the cluster's own id (its temp dir), which `processes()` finds it by.
CLUSTER_MARK = "RAY_TRAINER_LOCAL_CLUSTER"
_PORT_NAMES = (
    "port",
    "dashboard_port",
    "metrics_export_port",
    "node_manager_port",
    "object_manager_port",
    "dashboard_agent_listen_port",
    "dashboard_agent_grpc_port",
    "runtime_env_agent_port",
    "ray_client_server_port",
    "autoscaler_metric_port",
    "dashboard_metric_port",
)
# The ports a second node (a raylet joining the head) needs of its own.
_NODE_PORT_NAMES = (
    "node_manager_port",
    "object_manager_port",
    "metrics_export_port",
    "dashboard_agent_listen_port",
    "dashboard_agent_grpc_port",
    "runtime_env_agent_port",
)
_WORKER_PORTS = 100  # one per worker process; a demo run starts about a dozen


def _free_port(taken: set[int]) -> int:
    while True:
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


def _port_block(size: int, taken: set[int]) -> int:
    """The first port of `size` consecutive free ports, below the ephemeral range."""
    for _ in range(200):
        base = random.randrange(20_000, 32_000 - size)
        block = range(base, base + size)
        if taken.intersection(block):
            continue
        try:
            for port in block:
                with socket.socket() as s:
                    s.bind((HOST, port))
        except OSError:
            continue
        taken.update(block)
        return base
    raise RuntimeError(f"no block of {size} free ports found on {HOST}")


@dataclass
class LocalCluster:
    """One Ray head on 127.0.0.2 with its own ports and temp dir; `start()` then `stop()`."""

    num_cpus: int = 4
    resources: dict[str, float] = field(default_factory=dict)
    # Detect a lost node in ~3 s instead of ~15 s (RAY_FACTS.md), and poll Train's workers
    # every 0.25 s instead of 2 s.
    fast_failure_detection: bool = False
    # With node types ({"gpu_workers": {"resources": {...}, "min_workers": 0, "max_workers": 1}}),
    # the head runs a real autoscaler (Ray's monitor with a cluster config) whose node provider
    # is Ray's fake multi-node one: it starts a raylet on this host for each node it launches.
    autoscaler_node_types: dict[str, Any] | None = None
    # False: no dashboard (its head process and nine module processes), so no job API to wait
    # for, nor a state API: Ray Train's placement group cleaner is left out of a run's fits
    # (`_driver/trainer.py`). For clusters that only run drivers joined by address.
    dashboard: bool = True
    temp_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    ports: dict[str, int] = field(default_factory=dict)
    node_ports: dict[str, dict[str, int]] = field(default_factory=dict)
    worker_ports: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        # A short temp dir: Ray's unix socket paths live under it (limit ~107 characters).
        taken: set[int] = set()
        self.ports = {name: _free_port(taken) for name in _PORT_NAMES}
        base = _port_block(_WORKER_PORTS, taken)
        self.worker_ports = (base, base + _WORKER_PORTS - 1)

    @property
    def gcs_address(self) -> str:
        return f"{HOST}:{self.ports['port']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{HOST}:{self.ports['dashboard_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{HOST}:{self.ports['metrics_export_port']}/metrics"

    def env(self) -> dict[str, str]:
        """The environment for the head and for every client process of this cluster."""
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
        }
        return {
            **env,
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_metrics_report_interval_ms": "1000",
            "AUTOSCALER_METRIC_PORT": str(self.ports["autoscaler_metric_port"]),
            "DASHBOARD_METRIC_PORT": str(self.ports["dashboard_metric_port"]),
            **(
                {
                    # A killed raylet refuses the check at once: seen dead in 5 x 0.5 s. A
                    # live one starved of CPU (5 fits starting at once on 2 cores) must miss
                    # 5 checks of 1 s each: 3 of 0.5 s once marked live nodes dead in CI.
                    "RAY_health_check_period_ms": "500",
                    "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "5",
                    # Ray Train's controller (started by the driver, which passes RAY_TRAIN_*
                    # on) polls its workers every 2 s by default: a dead worker, a resize and
                    # a checkpoint reported within 2 s of the one before wait for that poll.
                    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
                }
                if self.fast_failure_detection
                else {}
            ),
        }

    def node_env(self) -> dict[str, str]:
        """The environment of this cluster's Ray processes, and so of every job, task and actor
        on it: `env()` plus `RAY_API_SERVER_ADDRESS` = this dashboard. Ray's state API, which
        Train's PlacementGroupCleaner calls with no address, otherwise looks for the one Ray on
        the machine; with a second Ray running, as on test machines, its monitor thread dies
        with "Found multiple active Ray instances" (a traceback in the job's logs; seen here).
        A real cluster node runs one Ray and needs nothing: `ray-trainer submit` injects
        nothing into the job for it."""
        env = {**self.env(), "RAY_API_SERVER_ADDRESS": self.dashboard_url}
        env[CLUSTER_MARK] = self.temp_dir  # what `processes()` finds its daemons by
        if self.autoscaler_node_types is not None:  # the fake provider's and a fast monitor
            env.update({"RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"})
        return env

    def autoscaling_config(self) -> str:
        """Write the cluster config of `autoscaler_node_types` (the shape of `cluster.yaml`:
        a head that offers no CPU) into the temp dir; its path."""
        head = {"resources": {"CPU": self.num_cpus}, "node_config": {}, "max_workers": 0}
        config = {
            "cluster_name": "ray-trainer-test",
            "max_workers": sum(t.get("max_workers", 1) for t in self.autoscaler_node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "gcs_address": self.gcs_address,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {
                "ray.head.default": head,
                **{
                    name: {"node_config": {}, "min_workers": 0, "max_workers": 1, **spec}
                    for name, spec in self.autoscaler_node_types.items()
                },
            },
            "head_node_type": "ray.head.default",
            "idle_timeout_minutes": 5,
            "upscaling_speed": 1.0,
            "auth": {},
            "docker": {},
            "file_mounts": {},
            **{k: [] for k in ("initialization_commands", "setup_commands",
                               "head_setup_commands", "worker_setup_commands",
                               "head_start_ray_commands", "worker_start_ray_commands",
                               "cluster_synced_files", "rsync_exclude", "rsync_filter")},
        }  # fmt: skip
        path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    def start_command(self) -> list[str]:
        p = self.ports
        dashboard = ["--include-dashboard=false"]
        if self.dashboard:
            dashboard = ["--include-dashboard=true", f"--dashboard-host={HOST}",
                         f"--dashboard-port={p['dashboard_port']}"]  # fmt: skip
        return [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            f"--node-ip-address={HOST}",
            f"--num-cpus={self.num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir}",
            f"--port={p['port']}",
            *dashboard,
            f"--metrics-export-port={p['metrics_export_port']}",
            f"--node-manager-port={p['node_manager_port']}",
            f"--object-manager-port={p['object_manager_port']}",
            f"--dashboard-agent-listen-port={p['dashboard_agent_listen_port']}",
            f"--dashboard-agent-grpc-port={p['dashboard_agent_grpc_port']}",
            f"--runtime-env-agent-port={p['runtime_env_agent_port']}",
            f"--ray-client-server-port={p['ray_client_server_port']}",
            f"--min-worker-port={self.worker_ports[0]}",
            f"--max-worker-port={self.worker_ports[1]}",
            "--disable-usage-stats",
            *([f"--resources={json.dumps(self.resources)}"] if self.resources else []),
            *(
                [f"--autoscaling-config={self.autoscaling_config()}"]
                if self.autoscaler_node_types is not None
                else []
            ),
        ]

    def start(self, timeout_s: float = 90.0) -> None:
        """Start the head and wait (bounded) until the dashboard's job API answers (without a
        dashboard: until `ray start` returns, the GCS and the raylet up)."""
        done = subprocess.run(
            self.start_command(),
            env=self.node_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"`ray start --head` failed:\n{done.stdout}\n{done.stderr}")
        if not self.dashboard:
            return
        last_error: Exception | None = None

        def answers() -> bool:
            nonlocal last_error
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/jobs/", timeout=5) as r:
                    return r.status == 200
            except OSError as e:
                last_error = e
                return False

        try:
            wait_until(answers, timeout_s, "the dashboard's job API", interval=0.5)
        except AssertionError as e:
            self.stop()
            raise AssertionError(
                f"{e} at {self.dashboard_url} (last error: {last_error}); logs in "
                f"{self.temp_dir}/session_latest/logs"
            ) from None

    def add_node(
        self,
        ip: str,
        num_cpus: int,
        resources: dict[str, float] | None = None,
        timeout_s: float = 60,
        hide: str | None = None,
        attempts: int = 2,
    ) -> None:
        """Start a second raylet on `ip` (127.0.0.3, ...) that joins this head; wait until it
        is alive. Its ports are explicit and free, and its processes name this temp dir.

        With `hide`, the node runs in a private mount namespace with an empty tmpfs over that
        folder (`unshare --mount`; needs root): like a real second machine, it does not see
        what the driver writes there.

        `ray start` gives a raylet 30 s (fixed in Ray) to register with the GCS; on a loaded
        2-core machine that was seen to run out ("The current node timed out during
        startup"). Such a start is killed and tried again, up to `attempts` times in all."""
        for attempt in range(1, attempts + 1):
            try:
                return self._start_node(ip, num_cpus, resources, timeout_s, hide)
            except (RuntimeError, subprocess.TimeoutExpired):
                self._kill_node(ip)
                if attempt == attempts:
                    raise

    def _kill_node(self, ip: str) -> None:
        """Kill the processes of a node start that failed (its command lines name `ip`)."""
        procs = [
            p
            for p in self.processes()
            if any(
                m in " ".join(_cmdline(p))
                for m in (f"--node-ip-address={ip}", f"--node_ip_address={ip}", f"{ip}:")
            )
        ]
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        psutil.wait_procs(procs, timeout=5)

    def _start_node(
        self,
        ip: str,
        num_cpus: int,
        resources: dict[str, float] | None,
        timeout_s: float,
        hide: str | None,
    ) -> None:
        taken = set(self.ports.values())
        ports = {name: _free_port(taken) for name in _NODE_PORT_NAMES}
        base = _port_block(_WORKER_PORTS, taken)
        self.node_ports[ip] = ports
        cmd = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            f"--address={self.gcs_address}",
            f"--node-ip-address={ip}",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={self.temp_dir}",
            *(f"--{name.replace('_', '-')}={port}" for name, port in ports.items()),
            f"--min-worker-port={base}",
            f"--max-worker-port={base + _WORKER_PORTS - 1}",
            "--disable-usage-stats",
        ]
        if resources:
            cmd.append(f"--resources={json.dumps(resources)}")
        if hide is not None:
            os.makedirs(hide, exist_ok=True)
            mount = f"mount -t tmpfs tmpfs {shlex.quote(hide)} && exec {shlex.join(cmd)}"
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount]
        done = subprocess.run(
            cmd, env=self.node_env(), capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"`ray start --address` for {ip} failed:\n{done.stdout}\n{done.stderr}"
            )

    def raylet(self, ip: str) -> psutil.Process:
        """The raylet process of the node on `ip`."""
        for proc in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                cmdline = " ".join(proc.cmdline())
                if "raylet" in proc.name() and f"--node_ip_address={ip}" in cmdline:
                    return proc
        raise LookupError(f"no raylet on {ip} in this cluster")

    def node_id(self, ip: str) -> str:
        """The Ray node id of the node on `ip`, as its raylet was started with (no process
        joins the cluster to ask it)."""
        for arg in self.raylet(ip).cmdline():
            if arg.startswith("--node_id="):
                return arg.split("=", 1)[1]
        raise LookupError(f"the raylet on {ip} names no node id")

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: started with its mark (`CLUSTER_MARK`, this temp dir)
        in its environment, or naming the temp dir on its command line, plus all their children
        (workers rename themselves `ray::IDLE`). Not by its ports: another cluster may listen
        on one that this one chose and left unused."""
        found: dict[int, psutil.Process] = {}
        me = os.getpid()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.info["pid"] == me:
                continue
            if self.temp_dir in " ".join(proc.info["cmdline"] or []) or self._marked(proc):
                found[proc.pid] = proc
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
        return list(found.values())

    def _marked(self, proc: psutil.Process) -> bool:
        try:
            return proc.environ().get(CLUSTER_MARK) == self.temp_dir
        except psutil.Error:  # ended, a zombie, or another user's
            return False

    def stop(self, timeout_s: float = 5.0) -> None:
        """Kill this cluster's processes by pid (SIGTERM, then SIGKILL after `timeout_s`), and
        remove the temp dir."""
        procs = self.processes()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for proc in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(sig)
            _, procs = psutil.wait_procs(procs, timeout=timeout_s)
            if not procs:
                break
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


#: Set by a test session (`tests/integration/conftest.py`) to an id of its own, in its process's
#: environment: every process it starts inherits it, down to the daemons of the Rays it starts
#: (`ray.init`'s, a `LocalCluster`'s head and nodes, a driver's embedded Ray).
SESSION_MARK = "RAY_TRAINER_TEST_SESSION"


def session_ray_servers(session: str) -> list[psutil.Process]:
    """The GCS servers (one per Ray instance) running with ``SESSION_MARK=session`` in their
    environment: the Rays that test session started, never another's on the machine (CI's smoke
    run of the benchmarks beside the integration tests, another checkout's tests)."""
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if proc.info["name"] == "gcs_server" and proc.environ().get(SESSION_MARK) == session:
                found.append(proc)
        except psutil.Error:  # ended, or another user's
            continue
    return found
