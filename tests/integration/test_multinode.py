"""The cluster as `cluster.yaml` builds it: a head that offers no CPU, and worker nodes.

One real local cluster for the module (`ray start` processes, see `local_cluster`): a head with
``--num-cpus=0`` on 127.0.0.2 and two worker nodes of 2 CPUs on 127.0.0.3 and 127.0.0.4. Like
separate machines, the worker nodes do not see the folder that holds the chat data (each runs in
a mount namespace with an empty tmpfs there): only the head, where the drivers run, can read it.
The pytest process never joins the cluster: the drivers are subprocesses
(`multinode_driver.py`, and `ray-trainer submit`'s job), as a user's would be.

- Before training, on the head (`multinode_driver.py`): the driver sees no autoscaler; a local
  file, a bucket (moto's S3 server) and a ``datasets.Dataset`` are encoded by tasks on the
  worker nodes; an ``EvalOnSave`` that keeps its default ``num_gpus=1`` is refused.
- One job submitted with ``ray-trainer submit --wait``: a chat fine-tune from the head's local
  file with LoRA and packing on the two worker nodes, ``EvalOnSave`` on CPU for each checkpoint
  and the best checkpoint kept by its score. Rank 0 holds the run at step 6 until the test has
  asked ``ray-trainer status`` through the GCS address and through the dashboard URL (so the
  answers do not race the run's end), while the metrics endpoint is polled all along.
- A GRPO job submitted with ``ray-trainer submit --wait`` (issue 50): prompts from the head's
  local file, one training worker that fills a worker node, so its ``hf`` rollout engine and its
  reward tasks run on the other node (Ray's state API says where the engine is); LoRA, the
  adapter synced each step through the object store across nodes, ``beta > 0``. A real
  Prometheus scrapes the cluster while the run is held at its last step, and every panel of the
  dashboard's RL row returns the run's series (``prometheus_support.py``).
- Storage (`storage_driver.py` on the head, the bucket's endpoint and keys in its job's
  environment): a local ``storage_path`` the worker nodes cannot see is refused; a run lives
  in a bucket (moto's S3 server) with a worker on each worker node, a killed rank resumed from
  it, every save evaluated, and a new call continues it through a filesystem object.

One cluster serves every test: starting one costs about as much as a short run here. The bucket
run was `test_storage.py`'s, in the session's Ray, beside a second bucket run here: one run on
this cluster now shows both (issue 47).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.request

import pytest
import yaml
from driver_process import outcome_in, scenario_outcome
from local_cluster import LocalCluster
from prometheus_support import Prometheus, prometheus_binary
from rt_support import read_records
from s3_server import S3Server
from support_paths import SUPPORT
from waiting import wait_until

from ray_trainer._monitoring.panels import PANELS, RL_ROW, substitute

HEAD, NODES = "127.0.0.2", ("127.0.0.3", "127.0.0.4")
RUN = "multinode"
MAX_STEPS = 12  # checkpoints 4, 8, 12; 25 steps an epoch (400 conversations, 16 a step)
HOLD_AT = 6  # the run waits there while the test asks for its status
SCORES = {4: 0.9, 8: 0.2, 12: 0.5}  # as multinode_job.SCORES: the best is the first
BUCKET = "ray-trainer-multinode"
CONVERSATIONS = 400
JOB_TIMEOUT_S = 420  # the job: runtime env, driver, encoding, Train start, run, evaluations
STATUS_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """The tiny chat model (every node sees it), and the chat data in a folder that only the
    head will see."""
    from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model

    root = tmp_path_factory.mktemp("multinode")
    model = make_tiny_chat_model(root / "model", style="chatml")
    hidden = root / "head_only"
    hidden.mkdir()
    lines = [json.dumps({"messages": m}) for m in chat_conversations(CONVERSATIONS, seed=1)]
    data = hidden / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    return {"root": root, "model": str(model), "hidden": str(hidden), "data": str(data),
            "lines": lines}  # fmt: skip


@pytest.fixture(scope="module")
def cluster(chat):
    c = LocalCluster(num_cpus=0)
    c.start(timeout_s=180)
    try:
        for ip in NODES:
            c.add_node(ip, num_cpus=2, hide=chat["hidden"], timeout_s=120)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def s3(chat):
    server = S3Server()
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    body = ("\n".join(chat["lines"][:40]) + "\n").encode()
    server.client().put_object(Bucket=BUCKET, Key="chat.jsonl", Body=body)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prepared(cluster, chat, s3):
    """One driver on the head: what it sees, three sources encoded, one run refused."""
    root = chat["root"]
    common = {"model": chat["model"], "max_length": 256, "storage_path": str(root / "prepared")}
    rows = [json.loads(line) for line in chat["lines"][:30]]
    encode = {
        "local": {**common, "data": chat["data"], "piece_records": 50},  # 8 pieces, 4 at once
        "bucket": {**common, "data": f"s3://{BUCKET}/chat.jsonl"},
        "dataset": {**common, "dataset_rows": rows},
    }
    refuse = {
        **common,
        "data": chat["data"],
        "storage_path": str(root / "refused"),
        "run_name": "refused",
        "max_steps": 4,
        "save_every_steps": 2,
    }
    scenario = {"env": s3.env(), "encode": encode, "refuse": refuse}
    done = subprocess.run(
        [sys.executable, os.path.join(SUPPORT, "multinode_driver.py"), cluster.gcs_address,
         json.dumps(scenario)],
        env={**cluster.env(), **s3.env()},
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    found = outcome_in(done.stdout)
    assert found is not None, f"rc={done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return found


def test_the_driver_runs_on_a_head_without_cpu_and_sees_no_autoscaler(prepared):
    where = prepared["where"]
    assert where["driver_resources"].get("CPU", 0) == 0, where
    assert "node:__internal_head__" in where["driver_resources"]
    assert where["nodes"] == [HEAD, *NODES]
    # `ray start --head` runs Ray's read-only autoscaler monitor: one anonymous type per node.
    assert len(set(where["reported_node_types"])) == 3, where
    assert all(t.startswith("node_") for t in where["reported_node_types"]), where
    assert where["has_autoscaler"] is False


@pytest.mark.parametrize(
    ("source", "records", "pieces"),
    [("local", CONVERSATIONS, 8), ("bucket", 40, 1), ("dataset", 30, 1)],
)
def test_every_source_is_encoded_by_tasks_on_the_worker_nodes(prepared, source, records, pieces):
    # The tasks take a CPU each: none can run on the head. The local file is not on the
    # worker nodes' disks: its pieces came from the driver, at most 4 (the cluster's CPUs) in
    # the head's object store at a time.
    encoded = prepared[source]
    assert encoded["pieces"] == pieces, encoded
    assert encoded["format"] == "messages", encoded
    assert encoded["records"] == encoded["samples"] == records, encoded
    assert encoded["dropped"] == 0
    assert os.path.isfile(os.path.join(encoded["cache"], "meta.json"))


def test_an_evaluation_that_no_node_can_run_is_refused_before_training(prepared, chat):
    error = prepared["refuse"].get("error")
    assert error, prepared["refuse"]
    assert error.startswith("EvalOnSave(num_gpus=1, num_cpus=1) could never run its evaluations")
    assert "GPU=0 over 3 node(s)" in error and "no autoscaler" in error
    assert "Pass num_gpus=0 to evaluate on CPU" in error
    assert not os.path.exists(chat["root"] / "refused" / "refused")  # nothing of the run written


# ---- one run, submitted as a job ---------------------------------------------------------


def _cli(cluster: LocalCluster, *args: str, timeout: float = STATUS_TIMEOUT_S, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "ray_trainer.cli", *args],
        capture_output=True,
        text=True,
        env=cluster.env(),
        timeout=timeout,
        cwd=cwd,
    )


class _MetricsWatcher(threading.Thread):
    """Polls the head's Prometheus endpoint and keeps the `ray_trainer_*` lines of one run."""

    def __init__(self, url: str, run: str) -> None:
        super().__init__(daemon=True)
        self.url, self.tag = url, f'run="{run}"'
        self.lines: dict[str, str] = {}  # metric name -> the first line seen
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=5) as r:
                    text = r.read().decode()
            except OSError:
                text = ""
            for line in text.splitlines():
                if line.startswith("ray_trainer_") and self.tag in line:
                    self.lines.setdefault(line.split("{", 1)[0], line)
            self.stop.wait(0.5)


