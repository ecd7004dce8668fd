"""TrainerControl: flags, merge, and the shared read-only 'nothing requested' control."""

import pickle

import pytest

from callbacks import CallbackManager, TrainerControl
from callbacks._control import NO_CONTROL


def test_defaults_are_false():
    control = TrainerControl()
    assert not control.should_training_stop
    assert not control.should_save
    assert not control.should_evaluate
    assert not control.should_log
    assert control.stop_reason is None
    assert control.any is False


@pytest.mark.parametrize(
    "flag", ["should_training_stop", "should_save", "should_evaluate", "should_log"]
)
def test_any_is_true_for_each_flag(flag):
    assert TrainerControl(**{flag: True}).any is True


def test_merge_ors_flags_and_returns_self():
    control = TrainerControl(should_save=True)
    out = control.merge(TrainerControl(should_evaluate=True), "Eval")
    assert out is control
    assert control.should_save and control.should_evaluate
    assert not control.should_training_stop
    assert control.stop_reason is None


def test_merge_records_source_name_when_stop_newly_requested():
    control = TrainerControl()
    control.merge(TrainerControl(should_training_stop=True), "EarlyStop")
    assert control.should_training_stop and control.stop_reason == "EarlyStop"


def test_merge_prefers_the_requests_own_reason():
    control = TrainerControl()
    control.merge(TrainerControl(should_training_stop=True, stop_reason="diverged"), "Div")
    assert control.stop_reason == "diverged"


def test_merge_keeps_the_first_stop_reason():
    control = TrainerControl()
    control.merge(TrainerControl(should_training_stop=True), "First")
    control.merge(TrainerControl(should_training_stop=True, stop_reason="later"), "Second")
    assert control.stop_reason == "First"


def test_merge_never_clears_flags():
    control = TrainerControl(should_log=True)
    control.merge(TrainerControl(), "Nothing")
    assert control.should_log


def test_equality_and_pickle():
    control = TrainerControl(should_save=True)
    assert control == TrainerControl(should_save=True)
    assert control != TrainerControl()
    assert pickle.loads(pickle.dumps(control)) == control


def test_no_control_is_read_only_and_shared():
    manager = CallbackManager(global_callbacks=[])
    result = manager.fire("on_save")
    assert result is NO_CONTROL
    assert result == TrainerControl()  # compares equal to an empty control
    with pytest.raises(AttributeError, match="read-only"):
        result.should_training_stop = True
    with pytest.raises(AttributeError):
        result.merge(TrainerControl(should_save=True), "x")
    assert not NO_CONTROL.should_save
    assert pickle.loads(pickle.dumps(NO_CONTROL)) is NO_CONTROL


def test_control_made_without_init_reads_the_defaults():
    # make_snapshot builds controls with object.__new__ (no __init__) to save time per hook
    control = object.__new__(TrainerControl)
    assert control == TrainerControl() and not control.any and control.stop_reason is None
    control.should_save = True
    assert TrainerControl().should_save is False
    assert pickle.loads(pickle.dumps(control)).should_save is True
