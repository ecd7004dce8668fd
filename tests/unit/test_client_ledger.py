"""``ray-trainer ledger RUN``: a GRPO run's per-prompt ledger read back and checked, by run
name under ``--storage-path`` or by folder; the exit code says whether it is whole. The epoch
a run ended in is checked too when it ended cleanly (its last step, a ``max_steps`` inside an
epoch, a stop): what its steps dealt, each trained once; a run without an end line (failed or
still running) is said to leave it unchecked (issue 70, part 6)."""

from __future__ import annotations

import json

import pytest

from ray_trainer._storage import locate
from ray_trainer._worker.objectives.grpo_states import PromptStates
from ray_trainer.cli import main


def _start(folder, attempt, restored, started, steps, *, last=True, prompts=4, end=None):
    """Two ranks' lines of one worker-group start: `steps` maps a 1-based step to (epoch, rows
    of rank 0, rows of rank 1); with `last`, each step completed too; with `end` (the keyword
    arguments of `PromptStates.end`, 2 prompts a step, one pass), the run's end after them."""
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
        if end is not None:
            states.end(**{"per_step": 2, "iterations": 1, "stop_reason": None, **end})
        states.flush()


def _delete(folder, rank, state, step):
    """A ledger file with one line taken out: rank `rank`'s `state` line of step `step`."""
    path = folder / f"attempt0-rank{rank}.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    which = [(json.loads(ln)["state"], json.loads(ln)["step"]) for ln in lines]
    keep = [ln for ln, key in zip(lines, which, strict=True) if key != (state, step)]
    assert len(keep) == len(lines) - 1
    path.write_text("".join(keep))


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
    # No end line (the run crashed, or runs still): its last epoch is checked for repeats only.
    assert "epoch 1: 2 of 4 prompts trained once (not checked for prompts left out: see" in out
    assert "wrote no end line: it failed, was killed or is still running" in out
    assert "rolled back by a resume and trained again: 2" in out
    assert out.rstrip().endswith(
        "whole: every prompt trained once per epoch (the last epoch for repeats only: the run "
        "did not end)"
    )


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


def test_a_default_run_ended_at_its_datas_last_step_checks_that_epoch(tmp_path, capsys):
    """num_epochs=1 and no max_steps: the run ends at its data's last step, and that epoch,
    its only one, is checked like any other: a `trained` line taken from the last step (the
    run's final step, written at its end) fails the check, naming the row and the step."""
    run = tmp_path / "rl"
    end = {"step": 2, "epoch": 0, "step_in_epoch": 2, "steps_per_epoch": 2, "total_steps": 2}
    _start(run / "ledger", 0, 0, 1.0, {1: (0, [0], [1]), 2: (0, [2], [3])}, end=end)
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert "the run ended after step 2 of 2, the last step of epoch 0: every epoch checked" in out
    assert "epoch 0: 4 of the 4 prompts its steps dealt trained once (the run's last epoch)" in out
    _delete(run / "ledger", 1, "trained", 2)
    assert main(["ledger", str(run)]) == 1
    out = capsys.readouterr().out
    assert "epoch 0: 3 of the 4 prompts its steps dealt trained once" in out
    assert "never trained: 1 (row 3 of step 2)" in out and "NOT whole" in out


@pytest.mark.parametrize(
    "total, stop_reason, heading",
    [
        (3, None, "the run ended after step 3 of 3 (its max_steps), step 1 of epoch 1's 2"),
        (8, "SIGINT to the driver", "the run stopped early after step 3 of 8 (SIGINT to the "),
    ],
)
def test_a_run_ended_inside_an_epoch_checks_what_its_steps_dealt(
    tmp_path, capsys, total, stop_reason, heading
):
    """max_steps=3 of 2 steps an epoch, or a stop there (a signal's: a clean end at a step
    boundary, its steps known): epoch 1's first step dealt 2 of its 4 prompts; those two are due
    (the others no step dealt are not lost), and a `trained` line taken from the last step fails
    the check; so does a step whose lines are all gone from a rank (its count short)."""
    run = tmp_path / "rl"
    end = {"step": 3, "epoch": 1, "step_in_epoch": 1, "steps_per_epoch": 2,
           "total_steps": total, "stop_reason": stop_reason}  # fmt: skip
    steps = {1: (0, [0], [1]), 2: (0, [2], [3]), 3: (1, [2], [0])}
    _start(run / "ledger", 0, 0, 1.0, steps, end=end)
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert heading in out
    assert "epoch 0: 4 of 4 prompts trained once;" in out
    assert "epoch 1: 2 of the 2 prompts its steps dealt trained once (the run's last epoch)" in out
    _delete(run / "ledger", 0, "trained", 3)
    assert main(["ledger", str(run)]) == 1
    assert "never trained: 1 (row 2 of step 3)" in capsys.readouterr().out
    # Every line of the last step gone from rank 0: the count of what its steps dealt is short.
    other = tmp_path / "other"
    _start(other / "ledger", 0, 0, 1.0, steps, end=end)
    _delete(other / "ledger", 0, "trained", 3)
    _delete(other / "ledger", 0, "training", 3)
    assert main(["ledger", str(other)]) == 1
    out = capsys.readouterr().out
    assert "epoch 1: 1 of the 2 prompts its steps dealt trained once" in out
    assert "never trained: 1;" in out