def _job_config(chat, workdir, ranks, hold) -> str:
    root = chat["root"]
    fields = {
        "model": chat["model"],
        "data": chat["data"],  # on the head's disk only
        "lora": {"r": 8, "lora_alpha": 16},
        "packing": True,
        "max_length": 256,
        "max_tokens_per_batch": 512,
        "batch_size": 8,
        "num_workers": 2,
        "placement_strategy": "SPREAD",  # one worker on each worker node
        "max_steps": MAX_STEPS,
        "save_every_steps": 4,
        "log_every_steps": 2,
        "learning_rate": 5e-2,
        "warmup_steps": 0,
        "storage_path": str(root / "runs"),
        "run_name": RUN,
        "num_checkpoints_to_keep": 1,
        "checkpoint_score_attribute": "score",
        "checkpoint_score_order": "max",
        "callbacks": [
            "multinode_job:EVALUATE",
            {"class": "multinode_job:WhereAndWhat", "folder": str(ranks)},
            {"class": "multinode_job:HoldAt", "folder": str(hold), "step": HOLD_AT},
            {"class": "callbacks:RayMetrics", "report_every_s": 1.0},
            "callbacks:JsonlLogger",
        ],
    }
    return _job_files(workdir, "multinode.yaml", fields)


def _submit_waiting(cluster: LocalCluster, config: str, workdir):
    """`ray-trainer submit CONFIG --working-dir WORKDIR --wait` from `workdir` (as a user submits
    from their project: its callbacks import there too): the process, the list its output lines
    go to, and the thread that reads them (started)."""
    submit = subprocess.Popen(
        [
            *(sys.executable, "-m", "ray_trainer.cli", "submit", config),
            *("--address", cluster.dashboard_url, "--working-dir", str(workdir), "--wait"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env(),
        cwd=workdir,
    )  # fmt: skip
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(submit.stdout), daemon=True)
    reader.start()
    return submit, output, reader


def _job_files(workdir, name: str, fields: dict) -> str:
    """A submitted job's working folder: its config `name` (YAML of `fields`), the job's own
    module and what it imports; the config's path."""
    config = workdir / name
    config.write_text(yaml.safe_dump(fields))
    for module in ("multinode_job.py", "waiting.py"):
        shutil.copy(os.path.join(SUPPORT, module), workdir / module)
    return str(config)


def _live_status(cluster: LocalCluster, address: str) -> tuple[dict | None, list[str]]:
    """`ray-trainer status RUN --address ADDRESS --json` of the held run: its status, and every
    answer (a loaded machine may need a second try)."""
    answers: list[str] = []

    def answered() -> dict | None:
        done = _cli(
            cluster,
            *("status", RUN, "--address", address, "--json", "--timeout", str(STATUS_TIMEOUT_S)),
            timeout=STATUS_TIMEOUT_S + 30,
        )
        answers.append(f"rc={done.returncode} {done.stderr.strip()[-300:]}")
        return json.loads(done.stdout) if done.returncode == 0 else None

    with contextlib.suppress(AssertionError):  # judged by the test, with the answers
        return wait_until(answered, 2 * STATUS_TIMEOUT_S, f"status over {address}"), answers
    return None, answers


@pytest.fixture(scope="module")
def submitted(cluster, chat):
    """`ray-trainer submit --wait` of the run; while the run is held at step `HOLD_AT`, its
    `status` through the GCS address and through the dashboard URL, and the metrics endpoint
    polled all along."""
    root = chat["root"]
    workdir, ranks, hold = root / "job", root / "ranks", root / "hold"
    workdir.mkdir()
    config = _job_config(chat, workdir, ranks, hold)
    metrics = _MetricsWatcher(cluster.metrics_url, RUN)
    metrics.start()
    submit, output, reader = _submit_waiting(cluster, config, workdir)

    def ended() -> bool:
        return submit.poll() is not None

    statuses: dict = {}
    with contextlib.suppress(AssertionError):  # judged below, with the job's output
        wait_until(lambda: (hold / "held").exists() or ended(), JOB_TIMEOUT_S, "step 6")
    if (hold / "held").exists():  # both ways at once: training is paused, the cores are free
        asks = {"gcs": cluster.gcs_address, "dashboard": cluster.dashboard_url}
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            futures = {how: pool.submit(_live_status, cluster, a) for how, a in asks.items()}
        statuses = {how: future.result() for how, future in futures.items()}
        with contextlib.suppress(AssertionError):  # judged by the test
            wait_until(lambda: metrics.lines, 20, "the run's metrics", interval=0.5)
        (hold / "release").write_text("go")
    with contextlib.suppress(AssertionError):  # judged below, with the job's output
        wait_until(ended, JOB_TIMEOUT_S, "the job to end", interval=0.5)
    metrics.stop.set()
    metrics.join(10)
    if not ended():
        submit.kill()
        reader.join(10)
        pytest.fail(
            f"`ray-trainer submit --wait` still running after {JOB_TIMEOUT_S} s; "
            f"its output:\n{''.join(output)[-4000:]}"
        )
    reader.join(30)
    out = "".join(output)
    assert submit.returncode == 0, f"submit exited {submit.returncode}:\n{out[-6000:]}"
    run_dir = root / "runs" / RUN
    logged = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "out": out,
        "statuses": statuses,
        "metrics": metrics.lines,
        "config": config,
        "workdir": workdir,
        "run_dir": run_dir,
        "logged": logged,
        "ranks": read_records(str(ranks), "rank"),
    }


