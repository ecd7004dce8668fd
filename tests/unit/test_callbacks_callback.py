"""TrainerCallback: hooks, runs_on, name/state_key, misspelling warnings, `with cb:`."""

import inspect
import warnings

import pytest

from callbacks import (
    ALIASES,
    EVENTS,
    CallbackManager,
    TrainerCallback,
    TrainingContext,
    global_callbacks,
)
from callbacks._hooks import runs_on_of


@pytest.fixture(autouse=True)
def _no_leftover_globals():
    yield
    assert global_callbacks() == [], "a test left a global callback registered"


@pytest.mark.parametrize("event", sorted(EVENTS))
def test_base_has_a_noop_hook_with_one_line_docstring(event):
    hook = getattr(TrainerCallback, event)
    params = list(inspect.signature(hook).parameters.values())
    assert [p.name for p in params[:2]] == ["self", "context"]
    assert params[-1].kind is inspect.Parameter.VAR_KEYWORD
    doc = hook.__doc__
    assert doc and "\n" not in doc.strip() and doc.startswith("Called")
    assert "actor" in doc and "in-process" in doc  # says in which process it runs
    assert hook(TrainerCallback(), TrainingContext()) is None


def test_base_does_not_define_aliases_as_hooks():
    for alias in ALIASES:
        assert not hasattr(TrainerCallback, alias)


def test_runs_on_default_and_valid_values():
    assert TrainerCallback.runs_on == "actor"

    class OnRank0(TrainerCallback):
        runs_on = "rank0"

        def on_log(self, context):
            pass

    assert runs_on_of(OnRank0()) == "rank0"
    assert runs_on_of(lambda ctx: None) == "actor"


def test_invalid_runs_on_fails_at_class_creation():
    with pytest.raises(ValueError, match=r"runs_on = 'everywhere'.*'actor', 'rank0', 'all_ranks'"):

        class Bad(TrainerCallback):
            runs_on = "everywhere"


def test_invalid_runs_on_on_instance_fails_at_add():
    class Cb(TrainerCallback):
        def on_log(self, context):
            pass

    cb = Cb()
    cb.runs_on = "gpu"
    with pytest.raises(ValueError, match="runs_on='gpu'"):
        CallbackManager([cb], global_callbacks=[])


def test_invalid_runs_on_on_function_fails_at_register():
    def on_save(ctx):
        pass

    on_save.runs_on = "nowhere"
    with pytest.raises(ValueError, match="runs_on='nowhere'"):
        CallbackManager(global_callbacks=[]).register("on_save", on_save)


def test_name_defaults_to_class_name_and_can_be_overridden():
    class MyCallback(TrainerCallback):
        pass

    class Named(TrainerCallback):
        @property
        def name(self):
            return "custom"

    assert MyCallback().name == "MyCallback"
    assert Named().name == "custom"


def test_state_key_defaults_to_qualname():
    class Inner(TrainerCallback):
        pass

    assert Inner().state_key == Inner.__qualname__
    assert "<locals>" in Inner().state_key


def test_misspelled_hook_warns_with_suggestion():
    with pytest.warns(UserWarning, match=r"on_sav is not a callback event.*'on_save'"):

        class Typo(TrainerCallback):
            def on_sav(self, context):
                pass

    with pytest.warns(UserWarning, match=r"on_step_ends.*'on_step_end'"):

        class Typo2(TrainerCallback):
            def on_step_ends(self, context):
                pass


def test_unrelated_on_method_and_aliases_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Fine(TrainerCallback):
            def on_checkpoint(self, context):  # an alias
                pass

            def on_something_completely_different(self):  # not close to any event
                pass

            def on_save(self, context):
                pass

    assert Fine.on_checkpoint is not None


def test_with_block_registers_globally_and_unregisters():
    class Glob(TrainerCallback):
        def on_log(self, context):
            pass

    cb = Glob()
    with cb as entered:
        assert entered is cb
        assert global_callbacks() == [cb]
        assert cb in CallbackManager().callbacks  # picked up at construction
    assert global_callbacks() == []
    assert cb not in CallbackManager().callbacks


def test_with_block_unregisters_on_exception():
    class Glob(TrainerCallback):
        def on_log(self, context):
            pass

    with pytest.raises(RuntimeError), Glob():
        assert len(global_callbacks()) == 1
        raise RuntimeError("inside")
    assert global_callbacks() == []


def test_nested_with_blocks_of_one_instance():
    class Glob(TrainerCallback):
        def on_log(self, context):
            pass

    cb = Glob()
    with cb:
        with cb:
            assert global_callbacks() == [cb, cb]
            assert CallbackManager().callbacks == [cb]  # runs once
        assert global_callbacks() == [cb]
    assert global_callbacks() == []
