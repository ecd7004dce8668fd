"""GRPO's prompt ledger (issue 50, point 4): the order prompts are consumed in is a seeded
shuffle per epoch, and a run resumed from the ledger's checkpoint state never skips nor repeats
a prompt, even with completions in flight or trained out of order when it was saved."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from ray_trainer._objectives.grpo_ledger import LedgerError, PromptLedger


def test_each_epoch_is_a_seeded_shuffle_of_every_row():
    ledger = PromptLedger(10, seed=3)
    epochs = [[ledger.row(p) for p in range(e * 10, e * 10 + 10)] for e in range(3)]
    assert all(sorted(e) == list(range(10)) for e in epochs)
    assert epochs[0] != epochs[1]  # a new order each epoch
    again = PromptLedger(10, seed=3)
    assert [again.row(p) for p in range(30)] == [
        r for e in epochs for r in e
    ]  # a pure function of the seed
    assert [PromptLedger(10, seed=4).row(p) for p in range(10)] != epochs[0]
    assert [PromptLedger(10, shuffle=False).row(p) for p in range(12)] == [*range(10), 0, 1]


def test_steps_take_positions_across_an_epochs_end():
    ledger = PromptLedger(5, seed=0)
    steps = [ledger.take(3) for _ in range(4)]
    assert steps == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert ledger.epoch_of(5) == 1


def _session(ledger: PromptLedger, rng: random.Random, steps: int, trained: list[int]) -> None:
    """Steps of an asynchronous session: each takes 3 prompts, then trains on a random share
    of those in flight, in a random order (what is in flight at the end is lost in a crash)."""
    in_flight: list[int] = []
    for _ in range(steps):
        in_flight += ledger.take(3)
        rng.shuffle(in_flight)
        k = rng.randint(0, len(in_flight))
        done, in_flight = in_flight[:k], in_flight[k:]
        ledger.commit(done)
        trained += done


@pytest.mark.parametrize("seed", range(20))
def test_resuming_never_skips_nor_repeats_a_prompt(seed):
    rng = random.Random(seed)
    trained: list[int] = []
    ledger = PromptLedger(7, seed=seed)
    for _crash in range(3):  # save, work on, crash, resume from the save: three times
        _session(ledger, rng, rng.randint(1, 6), trained)
        state = ledger.state_dict()
        _session(ledger, rng, rng.randint(0, 3), [])  # after the save: lost in the crash
        ledger = PromptLedger.from_state(state, num_prompts=7, seed=seed)
    epochs = max(5, -(-(max(trained, default=0) + 1) // 7))
    while ledger.trained < 7 * epochs:  # finish on-policy, at an epoch's end
        taken = ledger.take(min(3, 7 * epochs - ledger.trained))
        ledger.commit(taken)
        trained += taken
    # Every position once: none skipped or repeated; so each prompt once per epoch.
    assert sorted(trained) == list(range(7 * epochs))
    rows = Counter(ledger.row(p) for p in trained)
    assert set(rows) == set(range(7)) and set(rows.values()) == {epochs}


def test_a_resume_hands_out_the_untrained_positions_first_in_order():
    ledger = PromptLedger(6, seed=0)
    taken = ledger.take(5)  # 0..4
    ledger.commit([0, 3])  # 1, 2 and 4 in flight when saved
    resumed = PromptLedger.from_state(ledger.state_dict())
    assert resumed.take(2) == [1, 2] and resumed.take(2) == [4, 5]
    assert taken == [0, 1, 2, 3, 4] and resumed.trained == 2


def test_a_ledger_refuses_what_would_repeat_a_prompt_or_misname_one():
    ledger = PromptLedger(4, seed=1)
    ledger.commit(ledger.take(2))
    with pytest.raises(LedgerError, match="position 1 was already trained on"):
        ledger.commit([1])
    with pytest.raises(LedgerError, match="position 9 was never handed out"):
        ledger.commit([9])
    state = ledger.state_dict()
    with pytest.raises(LedgerError, match="this run's data has 5; resume with the same data"):
        PromptLedger.from_state(state, num_prompts=5)
    with pytest.raises(LedgerError, match="resume with seed=1"):
        PromptLedger.from_state(state, seed=2)
    with pytest.raises(LedgerError, match="state version 9"):
        PromptLedger.from_state({**state, "version": 9})
    with pytest.raises(LedgerError, match="at least one prompt"):
        PromptLedger(0)


# ---- the per-prompt states read back (``<run>/ledger/``) -------------------------------------


def _write(folder, launch, attempt, rank, restored, started, steps, last=False, epochs=None,
           end=None, prompts=0):  # fmt: skip
    """One rank's ledger lines of a worker-group start: `steps` maps a 1-based step to its rows
    (each given to the optimizer; with `last`, each completed too), of epoch 0 unless `epochs`
    maps the step to another; `end`: `PromptStates.end`'s arguments, the run's end after them;
    `prompts`: the data's."""
    from ray_trainer._worker.objectives.grpo_states import PromptStates

    states = PromptStates(folder, rank, attempt, clock=lambda: started)
    states.start(launch, restored, [], prompts)
    for step, rows in steps.items():
        epoch = (epochs or {}).get(step, 0)
        states.note("queued", step, epoch, rows)
        states.note("in_flight", step, epoch, rows, engine=0)
        states.note("scored", step, epoch, rows)
        states.note("training", step, epoch, rows)
        if last:
            states.note("trained", step, epoch, rows)
    if end is not None:
        states.end(**end)
    states.flush()