# ---- prompts that do not divide into steps (issue 74, point 2) ---------------------------------


def test_an_epochs_remainder_is_recorded_dropped_and_the_run_is_whole(tmp_path, capsys):
    """25 prompts at 4 a step (2 ranks of 2): 6 steps an epoch, the loader drops one prompt of
    each epoch's order; rank 0 records it (`remainder`), and `ray-trainer ledger` counts it out
    of what is due: the run is whole, naming the row it dropped each epoch."""
    from ledger_runs import loaders, write_run

    from ray_trainer._objectives.grpo_ledger import audit, read_states

    run = tmp_path / "rl"
    assert write_run(run / "ledger", 25) == 6
    code = main(["ledger", str(run)])
    out = capsys.readouterr().out
    assert code == 0, out
    loader = loaders(25, 2, 2)[0]
    for epoch in (0, 1):
        dealt = {
            r for step in loaders(25, 2, 2) for b in step.steps(epoch) for m in b
            for r in m.batch["prompt_index"].tolist()
        }  # fmt: skip
        (left,) = loader.left_out(epoch)  # the one row no step deals
        assert dealt == set(range(25)) - {left}
        assert f"epoch {epoch}: 24 of " in out
        assert f"dropped (epoch remainder) 1: rows [{left}];" in out
    assert "the run ended after step 12 of 12, the last step of epoch 1" in out
    assert "whole: every prompt trained once per epoch" in out
    found = audit(read_states(locate(str(run / "ledger"))))
    assert found.problems(25, [0, 1]) == []


def test_a_remainder_run_with_a_fault_still_fails(tmp_path, capsys):
    """The same data, a crash after step 8 with the checkpoint at step 5 and the restart
    resuming there (it records the remainders again): whole; then a `trained` line taken from
    the last start fails it, naming the row and the step; and a ledger whose remainder line is
    gone (an older writer) counts the dropped prompt as never trained."""
    from ledger_runs import Start, delete_line, write_run

    run = tmp_path / "rl"
    write_run(run / "ledger", 25, starts=(Start(0, crashed_after=8), Start(5)))
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert "2 worker-group start(s)" in out
    assert "rolled back by a resume and trained again: 12" in out
    delete_line(run / "ledger", 1, 1, "trained", 9)
    assert main(["ledger", str(run)]) == 1
    out = capsys.readouterr().out
    assert "epoch 1: 22 of the 24 prompts its steps dealt trained once" in out
    assert "never trained: 2 (row" in out and "of step 9" in out and "NOT whole" in out
    older = tmp_path / "older"
    write_run(older / "ledger", 25)
    delete_line(older / "ledger", 0, 0, "remainder", 1)
    assert main(["ledger", str(older)]) == 1
    out = capsys.readouterr().out
    assert "epoch 0: 24 of 25 prompts trained once; never trained: 1;" in out


def test_a_remainder_run_ended_inside_an_epoch_checks_its_steps_only(tmp_path, capsys):
    """max_steps=8 (epoch 1's second step) and a stop after step 9 of 12: epoch 0 whole but for
    its remainder; epoch 1's due are its steps' prompts, its remainder not named (no step of it
    would deal it before the epoch's end anyway)."""
    from ledger_runs import write_run

    for name, kwargs, heading in (
        ("max", {"total": 8}, "the run ended after step 8 of 8 (its max_steps)"),
        ("stop", {"stopped_at": 9}, "the run stopped early after step 9 of 12 (a stop request)"),
    ):
        run = tmp_path / name
        write_run(run / "ledger", 25, **kwargs)
        assert main(["ledger", str(run)]) == 0
        out = capsys.readouterr().out
        assert heading in out
        assert "epoch 0: 24 of 24 prompts trained once; dropped (epoch remainder) 1" in out
        due = 4 * ((kwargs.get("total") or kwargs.get("stopped_at")) - 6)
        assert f"epoch 1: {due} of the {due} prompts its steps dealt trained once (the run" in out
        assert out.count("dropped (epoch remainder)") == 1


def test_a_line_cut_short_by_a_killed_worker_is_not_read_and_said(tmp_path, capsys):
    """A worker killed while appending leaves its file's last line without its newline: the
    line is not read (as if never written), the report says so, and the rest of the ledger is
    checked as usual: the crashed start's steps after its checkpoint were rolled back anyway."""
    from ledger_runs import Start, write_run

    run = tmp_path / "rl"
    write_run(run / "ledger", 25, starts=(Start(0, crashed_after=8), Start(5)))
    path = run / "ledger" / "attempt0-rank1.jsonl"
    text = path.read_text()
    path.write_text(text[: len(text) - 20])  # the last line's end, and its newline, never written
    assert main(["ledger", str(run)]) == 0
    out = capsys.readouterr().out
    assert "last line cut short (a worker killed while writing it) in 1 file(s)" in out
    assert "whole: every prompt trained once per epoch" in out
