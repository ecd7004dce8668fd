"""Losing a node mid-run, on a real local cluster (a head and more raylets).

Killing a node's raylet takes down the workers on it. Two runs lose the node 127.0.0.3 at once,
each held at a known step: the one the remaining nodes have room for is restarted on the head by
Ray Train and completes from its latest checkpoint; the other fails with an error that says so,
never a hang. At the same time a third run, with a worker on 127.0.0.4, sees that node drained
for preemption (what a spot reclaim looks like to Ray): it saves at its next step boundary; at
the drain deadline Ray Train restarts the workers and the run resumes from there. Custom
resources keep each run on its own pair of nodes. The three runs, and `test_elastic.py`'s run,
share one cluster and their start-up: the session fixture `lost_nodes`
(`tests/support/lost_nodes.py`) trains them all at once.
"""

from __future__ import annotations

from lost_nodes import rank0_steps


def test_lost_node_restarts_on_the_remaining_node(lost_nodes):
    assert lost_nodes["node_loss"]["outcomes"]["spread"][0] == {"global_step": 40, "attempts": 2}


def test_lost_node_without_room_fails_clearly(lost_nodes):
    outcome = lost_nodes["node_loss"]["outcomes"]["no-room"][0]
    assert "error" in outcome, outcome
    assert "can no longer place the workers" in outcome["error"]
    assert "room for 1 such worker(s)" in outcome["error"]


def test_preemption_notice_saves_then_the_run_resumes_from_that_checkpoint(lost_nodes):
    runs = lost_nodes["node_loss"]
    tmp_path, at = runs["tmp_path"], runs["at"]
    outcome, out = runs["outcomes"]["preempted"]
    # One unscheduled save after the notice, then the restart at the deadline resumed from it.
    saved = sorted(
        int(p.name.split("_")[1]) for p in (tmp_path / "preempted").glob("checkpoint_0*")
    )
    assert len(saved) == 2 and saved[-1] == 150, saved
    assert at <= saved[0] < 100
    assert outcome == {"global_step": 150, "attempts": 2}, out[-3000:]
    assert min(rank0_steps(tmp_path / "records", 1)) == saved[0] + 1