def test_the_audit_counts_what_the_checkpoint_kept_and_the_last_start_trained(tmp_path):
    from ray_trainer._objectives.grpo_ledger import audit, read_states
    from ray_trainer._storage import locate

    folder = locate(str(tmp_path / "ledger"))
    rows = {s: [2 * (s - 1), 2 * (s - 1) + 1] for s in range(1, 7)}  # 12 prompts, 2 a step
    # Two ranks, one prompt each per step; the first start trains steps 1-4 and crashes, its
    # checkpoint at step 2; the second (a restart) resumes there and trains 3-4; a new call
    # (another launch) resumes from step 4 and finishes 5-6.
    for rank in (0, 1):
        mine = {s: r[rank::2] for s, r in rows.items()}
        _write(folder, "a", 0, rank, 0, 100.0 + rank, {s: mine[s] for s in (1, 2, 3, 4)})
        _write(folder, "a", 1, rank, 2, 200.0 + rank, {s: mine[s] for s in (3, 4)})
        _write(folder, "b", 0, rank, 4, 300.0 + rank, {s: mine[s] for s in (5, 6)}, last=True)
    found = audit(read_states(folder))
    assert found.problems(12, epochs=[0]) == []
    assert found.rolled_back == 4  # steps 3 and 4 of the first start: 2 prompts each
    # A prompt trained twice in the final lineage is named, and so is one never trained.
    _write(folder, "c", 0, 0, 6, 400.0, {7: [0]}, last=True)  # epoch 0 again: row 0 twice
    problems = audit(read_states(folder)).problems(12, epochs=[0])
    assert problems == ["epoch 0, prompt row 0: trained 2 times"]
    empty = locate(str(tmp_path / "other"))
    _write(empty, "a", 0, 0, 0, 1.0, {1: [0]}, last=True)
    missing = audit(read_states(empty)).problems(2, epochs=[0])
    assert missing == ["epoch 0, prompt row 1: trained 0 times"]


def test_a_ledger_line_before_its_start_is_refused(tmp_path):
    from ray_trainer._objectives.grpo_ledger import read_states
    from ray_trainer._storage import locate

    (tmp_path / "attempt0-rank0.jsonl").write_text('{"state":"queued","step":1,"rows":[0]}\n')
    with pytest.raises(LedgerError, match=r"attempt0-rank0\.jsonl: a record before its start"):
        read_states(locate(str(tmp_path)))
    # A whole line that is not a record (JSON of another shape, or not JSON) is named by line.
    for bad in ("7", "[1, 2]", '{"rows": [0]}', "{not json"):
        (tmp_path / "attempt0-rank0.jsonl").write_text(f"{bad}\n")
        with pytest.raises(LedgerError, match=r"attempt0-rank0\.jsonl:1: not a ledger record"):
            read_states(locate(str(tmp_path)))


