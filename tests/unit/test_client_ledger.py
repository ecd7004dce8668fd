"""``ray-trainer ledger RUN``: a GRPO run's per-prompt ledger read back and checked, by run
name under ``--storage-path`` or by folder; the exit code says whether it is whole."""

from __future__ import annotations

from ray_trainer._storage import locate
from ray_trainer._worker.objectives.grpo_states import PromptStates
from ray_trainer.cli import main


def _start(folder, attempt, restored, started, steps, *, last=True, prompts=4):
    """Two ranks' lines of one worker-group start: `steps` maps a 1-based step to (epoch, rows
    of rank 0, rows of rank 1); with `last`, each step completed too."""
    for rank in (0, 1):
        states = PromptStates(locate(str(folder)), rank, attempt, clock=lambda: started)
        states.start("launch", restored, [], prompts)
        for step, (epoch, *rows) in steps.items():
            states.note("queued", step, epoch, rows[rank])
            states.note("in_flight", step, epoch, rows[rank], engine=rank)
            if step == 2 and rank == 1 and attempt == 0:
                states.note("requeued", step, epoch, rows[rank], why="engine lost")
                states.note("in_flight", step, epoch, rows[rank], engine=0)
            states.note("scored", step, epoch, rows[rank])
            states.note("training", step, epoch, rows[rank])
            if last:
                states.note("trained", step, epoch, rows[rank])
        states.flush()


def test_a_whole_ledger_by_run_name_exits_0_with_a_line_per_epoch(tmp_path, capsys):
    ledger = tmp_path / "runs" / "rl" / "ledger"
    # 4 prompts, 2 a step (one per rank): epoch 0 is steps 1-2, epoch 1 starts at step 3. The
    # first start trains 1-3 and crashes; the second resumes from step 2's checkpoint.
    _start(ledger, 0, 0, 1.0, {1: (0, [0], [1]), 2: (0, [2], [3]), 3: (1, [1], [3])}, last=False)
    _start(ledger, 1, 2, 2.0, {3: (1, [1], [3])})
    code = main(["ledger", "rl", "--storage-path", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "2 worker-group start(s)" in out
    assert "epoch 0: 4 of 4 prompts trained once; dropped as stale 0, asked for again 1" in out
    assert "epoch 1: 2 of 4 prompts trained once (the epoch the run ended in)" in out
    assert "rolled back by a resume and trained again: 2" in out
    assert out.rstrip().endswith("whole: every prompt trained once per epoch")


def test_a_prompt_trained_twice_or_left_out_exits_1_naming_it(tmp_path, capsys):
    run = tmp_path / "rl"
    # Row 2 twice and row 3 never in epoch 0, which the run left (it trained step 3, epoch 1).
    _start(run / "ledger", 0, 0, 1.0, {1: (0, [0], [1]), 2: (0, [2], [2]), 3: (1, [0], [1])})
    assert main(["ledger", str(run)]) == 1
    out = capsys.readouterr().out
    assert "epoch 0: 2 of 4 prompts trained once; trained more than once: rows [2]" in out
    assert "never trained: 1" in out and "NOT whole" in out


def test_no_ledger_exits_2_saying_what_to_pass(tmp_path, capsys):
    assert main(["ledger", "nothing", "--storage-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no prompt ledger in" in err and "--storage-path" in err