def test_a_lora_chat_run_from_the_heads_file_learns_packed_on_the_worker_nodes(submitted, cluster):
    out = submitted["out"]
    job_id = re.search(rf"submitted job (\S+) \(run {RUN}\)", out)
    assert job_id, f"no job id in the submit output:\n{out[-4000:]}"
    assert f"ray job logs --follow --address {cluster.dashboard_url} {job_id[1]}" in out
    assert f"job {job_id[1]} SUCCEEDED" in out
    assert f"step {MAX_STEPS}/{MAX_STEPS}" in out, f"no final progress line:\n{out[-4000:]}"
    losses = {r["step"]: r["loss"] for r in submitted["logged"] if r["event"] == "on_log"}
    assert sorted(losses) == list(range(2, MAX_STEPS + 1, 2))
    assert losses[MAX_STEPS] < losses[2] * 0.98, losses
    # Both workers trained, one on each worker node (never the head), on packed batches only.
    batches = submitted["ranks"]
    assert {r["rank"]: r["node"] for r in batches} in (
        {0: NODES[0], 1: NODES[1]},
        {0: NODES[1], 1: NODES[0]},
    ), {(r["rank"], r["node"]) for r in batches}
    assert batches and all(r["packed"] for r in batches)
    assert {r["step"] for r in batches} == set(range(1, MAX_STEPS + 1))
    # Both workers wrote each kept checkpoint into the local storage_path every node sees.
    kept = sorted(submitted["run_dir"].glob("checkpoint_0*"))
    assert kept and all((c / "rank1.complete").exists() for c in kept), kept


