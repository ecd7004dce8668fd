"""``TrainerControl``: the flags through which a callback asks the training loop to act.

Created in whichever process runs the hook; merged controls travel from the callback actor to
rank 0 and from any rank to all ranks (the runner agrees them at a step boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

__all__ = ["TrainerControl"]


@dataclass(eq=False)
class TrainerControl:
    """Requests from callbacks to the training loop.

    A hook requests by setting flags on ``context.control`` or by returning a
    ``TrainerControl``. The runner ORs the requests of every callback (``merge``) and applies
    them on every rank at the same step boundary, read one step late: the boundary of the next
    step for requests made during a step before its last backward (``on_step_begin`` to
    ``on_before_backward``), the one after for requests made later (``on_step_end``,
    ``on_log``, ...); at the last step, at once.

    The same object travels end to end: from a hook to the manager, from the callback actor to
    rank 0 (pickled with its fields), and into the step's all-reduce (encoded as numbers beside
    it, in ``ray_trainer/_worker/step/agreement.py``).

    Args:
        should_training_stop: stop at that boundary (a final checkpoint is saved).
        should_save: save a checkpoint at that boundary.
        should_evaluate: evaluate at that boundary.
        should_log: log at that boundary.
        should_abort: stop at that boundary without saving anything (the checkpoints already
            written stay); what ``DivergenceDetector(action="abort")`` asks for. Needs no
            ``should_training_stop`` beside it.
        stop_reason: why the stop (or abort) was requested; set by ``merge`` to the requesting
            callback's name when the request does not carry one.

    Example:
        >>> class StopAt100(TrainerCallback):
        ...     def on_step_begin(self, context):  # global_step counts the finished steps
        ...         if context.global_step + 1 >= 99:  # asked during step 99: acts at step 100
        ...             return TrainerControl(should_training_stop=True, stop_reason="step 100")
    """

    should_training_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False
    should_abort: bool = False
    stop_reason: str | None = None

    @property
    def any(self) -> bool:
        """True when at least one flag is set."""
        return bool(
            self.should_training_stop
            or self.should_save
            or self.should_evaluate
            or self.should_log
            or self.should_abort
        )

    @property
    def stops(self) -> bool:
        """True when this control ends training (a stop or an abort)."""
        return bool(self.should_training_stop or self.should_abort)

    def merge(self, other: TrainerControl, source_name: str | None = None) -> TrainerControl:
        """OR the flags of ``other`` into this control and return ``self``.

        ``should_abort`` is kept whenever either side has it. The first stop reason is kept:
        when ``other`` asks to stop or abort and this control has no reason yet, it becomes
        ``other.stop_reason``, or ``source_name`` (the requesting callback's name).
        """
        if other.should_training_stop or other.should_abort:
            if not self.stops:
                self.stop_reason = other.stop_reason or source_name
            if other.should_training_stop:
                self.should_training_stop = True
            if other.should_abort:
                self.should_abort = True
        if other.should_save:
            self.should_save = True
        if other.should_evaluate:
            self.should_evaluate = True
        if other.should_log:
            self.should_log = True
        return self

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrainerControl):
            return NotImplemented
        return _astuple(self) == _astuple(other)

    __hash__ = None  # type: ignore[assignment]  # mutable


def _astuple(control: TrainerControl) -> tuple:
    return tuple(getattr(control, f.name) for f in fields(TrainerControl))


class _NoControl(TrainerControl):
    """The shared, read-only 'nothing requested' control returned when no hook ran."""

    def __init__(self) -> None:
        for f in fields(TrainerControl):
            object.__setattr__(self, f.name, f.default)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(
            "this TrainerControl is shared and read-only (nothing was requested); "
            "create your own TrainerControl() and merge() it instead"
        )

    def __repr__(self) -> str:
        return "TrainerControl(<nothing requested>)"

    def __reduce__(self):
        return (_no_control, ())


def _no_control() -> TrainerControl:
    return NO_CONTROL


#: Returned by ``fire`` when no hook requested anything; costs no allocation.
NO_CONTROL: TrainerControl = _NoControl()