def test_on_a_bucket_each_write_is_a_part_and_the_audit_reads_them_all():
    """A bucket cannot append: each flush of a worker's lines is an object of its own, and
    `read_states` reads a start's parts in order (moto's S3 server)."""
    import pyarrow.fs as pafs
    from s3_server import S3Server

    from ray_trainer._objectives.grpo_ledger import audit, read_states
    from ray_trainer._storage import locate
    from ray_trainer._worker.objectives.grpo_states import PromptStates

    server = S3Server()
    server.start()
    try:
        server.client().create_bucket(Bucket="runs")
        fs = pafs.S3FileSystem(endpoint_override=server.endpoint, access_key="testing",
                               secret_key="testing", region="us-east-1")  # fmt: skip
        folder = locate("runs/rl/ledger", fs)
        states = PromptStates(folder, 0, 0, clock=lambda: 1.0)
        states.start("launch", 0, [], prompts=2)
        for step, row in ((1, 0), (2, 1)):
            states.note("training", step, 0, [row])
            states.flush()  # one part per write
        states.note("trained", 2, 0, [1])
        states.flush()
        assert [k for k in server.keys("runs") if k.endswith(".jsonl")] == [
            f"rl/ledger/attempt0-rank0-{n:06d}.jsonl" for n in (1, 2, 3)
        ]
        # The last start counts the steps it marked trained (step 1's line was never written).
        found = audit(read_states(folder))
        assert found.trained == {(0, 1): 1}
        assert found.num_prompts == 2
    finally:
        server.stop()


def test_the_last_epoch_is_due_by_how_the_run_ended(tmp_path):
    """What each epoch's steps dealt (`Audit.due`): the data's every prompt for an epoch the run
    went past or ended at the last step of; for one it ended inside, the prompts of the
    rollouts it trained (with num_iterations=2, a rollout whose last pass was not reached
    trained none); unknown (None) when the run's last start wrote no end line, even where an
    earlier launch of the run had ended cleanly."""
    from ray_trainer._objectives.grpo_ledger import End, audit, read_states
    from ray_trainer._storage import locate

    # A trainer state already at the next epoch's start counts as the epoch before, whole.
    assert End(4, 2, 0, 2, 4, 2, 1, None).ended_in == (1, 2)
    assert End(4, 1, 2, 2, 4, 2, 1, None).ended_in == (1, 2)
    folder = locate(str(tmp_path / "ledger"))
    # 4 prompts, 2 a step: launch "a" ends cleanly at max_steps=3 (epoch 1's first step).
    end = {"step": 3, "epoch": 1, "step_in_epoch": 1, "steps_per_epoch": 2, "total_steps": 3,
           "per_step": 2, "iterations": 1, "stop_reason": None}  # fmt: skip
    _write(folder, "a", 0, 0, 0, 1.0, {1: [0, 1], 2: [2, 3], 3: [1, 3]}, last=True,
           epochs={3: 1}, end=end, prompts=4)  # fmt: skip
    found = audit(read_states(folder))
    assert found.end == End(3, 1, 1, 2, 3, 2, 1, None)
    assert [found.due(e) for e in (0, 1)] == [4, 2]
    assert found.report()[1]  # whole
    # Two passes a rollout (steps_per_epoch 4): 3 steps of epoch 1 trained one rollout, 1 none.
    found.end = End(7, 1, 3, 4, 7, 2, 2, None)
    assert found.due(1) == 2
    found.end = End(5, 1, 1, 4, 5, 2, 2, None)
    assert found.due(1) == 0 and not found.report()[1]  # 2 trained beyond what was dealt
    # Launch "b" resumes from step 3 and dies in step 4 without an end line: "a"'s end no longer
    # says how the run ended; the epoch it ended in is checked for repeats only.
    _write(folder, "b", 0, 0, 3, 2.0, {4: [0, 2]}, epochs={4: 1}, prompts=4)
    found = audit(read_states(folder))
    assert found.end is None and found.due(0) == 4 and found.due(1) is None
    lines, ok = found.report()
    assert ok and "wrote no end line" in lines[0]
    assert found.dealt[(1, 2)] == 4  # step 4 took it to the optimizer, never done


