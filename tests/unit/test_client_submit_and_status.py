"""`ray-trainer status` / `submit`: parsing, job building and formatting, without a cluster."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import pytest
from cluster_support import closed_port, write_config

from ray_trainer._client import job_api
from ray_trainer._client import status as status_cmd
from ray_trainer._client import submit as submit_cmd
from ray_trainer._client.job_api import DashboardError, dashboard_address
from ray_trainer._client.status import (
    REPLY_MARKER,
    ClusterUnreachable,
    NoLiveRun,
    check_reachable,
    format_status,
    live_run_names,
    no_live_run_message,
    parse_reply,
)
from ray_trainer._client.submit import (
    SubmitError,
    build_entrypoint,
    config_in_working_dir,
    prepare_submission,
)
from ray_trainer._errors import TrainingArgsError
from ray_trainer.cli import _parser, main

DASH = "http://127.0.0.2:8265"


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path)


def _submit_opts(config, *extra: str):
    return _parser().parse_args(["submit", str(config), "--address", DASH, *extra])


# ---- parsing -------------------------------------------------------------------------------


def test_status_arguments():
    opts = _parser().parse_args(["status", "my-run", "--address", "10.0.0.1:6379", "--json"])
    assert (opts.command, opts.run_name, opts.address, opts.json) == (
        "status",
        "my-run",
        "10.0.0.1:6379",
        True,
    )
    defaults = _parser().parse_args(["status", "my-run"])
    assert defaults.address is None and defaults.json is False and defaults.timeout == 30
    assert defaults.headers is None and defaults.verify is None and not defaults.reply_line


def test_submit_arguments():
    opts = _parser().parse_args(
        ["submit", "c.yaml", "--address", DASH, "--set", "a=1", "--set", "b=x y", "--wait"]
    )
    assert opts.overrides == ["a=1", "b=x y"] and opts.wait and opts.working_dir == "."
    assert not opts.no_working_dir
    defaults = _parser().parse_args(["submit", "c.yaml"])
    assert defaults.wait is True and defaults.timeout == 30  # waits by default, like ray job
    assert defaults.pip == [] and defaults.env == [] and defaults.runtime_env is None
    assert _parser().parse_args(["submit", "c.yaml", "--no-wait"]).wait is False
    for conflict in (["--working-dir", "d", "--no-working-dir"], ["--wait", "--no-wait"]):
        with pytest.raises(SystemExit):
            _parser().parse_args(["submit", "c.yaml", *conflict])


# ---- submit: building the job --------------------------------------------------------------


def test_entrypoint_quotes_every_word():
    overrides = ["max_steps=100", "run_name=my run", "data=it's here.jsonl", "x=$HOME;rm -rf"]
    entry = build_entrypoint("configs/run.yaml", overrides)
    assert entry.startswith("ray-trainer run configs/run.yaml --set max_steps=100 ")
    words = shlex.split(entry)  # what the job's shell will run
    assert words == ["ray-trainer", "run", "configs/run.yaml"] + [
        w for o in overrides for w in ("--set", o)
    ]


def test_config_must_be_inside_the_working_dir(tmp_path):
    inside = tmp_path / "wd" / "sub" / "run.yaml"
    inside.parent.mkdir(parents=True)
    inside.touch()
    assert config_in_working_dir(inside, tmp_path / "wd") == "sub/run.yaml"
    outside = tmp_path / "elsewhere.yaml"
    outside.touch()
    with pytest.raises(SubmitError, match="not inside the working dir") as e:
        config_in_working_dir(outside, tmp_path / "wd")
    assert "--working-dir" in str(e.value) and "--no-working-dir" in str(e.value)


def test_prepare_submission_sets_run_name_and_working_dir_and_nothing_else(config):
    opts = _submit_opts(config, "--working-dir", str(config.parent), "--set", "max_steps=20")
    job = prepare_submission(opts)
    address, entry, runtime_env, run_name = (
        job.address,
        job.entrypoint,
        job.runtime_env,
        job.run_name,
    )
    assert address == DASH
    assert run_name.startswith("run-")
    assert shlex.split(entry) == [
        "ray-trainer",
        "run",
        "run.yaml",
        "--set",
        "max_steps=20",
        "--set",
        f"run_name={run_name}",
    ]
    # The laptop's dashboard URL is no business of the job's: no env_vars are injected.
    assert runtime_env == {"working_dir": str(config.parent.resolve()), "excludes": [".git"]}


def test_prepare_submission_keeps_a_configured_run_name(config):
    opts = _submit_opts(config, "--no-working-dir", "--set", "run_name=fixed")
    job = prepare_submission(opts)
    assert job.run_name == "fixed"
    assert job.entrypoint.count("run_name=") == 1
    assert job.runtime_env == {}
    assert shlex.split(job.entrypoint)[2] == str(config.resolve())  # every node sees this path


def test_prepare_submission_validates_the_config_first(tmp_path, config):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_step: 10\n")
    with pytest.raises(TrainingArgsError, match="did you mean 'max_steps'"):
        prepare_submission(_submit_opts(bad, "--working-dir", str(tmp_path)))
    with pytest.raises(TrainingArgsError):
        prepare_submission(_submit_opts(config, "--working-dir", str(tmp_path), "--set", "nope"))
    (tmp_path / "wd").mkdir()
    with pytest.raises(SubmitError, match="not inside"):
        prepare_submission(_submit_opts(config, "--working-dir", str(tmp_path / "wd")))
    with pytest.raises(SubmitError, match="not a directory"):
        prepare_submission(_submit_opts(config, "--working-dir", str(tmp_path / "missing")))


def test_submit_address_from_flag_or_environment(monkeypatch):
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a GCS address: not for the job API
    with pytest.raises(DashboardError, match="--address http://HOST:8265"):
        dashboard_address(None)
    monkeypatch.setenv("RAY_ADDRESS", "http://10.0.0.1:8265")
    assert dashboard_address(None) == "http://10.0.0.1:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://h:1/")
    assert dashboard_address(None) == "http://h:1"
    assert dashboard_address("https://x:2") == "https://x:2"


@pytest.mark.parametrize("address", ["10.0.0.5:6379", "10.0.0.5", "ray://10.0.0.5:10001"])
def test_an_address_without_http_names_the_dashboard_url(address):
    with pytest.raises(DashboardError) as e:
        dashboard_address(address)
    assert "--address http://10.0.0.5:8265" in str(e.value)
    if address.endswith(":6379"):
        assert "is the cluster's GCS address" in str(e.value)


# ---- submit: talking to the job API (a fake client) ----------------------------------------


class FakeClient:
    """Stands in for ``JobSubmissionClient``: records what it is given, answers like Ray."""

    instances: list[FakeClient] = []
    final = "SUCCEEDED"
    refuse: Exception | None = None
    logs = ""

    def __init__(self, address, headers=None, verify=True):
        self.address, self.headers, self.verify = address, headers, verify
        self.submitted, self.deleted, self.stopped = None, [], []
        FakeClient.instances.append(self)

    def submit_job(self, **kwargs):
        if self.refuse is not None:
            raise self.refuse
        self.submitted = kwargs
        return kwargs.get("submission_id") or "raysubmit_test"

    def get_job_logs(self, job_id):
        return self.logs

    def delete_job(self, job_id):
        self.deleted.append(job_id)

    def stop_job(self, job_id):
        self.stopped.append(job_id)

    async def tail_job_logs(self, job_id):
        for chunk in ("[r] step 10/20\n", "[r] step 20/20\n"):
            yield chunk

    def get_job_status(self, job_id):
        return SimpleNamespace(value=self.final)

    def get_job_info(self, job_id):
        return SimpleNamespace(message="done" if self.final == "SUCCEEDED" else "boom")


@pytest.fixture
def fake_client(monkeypatch):
    job_submission = pytest.importorskip("ray.job_submission")
    FakeClient.instances = []
    FakeClient.final, FakeClient.refuse, FakeClient.logs = "SUCCEEDED", None, ""
    monkeypatch.setattr(job_submission, "JobSubmissionClient", FakeClient)
    # The dashboard is a fake too: nothing answers /api/version here.
    monkeypatch.setattr(job_api, "probe", lambda *args: "2.60.0")
    return FakeClient


def test_bad_config_exits_2_before_submitting(tmp_path, fake_client, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_step: 10\n")
    assert main(["submit", str(bad), "--address", DASH, "--working-dir", str(tmp_path)]) == 2
    assert "max_step: unknown field" in capsys.readouterr().err
    assert fake_client.instances == []


def test_submit_prints_the_job_and_how_to_follow_it(config, fake_client, capsys):
    argv = ["submit", str(config), "--address", DASH, "--working-dir", str(config.parent)]
    assert main([*argv, "--set", "run_name=r1", "--no-wait"]) == 0
    out = capsys.readouterr().out
    assert "submitted job r1 (run r1)" in out  # the run name is the job's submission id
    assert f"ray job logs --follow --address {DASH} r1" in out
    assert f"ray-trainer status r1 --address {DASH}" in out
    job = fake_client.instances[0].submitted
    assert job["entrypoint"] == "ray-trainer run run.yaml --set run_name=r1"
    assert job["submission_id"] == "r1" and job["metadata"] == {"ray_trainer_run": "r1"}
    assert "env_vars" not in job["runtime_env"]
    assert "[r] step" not in out  # --no-wait: no logs followed


def test_submit_passes_env_pip_runtime_env_headers_and_verify(
    tmp_path, config, fake_client, monkeypatch
):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    env_file = tmp_path / "env.yaml"
    env_file.write_text(
        "pip: [requests==2.32.0]\nenv_vars: {A: from-file, B: kept}\nexcludes: [data/]\n"
        "config: {setup_timeout_seconds: 1200}\n"
    )
    argv = ["submit", str(config), "--address", DASH, "--working-dir", str(tmp_path)]
    argv += ["--runtime-env", str(env_file), "--pip", "rich==13.0", "--pip", "tqdm"]
    argv += ["--env", "A=from-flag", "--env", "HF_HOME=/mnt/shared/hf", "--no-wait"]
    argv += ["--headers", '{"Authorization": "Bearer t0k"}', "--verify", str(ca)]
    assert main(argv) == 0
    client = fake_client.instances[0]
    assert client.address == DASH
    assert client.headers == {"Authorization": "Bearer t0k"} and client.verify == str(ca)
    assert client.submitted["runtime_env"] == {
        "working_dir": str(tmp_path.resolve()),
        "excludes": ["data/", ".git"],
        "pip": ["requests==2.32.0", "rich==13.0", "tqdm"],
        "env_vars": {"A": "from-flag", "B": "kept", "HF_HOME": "/mnt/shared/hf"},
        "config": {"setup_timeout_seconds": 1200},
    }


def test_submit_reads_headers_from_ray_job_headers(config, fake_client, monkeypatch):
    monkeypatch.setenv("RAY_JOB_HEADERS", '{"X-Token": "abc"}')
    argv = ["submit", str(config), "--address", DASH, "--no-working-dir", "--no-wait"]
    assert main([*argv, "--verify", "false"]) == 0
    client = fake_client.instances[0]
    assert client.headers == {"X-Token": "abc"} and client.verify is False
    assert main([*argv, "--headers", "[1]"]) == 2  # a flag wins, and must be an object


def test_submit_of_a_run_name_already_on_the_cluster_says_so(config, fake_client, capsys):
    # What the job API answers for a second job with a used submission id (Ray 2.x).
    fake_client.refuse = RuntimeError(
        "Request failed with status code 500: Traceback (most recent call last):\n"
        '  File "job_head.py", line 418, in submit_job\n'
        "RuntimeError: Request failed with status code 400: Traceback (most recent call last):\n"
        "ValueError: Job with submission_id r1 already exists. Please use a different "
        "submission_id.\n."
    )
    argv = ["submit", str(config), "--address", DASH, "--no-working-dir", "--set", "run_name=r1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"the cluster at {DASH} already has a job r1" in err
    assert "--set run_name=NEW" in err and f"ray job delete --address {DASH} r1" in err
    assert "Traceback" not in err


def test_submit_reports_other_refusals_in_one_line(config, fake_client, capsys):
    fake_client.refuse = RuntimeError("Request failed with status code 500: no agent.")
    argv = ["submit", str(config), "--address", DASH, "--no-working-dir"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ray-trainer: error: submitting the job at {DASH} failed")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("final", "code"), [("SUCCEEDED", 0), ("FAILED", 1), ("STOPPED", 1)])
def test_submit_wait_streams_logs_and_exits_by_final_status(
    config, fake_client, capsys, final, code
):
    fake_client.final = final
    argv = ["submit", str(config), "--address", DASH, "--working-dir", str(config.parent)]
    assert main([*argv, "--set", "run_name=r2"]) == code  # waits by default
    out = capsys.readouterr().out
    assert "[r] step 10/20\n[r] step 20/20\n" in out
    assert f"job r2 {final}" in out


def test_wait_falls_back_to_polling_when_streaming_fails():
    class NoStream(FakeClient):
        def __init__(self):
            self.polls = 0

        async def tail_job_logs(self, job_id):
            raise ConnectionError("websocket refused")
            yield  # an async generator

        def get_job_status(self, job_id):
            self.polls += 1
            return SimpleNamespace(value="RUNNING" if self.polls < 3 else "SUCCEEDED")

        def get_job_logs(self, job_id):
            return "line 1\nline 2\n"[: 7 * self.polls]

    out = _Out()
    assert submit_cmd.wait_for_job(NoStream(), "j", out, poll_s=0) == "SUCCEEDED"
    assert out.text == "line 1\nline 2\n"


class _Out:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass


# ---- status --------------------------------------------------------------------------------

STATUS = {
    "run_name": "r1",
    "global_step": 30,
    "max_steps": 60,
    "epoch": 0,
    "loss": 1.23456,
    "learning_rate": 2e-4,
    "throughput": 23416.4,
    "samples_seen": 1920,
    "events": {"on_log": 3},
    "evaluations": [
        {"step": 10, "checkpoint_path": "/c/10", "source": "EvalOnSave", "metrics": {"acc": 0.5}},
        {
            "step": 20,
            "checkpoint_path": "/c/20",
            "source": "EvalOnSave",
            "metrics": {"acc": 0.75, "n": 8},
            "seconds_after_save": 41.25,
        },
    ],
    "num_evaluations": 2,
    "evaluations_in_flight": 1,
    "callback_errors": [
        {
            "callback": "Flaky",
            "event": "on_log",
            "step": 20,
            "error": "ValueError: no",
            "traceback": "...",
        }
    ],
    "num_callback_errors": 7,
    "restarted": False,
    "ended": False,
}


def test_format_status():
    text = format_status(STATUS)
    assert text.splitlines()[0] == "run r1 (training)"
    assert "step        30/60" in text and "samples 1920" in text
    assert "loss        1.2346" in text and "lr 2.00e-04" in text and "23416 tokens/s" in text
    assert (
        "evaluations 2 (1 in flight); last at step 20 (41.2 s after its save): acc 0.7500 n 8"
        in text
    )
    assert "callback errors 7" in text
    assert "- Flaky in on_log at step 20: ValueError: no" in text


def test_format_status_before_the_first_step_and_after_the_end():
    early = format_status({"run_name": "r", "events": {}, "evaluations": [], "ended": False})
    assert "step        -" in early and "evaluations 0" in early and "callback errors 0" in early
    ended = format_status({**STATUS, "ended": True, "restarted": True, "max_steps": None})
    assert "(ended, callback actor restarted)" in ended and "step        30 " in ended
    failed = {**STATUS, "evaluations": [{"step": 5, "error": "RuntimeError: oom"}]}
    assert "last at step 5 failed: RuntimeError: oom" in format_status(failed)


def test_live_runs_and_the_no_live_run_message():
    named = [
        {"name": "ray-trainer:b", "namespace": "ray_trainer"},
        {"name": "ray-trainer:a", "namespace": "ray_trainer"},
        {"name": "ray-trainer:c", "namespace": "other"},
        {"name": "something", "namespace": "ray_trainer"},
    ]
    assert live_run_names(named) == ["a", "b"]
    assert (
        no_live_run_message("x", "10.0.0.1:6379", ["a", "b"])
        == "no live run named x on 10.0.0.1:6379; live runs: a, b"
    )
    assert no_live_run_message("x", "h:1", []).endswith("live runs: none")


def test_unreachable_or_wrong_addresses():
    with pytest.raises(ClusterUnreachable, match="no Ray cluster reachable"):
        check_reachable(f"127.0.0.1:{closed_port()}", timeout_s=2)
    with pytest.raises(ClusterUnreachable, match="neither a dashboard URL"):
        check_reachable("localhost")


def _reply(**reply) -> str:
    return f"some ray log line\n{REPLY_MARKER}{json.dumps(reply)}\n"


def test_reply_lines_round_trip_and_a_missing_reply_shows_the_output(monkeypatch, capsys):
    monkeypatch.setattr(status_cmd, "fetch_status", lambda run_name, address, timeout_s: STATUS)
    assert main(["status", "r1", "--address", "h:1", "--reply-line"]) == 0
    out = capsys.readouterr().out
    assert parse_reply(out, "here") == {"exit": 0, "status": STATUS}

    def missing(run_name, address, timeout_s):
        raise NoLiveRun(no_live_run_message(run_name, address, ["a"]))

    monkeypatch.setattr(status_cmd, "fetch_status", missing)
    assert main(["status", "r1", "--address", "h:1", "--reply-line"]) == 0  # the reply tells
    reply = parse_reply(capsys.readouterr().out, "here")
    assert reply == {"exit": 1, "error": "no live run named r1 on h:1; live runs: a"}
    with pytest.raises(DashboardError, match="sh: 1: ray-trainer: not found"):
        parse_reply("sh: 1: ray-trainer: not found\n", "the status job j")


def test_status_exit_codes(monkeypatch, capsys):
    assert main(["status", "r1", "--address", f"127.0.0.1:{closed_port()}"]) == 2
    assert "no Ray cluster reachable" in capsys.readouterr().err

    def missing(run_name, address, timeout_s):
        return {"exit": 1, "error": no_live_run_message(run_name, address, ["a"])}

    monkeypatch.setattr(status_cmd, "ask_in_subprocess", missing)
    assert main(["status", "r1", "--address", "h:1"]) == 1
    assert "no live run named r1 on h:1; live runs: a" in capsys.readouterr().err

    monkeypatch.setattr(status_cmd, "ask_in_subprocess", lambda *a: {"exit": 0, "status": STATUS})
    assert main(["status", "r1", "--address", "h:1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["global_step"] == 30
    assert main(["status", "r1", "--address", "h:1"]) == 0
    assert capsys.readouterr().out.startswith("run r1 (training)")


def test_status_over_the_dashboard_runs_a_tiny_job_on_the_head(fake_client, capsys):
    fake_client.logs = _reply(exit=0, status=STATUS)
    assert main(["status", "r1", "--address", DASH, "--headers", '{"X": "1"}']) == 0
    assert capsys.readouterr().out.startswith("run r1 (training)")
    client = fake_client.instances[0]
    assert client.address == DASH and client.headers == {"X": "1"}
    job = client.submitted
    words = shlex.split(job["entrypoint"])
    # No --address: the job's driver uses the RAY_ADDRESS that Ray's job supervisor sets.
    assert words[:3] == ["ray-trainer", "status", "r1"] and "--reply-line" in words
    assert "--address" not in words
    assert job["submission_id"].startswith("ray-trainer-status-r1-")
    assert client.deleted == [job["submission_id"]]  # the job list is left to the runs

    fake_client.logs = _reply(exit=1, error="no live run named r1 on 10.0.0.5:6379; live runs: b")
    assert main(["status", "r1", "--address", DASH]) == 1
    assert "no live run named r1 on 10.0.0.5:6379; live runs: b" in capsys.readouterr().err


def test_status_over_the_dashboard_is_bounded_by_timeout(fake_client, capsys, monkeypatch):
    fake_client.final = "RUNNING"  # the status job never ends
    monkeypatch.setattr(status_cmd.time, "sleep", lambda s: None)
    assert main(["status", "r1", "--address", DASH, "--timeout", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "did not finish within 0.2 s (--timeout)" in err
    assert fake_client.instances[0].stopped  # the stuck status job is stopped


def test_status_address_defaults(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://10.0.0.1:8265")
    assert status_cmd.resolve_address(None) == "10.0.0.1:6379"
    assert status_cmd.resolve_address("h:1") == "h:1"
    monkeypatch.delenv("RAY_ADDRESS")
    assert status_cmd.resolve_address(None) == "http://10.0.0.1:8265"  # what submit uses
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    assert status_cmd.resolve_address(None) == "auto"


def test_format_status_shows_the_worker_count_and_an_elastic_runs_changes():
    assert "workers" not in format_status(STATUS)  # a status from before sizes were kept
    sizes = [
        {"attempt": 0, "world_size": 2, "at": 1.0},
        {"attempt": 1, "world_size": 1, "at": 2.0},
        {"attempt": 2, "world_size": 1, "at": 3.0},
        {"attempt": 3, "world_size": 2, "at": 4.0},
    ]
    text = format_status({**STATUS, "worker_sizes": sizes})
    assert "  workers     2 (attempt 3); sizes 2 -> 1 -> 2" in text
    fixed = format_status({**STATUS, "worker_sizes": sizes[:1]})
    assert "  workers     2 (attempt 0)\n" in fixed + "\n" and "sizes" not in fixed


def test_format_status_shows_dpo_metrics_under_the_loss():
    dpo = {"rewards/accuracies": 0.8125, "rewards/margins": 0.25}
    lines = format_status({**STATUS, "objective_metrics": dpo}).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  loss"))
    assert lines[at + 1] == "  rewards/accuracies 0.8125   rewards/margins 0.2500"
    assert "rewards/" not in format_status(STATUS)


def test_format_status_shows_the_last_reward_of_a_grpo_run_first():
    grpo = {
        "reward": 0.625, "reward_std": 0.25, "rewards/exact/mean": 0.5,
        "rewards/exact/std": 0.5, "rewards/brevity/mean": -0.125, "kl": 0.01,
        "completions/mean_length": 7.5, "completions/clipped_ratio": 0.25,
        "rollout/logprob_diff": 0.0, "entropy": 1.5, "rollout/engines": 2.0,
    }  # fmt: skip
    lines = format_status({**STATUS, "objective_metrics": grpo}).splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  loss"))
    assert lines[at + 1] == (
        "  reward      0.6250   std 0.2500   brevity -0.1250   exact 0.5000   engines 2"
    )
    # The rest, sorted, four a line; the functions' means are not repeated.
    assert lines[at + 2] == (
        "  completions/clipped_ratio 0.2500   completions/mean_length 7.5000   entropy 1.5000"
        "   kl 0.0100"
    )
    assert lines[at + 3] == "  rewards/exact/std 0.5000   rollout/logprob_diff 0.0000"
    assert "rewards/exact/mean" not in "\n".join(lines)
