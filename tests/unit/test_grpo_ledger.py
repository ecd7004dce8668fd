"""GRPO's prompt ledger (issue 50, point 4): the order prompts are consumed in is a seeded
shuffle per epoch, and a run resumed from the ledger's checkpoint state never skips nor repeats
a prompt, even with completions in flight or trained out of order when it was saved."""

from __future__ import annotations

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


def _write(folder, launch, attempt, rank, restored, started, steps, last=False):
    """One rank's ledger lines of a worker-group start: `steps` maps a 1-based step to its rows
    (each given to the optimizer; with `last`, each completed too)."""
    from ray_trainer._worker.objectives.grpo_states import PromptStates

    states = PromptStates(folder, rank, attempt, clock=lambda: started)
    states.start(launch, restored, [])
    for step, rows in steps.items():
        states.note("queued", step, 0, rows)
        states.note("in_flight", step, 0, rows, engine=0)
        states.note("scored", step, 0, rows)
        states.note("training", step, 0, rows)
        if last:
            states.note("trained", step, 0, rows)
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
