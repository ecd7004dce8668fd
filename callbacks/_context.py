"""``TrainingContext``: the snapshot of the training state that every hook receives.

Built in the training process (every rank) for in-process callbacks, and rebuilt on the callback
actor from ``to_wire()`` for actor-side ones (there the live objects are ``None``).
"""

from __future__ import annotations

from typing import Any

from callbacks._control import TrainerControl

__all__ = ["TrainingContext"]

# Fields and their defaults. Mutable defaults are created per context in __init__.
_SCALAR_DEFAULTS: dict[str, Any] = {
    "event": None,
    "global_step": 0,
    "epoch": 0,
    "samples_seen": 0,
    "tokens_seen": 0,
    "loss": None,
    "learning_rate": None,
    "grad_norm": None,
    "elapsed_time": None,
    "throughput": None,
    "cuda_mem_allocated": None,
    "checkpoint_path": None,
    "rank": 0,
    "world_size": 1,
    "local_rank": 0,
    "is_world_process_zero": True,
    "is_local_process_zero": True,
    "run_name": None,
    "attempt": 0,
    "max_steps": None,
    "exception": None,
    "stop_reason": None,
}
#: Dicts that each snapshot gets its own shallow copy of.
DICT_FIELDS: tuple[str, ...] = ("batch_metrics", "val_metrics", "args")
#: Live objects of the training process: shared by reference, never shipped to the actor.
LIVE_FIELDS: tuple[str, ...] = ("model", "optimizer", "lr_scheduler", "batch", "outputs")
_NOT_WIRED = frozenset((*LIVE_FIELDS, "control", "user_state"))
_FIELDS = frozenset((*_SCALAR_DEFAULTS, *DICT_FIELDS, *LIVE_FIELDS, "control", "user_state"))
_PLAIN_TYPES = (int, float, str, bool, type(None), dict, list, tuple)


class TrainingContext:
    """The state of training at one event, as a hook sees it.

    Every callback gets its own snapshot: what one hook changes on it (attributes, or the
    ``batch_metrics``/``val_metrics``/``args`` dicts) is seen neither by the next callback nor by
    the training loop. ``model``, ``optimizer``, ``lr_scheduler``, ``batch`` and ``outputs`` are
    shared references (the live objects; ``None`` on the callback actor). ``user_state`` is the
    one deliberately shared dict: it persists across events. ``control`` is a fresh
    ``TrainerControl`` per snapshot: set flags on it to make requests.

    Keyword arguments set any field; unknown keywords become attributes too (``fire`` kwargs
    land here).

    Example:
        >>> ctx = TrainingContext(global_step=10, loss=2.5, batch_metrics={"acc": 0.5})
        >>> ctx.loss, ctx.epoch
        (2.5, 0)
    """

    # Declared for readers and type checkers; the values live in the instance __dict__.
    event: str | None
    global_step: int
    epoch: int
    samples_seen: int
    tokens_seen: int
    loss: float | None
    learning_rate: float | None
    grad_norm: float | None
    elapsed_time: float | None
    throughput: float | None
    cuda_mem_allocated: int | None
    batch_metrics: dict[str, Any]
    val_metrics: dict[str, Any]
    checkpoint_path: str | None
    args: dict[str, Any]
    rank: int
    world_size: int
    local_rank: int
    is_world_process_zero: bool
    is_local_process_zero: bool
    run_name: str | None
    attempt: int
    max_steps: int | None
    control: TrainerControl
    user_state: dict[str, Any]
    model: Any
    optimizer: Any
    lr_scheduler: Any
    batch: Any
    outputs: Any
    exception: BaseException | str | None
    stop_reason: str | None

    def __init__(self, **fields: Any) -> None:
        d = _SCALAR_DEFAULTS.copy()
        d["batch_metrics"] = {}
        d["val_metrics"] = {}
        d["args"] = {}
        d["user_state"] = {}
        d["model"] = d["optimizer"] = d["lr_scheduler"] = d["batch"] = d["outputs"] = None
        d["control"] = TrainerControl()
        if fields:
            d.update(fields)
        self.__dict__.update(d)

    def to_wire(self) -> dict[str, Any]:
        """The plain, picklable fields as a dict, for shipping rank-0 events to the actor.

        Drops the live objects, ``control`` and ``user_state``; ``exception`` becomes its repr;
        extra attributes are kept only when they are plain values (numbers, strings, containers).
        The dict fields are shallow-copied, so later changes by the loop do not leak in.
        """
        src = self.__dict__
        d = src.copy()
        for name in _NOT_WIRED:
            d.pop(name, None)
        for name in DICT_FIELDS:
            value = d.get(name)
            if value:
                d[name] = value.copy()
        exc = d.get("exception")
        if exc is not None and not isinstance(exc, str):
            d["exception"] = repr(exc)
        if len(src) != len(_FIELDS):  # extra attributes: keep plain values only
            for name in [k for k in d if k not in _FIELDS]:
                if not isinstance(d[name], _PLAIN_TYPES):
                    del d[name]
        return d

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> TrainingContext:
        """Rebuild a context from ``to_wire()`` output; live objects are ``None``."""
        return cls(**wire)

    def __repr__(self) -> str:
        d = self.__dict__
        shown = ", ".join(
            f"{k}={d[k]!r}"
            for k in ("event", "global_step", "epoch", "loss", "rank")
            if d.get(k) is not None
        )
        return f"TrainingContext({shown})"


def snapshot_template(
    context: TrainingContext | None, event: str, kwargs: dict[str, Any], user_state: dict
) -> dict[str, Any]:
    """The field dict every snapshot of one ``fire`` starts from (cheap: no deepcopy)."""
    d = (context if context is not None else _EMPTY).__dict__.copy()
    if kwargs:
        d.update(kwargs)
    d["event"] = event
    d["user_state"] = user_state
    return d


def detach_template(template: dict[str, Any]) -> None:
    """Copy the dict fields of a template in place, so later changes by the caller don't leak."""
    for name in DICT_FIELDS:
        value = template.get(name)
        if value:
            template[name] = value.copy()


def make_snapshot(template: dict[str, Any]) -> TrainingContext:
    """One callback's own snapshot: a ``__dict__`` clone, its own dicts and a fresh control."""
    d = template.copy()
    value = d.get("batch_metrics")
    d["batch_metrics"] = value.copy() if value else {}
    value = d.get("val_metrics")
    d["val_metrics"] = value.copy() if value else {}
    value = d.get("args")
    d["args"] = value.copy() if value else {}
    # A TrainerControl without __init__: its fields read the class-level dataclass defaults
    # until a hook sets one (in the instance). Saves ~0.1 µs per hook on the hot path.
    d["control"] = _new(TrainerControl)
    ctx = _new(TrainingContext)
    ctx.__dict__ = d
    return ctx


_new = object.__new__
_EMPTY = TrainingContext()