def test_every_checkpoint_is_evaluated_on_a_worker_node_and_the_best_is_kept(submitted):
    evals = [r for r in submitted["logged"] if r["event"] == "on_evaluate"]
    assert sorted(r["step"] for r in evals) == [4, 8, 12], evals
    for r in evals:
        metrics = r["val_metrics"]
        assert metrics["score"] == SCORES[r["step"]]
        assert metrics["has_adapter"] == 1.0  # the LoRA export, in the task's copy
        assert metrics["on_head"] == 0.0
    run_dir = submitted["run_dir"]
    kept = sorted(p.name for p in run_dir.glob("checkpoint_0*"))
    assert kept == ["checkpoint_00000004", "checkpoint_00000012"]  # the best and the newest
    ranking = json.loads((run_dir / "ranking.json").read_text())
    by_name = {c["name"]: c for c in ranking["checkpoints"]}
    assert by_name["checkpoint_00000004"]["metrics"]["score"] == 0.9
    assert "best checkpoint: " + str(run_dir / "checkpoint_00000004") in submitted["out"]


def test_status_and_metrics_follow_the_submitted_run(submitted, cluster):
    statuses = submitted["statuses"]
    assert statuses, "the run was never held at step 6: no status asked"
    # Through the GCS address (a short-lived driver) and through the dashboard URL (a job on
    # the head): the same live run, held at step 6.
    for how, (live, answers) in statuses.items():
        assert live is not None, f"status over the {how} address never saw the run: {answers}"
        assert live["run_name"] == RUN and 0 < live["global_step"] <= HOLD_AT, (how, live)
        assert live["num_callback_errors"] == 0, live["callback_errors"]
        assert all(a.startswith(("rc=0", "rc=2")) for a in answers), answers  # 2: timed out

    lines = submitted["metrics"]
    assert lines, f"no ray_trainer_* line for run {RUN} at {cluster.metrics_url}"
    assert {"ray_trainer_step", "ray_trainer_loss"} & set(lines), (
        f"no training gauge seen while the run was live; seen: {sorted(lines)}"
    )