# ---- generated ledgers (issue 74, point 2) ----------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def _runs(draw):
    """A run's shape: prompts, ranks and prompts per rank a step (prompts that may not divide
    into steps), its steps (up to 3 epochs: a max_steps inside an epoch, or a stop), and a crash
    with its resume (the checkpoint at or before the crash)."""
    world, batch_size = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    prompts = draw(st.integers(world * batch_size, 23))
    per_epoch = prompts // (world * batch_size)
    total = draw(st.integers(1, 3 * per_epoch))
    stopped_at = draw(st.one_of(st.none(), st.integers(1, total)))
    ends = stopped_at or total
    crash = draw(st.one_of(st.none(), st.integers(1, ends)))
    restored = None if crash is None else draw(st.integers(0, min(crash, ends - 1)))
    return world, batch_size, prompts, total, stopped_at, crash, restored


def _written(folder, run):
    from ledger_runs import Start, write_run

    world, batch_size, prompts, total, stopped_at, crash, restored = run
    starts = (Start(),) if crash is None else (Start(0, crash), Start(restored))
    return write_run(folder, prompts, world=world, batch_size=batch_size, total=total,
                     stopped_at=stopped_at, starts=starts)  # fmt: skip


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(run=_runs(), data=st.data())
def test_a_complete_ledger_is_whole_and_one_without_a_trained_line_never(run, data):
    """Whatever the prompts, the step, the epochs and the ending (the run's last step, a
    max_steps inside an epoch, a stop, with or without a crash and its resume): the ledger
    its workers wrote is whole, every prompt of each epoch it went past trained once but its
    remainder; taken out, any `trained` line of the last start makes it not whole."""
    import tempfile
    from pathlib import Path

    from ledger_runs import delete_line

    from ray_trainer._objectives.grpo_ledger import audit, read_states
    from ray_trainer._storage import locate

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ledger"
        per_epoch = _written(folder, run)
        found = audit(read_states(locate(str(folder))))
        lines, ok = found.report()
        assert ok, lines
        past = range(found.last_epoch + (found.whole(found.last_epoch)))
        assert found.problems(run[2], past) == []
        assert all(len(found.remainder.get(e, ())) == run[2] - per_epoch * run[0] * run[1]
                   for e in past)  # fmt: skip
        last = 0 if run[5] is None else 1
        trained = [
            (rank, json.loads(line)["step"])
            for rank in range(run[0])
            for line in (folder / f"attempt{last}-rank{rank}.jsonl").read_text().splitlines()
            if json.loads(line)["state"] == "trained"
        ]
        rank, step = data.draw(st.sampled_from(trained))
        delete_line(folder, last, rank, "trained", step)
        lines, ok = audit(read_states(locate(str(folder)))).report()
        assert not ok, (rank, step, lines)


# capsys is read (emptied) in each example.
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(run=_runs(), data=st.data())
def test_a_truncated_ledger_file_is_read_never_a_raw_error(run, data, capsys):
    """Any ledger file cut at any byte (a worker killed in a write, a partial copy):
    `ray-trainer ledger` reads the lines before the cut and says a last line was cut short
    (exit 0 or 1; 2 only where the cut left no start line at all: no ledger), never another
    exception."""
    import tempfile
    from pathlib import Path

    from ray_trainer.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "rl" / "ledger"
        _written(folder, run)
        path = data.draw(st.sampled_from(sorted(folder.iterdir())))
        text = path.read_bytes()
        cut = data.draw(st.integers(0, len(text)))
        path.write_bytes(text[:cut])
        code = main(["ledger", str(folder.parent)])
        captured = capsys.readouterr()
        assert code in (0, 1, 2) and "cannot be read" not in captured.err
        if code == 2:
            assert "no prompt ledger" in captured.err and b"\n" not in text[:cut]
        elif cut and text[cut - 1 : cut] != b"\n" and b"\n" in text[:cut]:
            assert "last line cut short" in captured.out
