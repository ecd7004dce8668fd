"""`compile=True` on CPU workers (issue 15): torch.compile with inductor's C++ backend, 2 gloo
workers, real Ray; the loss falls, and the logs carry honest throughput and MFU."""

from __future__ import annotations

from rt_support import LogMetricsRecorder, read_records


def test_a_compiled_demo_trains_on_two_cpu_workers(ray_session, tmp_path):
    from ray_trainer import run_training

    folder = str(tmp_path / "records")
    result = run_training(
        compile=True,
        num_workers=2,
        max_steps=24,
        batch_size=32,
        learning_rate=2e-3,
        warmup_steps=0,
        log_every_steps=8,
        peak_flops=1e12,  # no table entry for a CPU: MFU only when the peak is given
        demo={"n_train": 4000, "n_val": 200},
        storage_path=str(tmp_path / "storage"),
        run_name="compiled",
        callbacks=[LogMetricsRecorder(folder)],
    )
    assert result.global_step == 24
    logs = sorted(read_records(folder, "logs"), key=lambda r: r["step"])
    assert [r["step"] for r in logs] == [8, 16, 24]
    assert logs[-1]["loss"] < logs[0]["loss"]
    for r in logs:
        # The demo pads every example to one length: its padding is not counted as tokens.
        assert 0.1 < r["padding_share"] < 0.5
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1