def test_the_job_gets_nothing_it_did_not_ask_for_and_its_run_name_once(submitted, cluster):
    # No dashboard URL of the laptop in the job's environment.
    with urllib.request.urlopen(f"{cluster.dashboard_url}/api/jobs/{RUN}", timeout=10) as r:
        runtime_env = json.loads(r.read())["runtime_env"]
    assert "env_vars" not in runtime_env, runtime_env
    # The run name is the job's submission id: a second job of the same run is refused.
    again = _cli(
        cluster,
        *("submit", submitted["config"], "--address", cluster.dashboard_url, "--no-wait"),
        *("--working-dir", str(submitted["workdir"])),
        cwd=submitted["workdir"],
    )
    assert again.returncode == 2, again.stdout + again.stderr
    assert f"already has a job {RUN}" in again.stderr and "Traceback" not in again.stderr


@pytest.mark.parametrize("how", ["gcs", "dashboard"])
def test_status_of_an_unknown_run_exits_1_and_lists_live_runs(cluster, how):
    address = cluster.gcs_address if how == "gcs" else cluster.dashboard_url
    done = _cli(cluster, "status", "no-such-run", "--address", address)
    assert done.returncode == 1, done.stderr
    # The query runs beside the cluster either way and names the cluster it asked.
    assert f"no live run named no-such-run on {cluster.gcs_address}; live runs:" in done.stderr


# ---- a GRPO job: engines on another node than the workers, its RL row in Prometheus ------

GRPO_RUN, GRPO_STEPS = "grpo-multinode", 3


