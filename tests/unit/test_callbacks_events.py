"""Event names, aliases and name resolution."""

import pytest

from callbacks import ALIASES, EVENTS
from callbacks._events import LOW_VALUE_EVENTS, NEVER_DROPPED_EVENTS, resolve_event

CONTRACT_EVENTS = {
    "on_init_end",
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_before_forward",
    "on_after_forward",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_after_optimizer_step",
    "on_log",
    "on_evaluate",
    "on_save",
    "on_load_checkpoint",
    "on_step_end",
    "on_epoch_end",
    "on_train_end",
    "on_exception",
}


def test_events_are_exactly_the_contract():
    assert isinstance(EVENTS, frozenset)
    assert EVENTS == CONTRACT_EVENTS


def test_aliases_map_to_events():
    assert ALIASES == {
        "on_pre_optimizer_step": "on_before_optimizer_step",
        "on_optimizer_step": "on_after_optimizer_step",
        "on_checkpoint": "on_save",
        "on_validation_loss": "on_evaluate",
    }
    assert set(ALIASES.values()) <= EVENTS
    assert not set(ALIASES) & EVENTS


def test_forwarding_policy_sets():
    assert {
        "on_log",
        "on_before_forward",
        "on_after_forward",
        "on_before_backward",
        "on_after_backward",
        "on_step_begin",
        "on_step_end",
    } == LOW_VALUE_EVENTS
    assert {
        "on_save",
        "on_evaluate",
        "on_train_begin",
        "on_train_end",
        "on_exception",
        "on_load_checkpoint",
    } == NEVER_DROPPED_EVENTS
    assert not LOW_VALUE_EVENTS & NEVER_DROPPED_EVENTS
    assert LOW_VALUE_EVENTS | NEVER_DROPPED_EVENTS <= EVENTS


@pytest.mark.parametrize("name", sorted(CONTRACT_EVENTS))
def test_resolve_event_identity(name):
    assert resolve_event(name) == name


@pytest.mark.parametrize(("alias", "event"), sorted(ALIASES.items()))
def test_resolve_event_alias(alias, event):
    assert resolve_event(alias) == event


def test_resolve_event_unknown_has_did_you_mean_and_lists_events():
    with pytest.raises(ValueError) as info:
        resolve_event("on_sav")
    message = str(info.value)
    assert "did you mean 'on_save'?" in message
    assert "on_train_end" in message and "on_before_forward" in message
    assert "on_checkpoint" in message  # aliases listed too


def test_resolve_event_unknown_without_close_match():
    with pytest.raises(ValueError, match="unknown event 'zzz'") as info:
        resolve_event("zzz")
    assert "did you mean" not in str(info.value)


def test_resolve_event_rejects_non_strings():
    with pytest.raises(ValueError, match="unknown event"):
        resolve_event(None)
