"""The `ray-trainer` command, end to end: a YAML config, a Hugging Face model, JSONL data."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from ray_trainer.demo import make_tiny_causal_lm


def _cli(args, env_extra=None, timeout=300, cwd=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "ray_trainer.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=cwd,
    )


def test_run_yaml_with_hf_model_and_jsonl_data(ray_session, tmp_path):
    hf_dir = make_tiny_causal_lm(tmp_path / "tiny-gpt2", n_layer=1, n_embd=32)
    data = tmp_path / "data.jsonl"
    lines = [
        {"text": "the cat sat on the mat"},
        {"prompt": "what did the cat do ?", "completion": "it sat"},
    ]
    # Written as editors on Windows write it, with a byte-order mark.
    data.write_bytes(
        b"\xef\xbb\xbf" + "".join(json.dumps(lines[i % 2]) + "\n" for i in range(64)).encode()
    )
    config = tmp_path / "run.yaml"
    # Relative paths, as a user types them: they mean the folder the command runs in (the
    # workers run elsewhere, in Ray's session folders).
    config.write_text(
        yaml.safe_dump(
            {
                "model": f"./{hf_dir.name}",
                "data": data.name,
                "max_length": 16,
                "batch_size": 4,
                "num_workers": 2,
                "max_steps": 4,
                "log_every_steps": 2,
                "storage_path": "runs",
                "callbacks": [{"class": "callbacks:JsonlLogger"}],
            }
        )
    )
    address = ray_session.get_runtime_context().gcs_address
    done = _cli(
        ["run", str(config), "--set", "run_name=cli-hf", "--set", "max_steps=6"],
        env_extra={"RAY_ADDRESS": address},
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    assert "RayDeprecationWarning" not in console  # none of ours (issue 12)
    assert "'CallbackActor'" not in console  # no error-level line about its arguments
    assert "step 2/6" in done.stdout and "step 6/6" in done.stdout  # progress lines
    assert "run cli-hf: 6 steps" in done.stdout  # the final summary
    logged = [json.loads(x) for x in (tmp_path / "runs" / "cli-hf" / "metrics.jsonl").open()]
    assert [r["step"] for r in logged if r["event"] == "on_log"] == [2, 4, 6]
    assert os.path.isdir(tmp_path / "runs" / "cli-hf" / "checkpoint_00000006")


def test_bad_config_exits_non_zero_before_starting_anything(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("max_step: 10\n")
    done = _cli(["run", str(config)], timeout=120)
    assert done.returncode == 2
    assert "max_step: unknown field; did you mean 'max_steps'?" in done.stderr
    missing = _cli(["run", str(tmp_path / "nope.yaml")], timeout=120)
    assert missing.returncode == 2 and "config file not found" in missing.stderr