@pytest.fixture(scope="module")
def grpo_job(cluster, chat):
    """`ray-trainer submit --wait` of a GRPO run whose prompts are in a file only the head sees:
    one training worker that takes a whole worker node (2 CPUs), so its rollout engine (1 CPU)
    and its reward tasks go to the other one; rollouts asynchronous (``max_staleness=1``: the
    next step's sampled on that node while a step trains); `RayMetrics` on, a real Prometheus scraping the
    cluster, and the run held at its last step while every panel of the dashboard's RL row is
    asked through Prometheus for the run's series."""
    root = chat["root"]
    workdir, where, hold = root / "grpo_job", root / "grpo_where", root / "grpo_hold"
    workdir.mkdir()
    prompts = os.path.join(chat["hidden"], "prompts.jsonl")  # on the head's disk only
    with open(prompts, "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Count to {i}."}]}) + "\n")
    fields = {
        "objective": "grpo",
        "model": chat["model"],
        "data": prompts,
        "reward_fns": ["multinode_job:odd_first_token"],
        "grpo": {"num_generations": 2, "max_completion_length": 6, "beta": 0.04},  # KL's panel
        "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "rollout_backend": "hf",
        "rollout_resources": {"CPU": 1},
        "max_staleness": 1,  # asynchronous: the RL row's queue panels get the run's series
        # The run is held at its last step's end: its last logs reach the callback actor (and
        # the RL row's gauges) through rank 0's flush timer, the loop being stalled in a hook.
        "resources_per_worker": {"CPU": 2},
        "num_workers": 1,
        "batch_size": 2,
        "max_length": 48,
        "max_steps": GRPO_STEPS,
        "log_every_steps": 1,
        "learning_rate": 1e-3,
        "storage_path": str(root / "runs"),
        "run_name": GRPO_RUN,
        "callbacks": [
            {"class": "multinode_job:EnginesWhere", "folder": str(where)},
            {"class": "multinode_job:HoldAt", "folder": str(hold), "step": GRPO_STEPS},
            {"class": "callbacks:RayMetrics", "report_every_s": 1.0},
            "callbacks:JsonlLogger",
        ],
    }
    config = _job_files(workdir, "grpo.yaml", fields)
    (root / "prometheus").mkdir()
    prometheus = Prometheus(prometheus_binary(), cluster, str(root / "prometheus"))
    submit, output, reader = _submit_waiting(cluster, config, workdir)
    queries = [
        (f"{panel.title} / {series.legend}", substitute(series.expr, GRPO_RUN, None))
        for panel in PANELS
        if panel.row == RL_ROW
        for series in panel.series
    ]
    empty: list[str] = [what for what, _ in queries]
    seen: dict[str, object] = {"held": False}  # what Prometheus had, for a failure's message
    try:
        with contextlib.suppress(AssertionError):  # judged below, with the job's output
            wait_until(
                lambda: (hold / "held").exists() or submit.poll() is not None,
                JOB_TIMEOUT_S,
                "the GRPO run's last step",
            )
        if (hold / "held").exists():

            def every_rl_panel_has_the_run() -> bool:
                nonlocal empty
                empty = [
                    what
                    for what, expr in queries
                    if not any(r["metric"].get("run") == GRPO_RUN for r in prometheus.query(expr))
                ]
                return not empty

            with contextlib.suppress(AssertionError):  # judged by the test
                wait_until(every_rl_panel_has_the_run, 60, "the RL row's series", interval=1)
            if empty:
                seen.update(held=True, up=prometheus.query("up"), names=prometheus.query(
                    'count by (__name__, run) ({__name__=~"ray_trainer_.+"})'))  # fmt: skip
            (hold / "release").write_text("go")
        with contextlib.suppress(AssertionError):
            wait_until(lambda: submit.poll() is not None, JOB_TIMEOUT_S, "the GRPO job to end")
    finally:
        prometheus.stop()
        if submit.poll() is None:
            submit.kill()
        reader.join(30)
    out = "".join(output)
    assert submit.returncode == 0, f"submit exited {submit.returncode}:\n{out[-6000:]}"
    logged = [
        json.loads(x) for x in (root / "runs" / GRPO_RUN / "metrics.jsonl").read_text().splitlines()
    ]
    placement = json.loads((where / "engines.json").read_text())
    return {"out": out, "logged": logged, "placement": placement, "queries": queries,
            "empty": empty, "seen": seen}  # fmt: skip


