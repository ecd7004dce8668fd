"""The decisions at a step boundary, the control's trip through the all-reduce, and resume's
epoch arithmetic: pure functions, no Ray, no process group."""

from __future__ import annotations

import pytest

from callbacks import TrainerControl
from ray_trainer._worker.boundary import Decision, Schedule, decide
from ray_trainer._worker.checkpoints.resume import position_after
from ray_trainer._worker.step.agreement import FLAGS, decode, encode

SCHEDULE = Schedule(total_steps=100, log_every_steps=10, eval_every_steps=25, save_every_steps=50)
NOTHING = TrainerControl()


def test_an_ordinary_step_does_nothing():
    assert decide(7, NOTHING, SCHEDULE, last_saved_step=-1) == Decision(
        log=False, evaluate=False, save=False, stop=False, abort=False
    )


def test_periodic_log_evaluate_and_save():
    assert decide(10, NOTHING, SCHEDULE, -1).log
    d = decide(50, NOTHING, SCHEDULE, -1)
    assert (d.log, d.evaluate, d.save, d.stop) == (True, True, True, False)
    assert decide(25, NOTHING, SCHEDULE, -1).evaluate and not decide(25, NOTHING, SCHEDULE, -1).save


def test_requests_act_off_schedule():
    control = TrainerControl(should_log=True, should_evaluate=True, should_save=True)
    d = decide(7, control, SCHEDULE, -1)
    assert (d.log, d.evaluate, d.save, d.stop) == (True, True, True, False)


def test_no_schedule_means_no_periodic_evaluation_or_save():
    schedule = Schedule(total_steps=100, log_every_steps=10)
    d = decide(50, NOTHING, schedule, -1)
    assert (d.evaluate, d.save) == (False, False)


def test_the_last_step_logs_saves_and_stops():
    d = decide(100, NOTHING, SCHEDULE, -1)
    assert (d.log, d.save, d.stop, d.abort) == (True, True, True, False)
    no_end_save = Schedule(total_steps=100, log_every_steps=10, save_at_end=False)
    assert not decide(100, NOTHING, no_end_save, -1).save
    assert decide(100, NOTHING, no_end_save, -1).stop


def test_a_stop_saves_a_final_checkpoint_even_without_save_at_end():
    no_end_save = Schedule(total_steps=100, log_every_steps=10, save_at_end=False)
    d = decide(7, TrainerControl(should_training_stop=True), no_end_save, -1)
    assert (d.save, d.stop, d.abort) == (True, True, False)


def test_an_abort_stops_and_saves_nothing():
    abort = TrainerControl(should_abort=True, should_save=True)
    for step in (7, 50, 100):  # off schedule, on the save schedule, the last step
        d = decide(step, abort, SCHEDULE, -1)
        assert (d.save, d.stop, d.abort) == (False, True, True), step
    # DivergenceDetector asks for both: still no save.
    both = TrainerControl(should_training_stop=True, should_abort=True)
    assert not decide(7, both, SCHEDULE, -1).save


def test_never_two_checkpoints_of_one_step():
    # A run continued at its last step has that step's checkpoint already.
    assert not decide(100, NOTHING, SCHEDULE, last_saved_step=100).save
    assert not decide(50, TrainerControl(should_save=True), SCHEDULE, 50).save


def test_control_survives_the_all_reduce_encoding():
    for flag in FLAGS:
        control = TrainerControl(**{flag: True})
        assert decode(encode(control)) == control
    # Summed over 3 ranks, a flag set on any rank is set on all.
    ranks = [TrainerControl(should_save=True), NOTHING, TrainerControl(should_abort=True)]
    summed = [sum(v) for v in zip(*(encode(c) for c in ranks), strict=True)]
    agreed = decode(summed)
    assert agreed.should_save and agreed.should_abort and agreed.stops
    assert not agreed.should_training_stop and not agreed.should_log
    assert decode(encode(NOTHING)) == NOTHING


def test_merge_keeps_abort_and_the_first_reason():
    control = TrainerControl()
    control.merge(TrainerControl(should_training_stop=True), "EarlyStopping")
    control.merge(TrainerControl(should_abort=True, stop_reason="diverged"), "Divergence")
    assert control.should_abort and control.should_training_stop
    assert control.stop_reason == "EarlyStopping"  # the first reason stays
    later = TrainerControl(should_abort=True, stop_reason="DivergenceDetector(abort): nan")
    later.merge(TrainerControl(should_training_stop=True, stop_reason="plain stop"), "Other")
    assert later.should_abort  # a plain stop in the same merge does not lose the abort
    assert later.stop_reason == "DivergenceDetector(abort): nan"
    assert TrainerControl(should_abort=True).any and TrainerControl(should_abort=True).stops


@pytest.mark.parametrize(
    ("epoch", "step_in_epoch", "expected"),
    [
        (0, 3, (0, 3)),  # mid-epoch: resume where it was
        (0, 4, (1, 0)),  # saved at the epoch's last step: the next epoch, no empty epoch
        (2, 0, (2, 0)),
    ],
)
def test_resume_position_at_and_inside_an_epoch(epoch, step_in_epoch, expected):
    assert position_after(epoch, step_in_epoch, steps_per_epoch=4) == expected