def test_a_submitted_grpo_job_samples_on_another_node_than_its_worker(grpo_job):
    assert f"job {GRPO_RUN} SUCCEEDED" in grpo_job["out"], grpo_job["out"][-4000:]
    placement = grpo_job["placement"]
    assert placement["worker"] in NODES, placement
    # The engine (1 CPU) could only go where the worker (both CPUs of its node) is not.
    assert placement["engines"] == [n for n in NODES if n != placement["worker"]], placement
    logs = [r for r in grpo_job["logged"] if r["event"] == "on_log"]
    assert sorted(r["step"] for r in logs) == list(range(1, GRPO_STEPS + 1))
    for r in logs:  # the adapter synced each step; the engine's probe agrees (fp32)
        assert 0.0 <= r["reward"] <= 1.0 and r["sync/bytes"] > 0, r
        assert r["rollout/logprob_diff"] < 1e-5 and r["kl"] >= 0.0, r
        # Asynchronous (max_staleness=1) across nodes: each step's completions are at most one
        # version old, the first step's sampled by its own policy.
        assert r["rollout/age_max"] <= 1 and r["rollout/stale_dropped"] == 0, r
    assert logs[0]["rollout/age_max"] == 0 and max(r["rollout/age_max"] for r in logs) == 1


def test_every_panel_of_the_rl_row_shows_the_grpo_run_from_a_real_prometheus(grpo_job):
    assert grpo_job["queries"], "the dashboard has no RL row"
    assert not grpo_job["empty"], (
        f"RL panels without a series for {GRPO_RUN}: {grpo_job['empty']}; "
        f"Prometheus had: {grpo_job['seen']}"
    )


# ---- storage that a node cannot see -------------------------------------------------------


TEXTS = [f"the quick brown fox jumps over the lazy dog number {i}" for i in range(200)]


@pytest.fixture(scope="module")
def bucket_runs(cluster, chat, s3, tmp_path_factory):
    """One driver on the head (`storage_driver.py`), its job's environment carrying the bucket's
    endpoint and keys to every worker, the callback actor and every evaluation task, as a
    cluster's instance profile would: a run whose `storage_path` is a local folder the worker
    nodes cannot see (refused), then a run in the bucket with a worker on each worker node
    (data from the bucket, rank 1 killed once, every save evaluated, `status` asked), then a new
    call of that run through a filesystem object. Was `test_storage.py`'s run in the session's
    Ray plus a second bucket run here: one run now shows both."""
    tmp = tmp_path_factory.mktemp("bucket-runs")
    cwd, records = tmp / "cwd", tmp / "records"
    cwd.mkdir()
    body = "".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode()
    s3.client().put_object(Bucket=BUCKET, Key="data/train.jsonl", Body=body)
    hidden = os.path.join(chat["hidden"], "storage")  # the worker nodes see an empty folder
    os.makedirs(hidden)
    data = os.path.join(hidden, "train.jsonl")  # only the driver sees it: shipped with the run
    with open(data, "w") as f:
        f.write("".join(json.dumps({"text": f"the quick brown fox number {i}"}) + "\n"
                        for i in range(200)))  # fmt: skip
    common = {
        "batch_size": 4, "num_workers": 2, "log_every_steps": 2, "save_every_steps": 2,
        "placement_strategy": "SPREAD",  # one worker on each worker node
        "demo": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "max_length": 32,
    }  # fmt: skip
    in_bucket = {
        **common,
        "run_name": "in-a-bucket",
        "storage_path": f"s3://{BUCKET}/runs",
        "data": f"s3://{BUCKET}/data/train.jsonl",
    }
    scenario = {
        "env": s3.env(),
        "runs": [
            {**common, "data": data, "max_steps": 4, "run_name": "local-storage",
             "storage_path": os.path.join(hidden, "runs")},
            {
                **in_bucket,
                "max_steps": 6,
                "max_failures": 1,
                "callbacks": [
                    {"class": "AllRanksRecorder", "folder": str(records)},
                    {"class": "KillRank1Once", "step": 3},  # the restart reads the bucket
                    {"class": "EvalOnSave", "eval_fn": "eval_local_checkpoint", "num_gpus": 0},
                    {"class": "StatusProbe", "folder": str(records), "step": 5, "attempt": 1},
                    {"class": "JsonlLogger"},
                ],
            },
            # A new call with the same run_name continues it, here through a filesystem object
            # (`storage_filesystem`, as for a custom endpoint) and a path on it.
            {**in_bucket, "max_steps": 8, "storage_path": f"{BUCKET}/runs",
             "s3_filesystem_object": True},
            # A local path that every node sees passes: the submitted job's run keeps its
            # checkpoints in one, from workers on two nodes.
        ],
        "load_model_of": 1,
    }  # fmt: skip
    env = {**cluster.env(), **s3.env()}
    refused, first, second = scenario_outcome(
        "storage_driver.py", cluster.gcs_address, scenario, env, cwd
    )
    return {"refused": refused, "first": first, "second": second, "hidden": hidden,
            "records": records, "cwd": cwd}  # fmt: skip


def test_a_local_storage_path_a_node_cannot_see_is_refused_and_a_bucket_works(bucket_runs, s3):
    refused, trained = bucket_runs["refused"], bucket_runs["first"]
    assert "StorageNotShared" in refused["error"], refused
    assert all(ip in refused["error"] for ip in NODES) and "s3://" in refused["error"]
    # nothing written
    assert not os.path.exists(os.path.join(bucket_runs["hidden"], "runs", "local-storage"))
    assert "error" not in trained, trained
    assert trained["global_step"] == 6
    records = read_records(str(bucket_runs["records"]), "all_ranks")
    mine = [r for r in records if r["event"] == "on_step_end"]
    assert {r["rank"] for r in mine} == {0, 1}
    assert len({r["node"] for r in mine}) == 2  # one worker on each worker node
    assert "runs/in-a-bucket/checkpoint_00000004/rank1.complete" in s3.keys(BUCKET)


def test_a_run_lives_in_a_bucket(bucket_runs, s3):
    first, second = bucket_runs["first"], bucket_runs["second"]
    default_storage = os.path.expanduser("~/ray_trainer_runs/in-a-bucket")
    run = f"s3://{BUCKET}/runs/in-a-bucket"
    assert "error" not in first, first
    assert (first["global_step"], first["attempts"]) == (6, 2)
    assert first["checkpoint_path"] == f"{run}/checkpoint_00000006"
    # One evaluation per checkpoint (step 2 from before the crash), each given a local folder.
    evals = first["evaluations"]
    assert [e["step"] for e in evals] == [2, 4, 6], evals
    for e in evals:
        m = e["metrics"]
        assert m["local_is_dir"] and m["local_has_manifest"]
        assert m["checkpoint_step"] == e["step"]
        assert m["uri"] == e["checkpoint_path"] == f"{run}/checkpoint_{e['step']:08d}"
    # load_model from the bucket, in the driver, gives the weights the task evaluated.
    assert first["loaded_param_sum"] == pytest.approx(evals[-1]["metrics"]["param_sum"])
    # `ray-trainer status` answered for the live run (asked from rank 0, on a worker node).
    [probe] = read_records(str(bucket_runs["records"]), "status")
    assert probe["returncode"] == 0, probe["stderr"]
    status = json.loads(probe["stdout"])
    assert status["run_name"] == "in-a-bucket" and status["events"]["on_save"] >= 1
    # The continued run resumed from the bucket (named by its path on the filesystem object).
    assert "error" not in second, second
    assert second["global_step"] == 8
    assert second["checkpoint_path"] == f"{BUCKET}/runs/in-a-bucket/checkpoint_00000008"
    keys = s3.keys(BUCKET)
    for step in (2, 4, 6, 8):
        for name in ("rank0.complete", "rank1.complete", "model.pt", "model_spec.json"):
            assert f"runs/in-a-bucket/checkpoint_{step:08d}/{name}" in keys
    assert "runs/in-a-bucket/checkpoint_00000006/actor_state.pt" in keys
    assert "runs/in-a-bucket/run.json" in keys and "runs/in-a-bucket/metrics.jsonl" in keys
    logged = s3.client().get_object(Bucket=BUCKET, Key="runs/in-a-bucket/metrics.jsonl")
    steps = [json.loads(x)["step"] for x in logged["Body"].read().decode().splitlines()]
    assert {2, 4, 6} <= set(steps)
    # Nothing of the run on the local disk: not in the working dir, not in the default storage.
    assert list(bucket_runs["cwd"].iterdir()) == [] and not os.path.exists(default_storage)
