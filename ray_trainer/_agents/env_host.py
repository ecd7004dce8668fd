"""In each environment actor process: the environments of many episodes, and their tool calls.

`EnvironmentSpec` is how a run's environments are built (plain data: cloudpickled with the
user's factories and tools, it travels from the driver to the workers and on to the actors).
`EnvironmentHost` is the class of the Ray actor that holds them: one instance of the user's
environment per episode key, and the calls of TRL's shape run against it, with TRL 1.16's rules
(``GRPOTrainer(tools=..., environment_factory=...)``): an environment's tools are its public
methods but ``reset`` and ``get_reward``; a tool that raises answers ``{"error": str(e)}``. The
pool that reaches these actors from a training worker is `environments.EnvironmentPool`.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: The tool-less marker kept for an episode of a run with standalone tools only.
_NO_ENVIRONMENT = object()
#: An environment's methods that are never tools (TRL's rule).
_NOT_TOOLS = frozenset({"reset", "get_reward"})


@dataclass(frozen=True)
class EnvironmentSpec:
    """How to build the run's environment actors: plain data that travels (pickled by cloudpickle).

    Built in the driver, read in the training workers (the pool) and the environment actors.

    Args:
        factories: ``{}`` with standalone tools only; ``{None: f}`` for one factory (TRL's
            ``environment_factory=f``: every row gets ``f()``); ``{"name": f, ...}`` picked by
            each row's ``"environment"`` field (TRL's ``environment_factory={...}``).
        tools: standalone tool functions; every episode has them (TRL's ``tools=[...]``).
        workers: environment actors in the pool (``environment_workers``).
        resources: each actor's Ray resources (``environment_resources``); ``None`` is
            ``{"CPU": 0.25}``.
        timeout_s: the most one call may take (``tool_timeout_s``).
        concurrency: calls one actor runs at once, on threads: tools that sleep or wait on I/O
            overlap.
    """

    factories: dict[str | None, Callable[[], Any]] = field(default_factory=dict)
    tools: tuple[Callable, ...] = ()
    workers: int = 1
    resources: dict[str, float] | None = None
    timeout_s: float = 60.0
    concurrency: int = 256

    def __post_init__(self) -> None:
        object.__setattr__(self, "tools", tuple(self.tools))
        for name, factory in self.factories.items():
            if not callable(factory):
                raise TypeError(
                    f"environment_factory[{name!r}] is {factory!r}, not a callable: pass a class "
                    "or a function that returns a new environment"
                )
        for tool in self.tools:
            if not callable(tool) or not getattr(tool, "__name__", None):
                raise TypeError(f"tools: {tool!r} is not a named function: pass a def or a method")
        if self.workers < 1:
            raise ValueError(f"environment_workers is {self.workers}: it must be at least 1")
        if self.timeout_s <= 0:
            raise ValueError(f"tool_timeout_s is {self.timeout_s}: it must be above 0 seconds")
        if self.concurrency < 1:
            raise ValueError(f"the environment concurrency is {self.concurrency}: at least 1")
        bad = {k: v for k, v in (self.resources or {}).items() if v < 0}
        if bad:
            raise ValueError(f"environment_resources {bad}: each amount must be 0 or more")

    @property
    def actor_resources(self) -> dict[str, float]:
        """Each actor's resources, the default filled in."""
        return dict(self.resources) if self.resources is not None else {"CPU": 0.25}


def environment_tools(instance: Any) -> list[Callable]:
    """The public methods of an environment instance that become tools (bound methods), in TRL's
    order (``inspect.getmembers`` of its class: by name): every public function of the class
    but ``reset`` and ``get_reward``. Read on the class, so a property is never evaluated."""
    return [
        getattr(instance, name)
        for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
        if name not in _NOT_TOOLS and not name.startswith("_")
    ]


def _run(value: Any) -> Any:
    """A tool's or `get_reward`'s result, awaited here when it is a coroutine (an ``async def``):
    the actor's call threads have no event loop of their own."""
    if not inspect.isawaitable(value):
        return value

    async def wait() -> Any:
        return await value

    return asyncio.run(wait())


class EnvironmentHost:
    """The Ray actor's class (started with ``max_concurrency=spec.concurrency``, a threaded
    actor): many environment instances, one per episode key. Runs in an environment actor
    process; its methods run on the actor's threads, many at once, one episode's calls one at a
    time (its loop waits for each answer before the next turn).
    """

    def __init__(self, spec: EnvironmentSpec) -> None:
        self.spec = spec
        self._episodes: dict[str, Any] = {}
        self._lock = threading.Lock()  # guards `_episodes` across the call threads

    def open(self, key: str, env: str | None, row: dict) -> Any:
        """Build the episode's environment (``spec.factories[env]()``), keep it under `key` and
        return its ``reset(**row)``: a str (added to the prompt), a list of content blocks, or
        None. A reset that raises raises here (the row's fault, not the actor's). With no
        factories, only marks the key and returns None. A key open already starts over."""
        factories = self.spec.factories
        if not factories:
            with self._lock:
                self._episodes[key] = _NO_ENVIRONMENT
            return None
        if list(factories) == [None]:
            factory, kwargs = factories[None], row  # one environment: TRL passes the whole row
        elif env in factories:
            factory = factories[env]
            kwargs = {k: v for k, v in row.items() if k != "environment"}  # a control field
        else:
            raise ValueError(
                f"the row's environment is {env!r}, which environment_factory does not name: "
                f"expected one of {list(factories)} in the row's 'environment' field"
            )
        instance = factory()
        if not callable(getattr(instance, "reset", None)):
            raise TypeError(
                f"environment_factory[{env!r}] built a {type(instance).__name__} with no "
                "callable reset(**row): every environment must define one"
            )
        observation = _run(instance.reset(**kwargs))
        with self._lock:
            self._episodes[key] = instance
        return observation

    def call(self, key: str, calls: list[dict]) -> list[tuple[str, Any, bool]]:
        """Run one turn's tool calls in order, each ``{"type": "function", "function": {"name":
        n, "arguments": {...}}}``, and answer ``(name, result, failed)`` for each: a tool that
        raises answers ``{"error": str(e)}``, failed, as TRL does; so do an unknown name and a
        call of another type. An ``async def`` tool is awaited here."""
        tools = self._tools(self._instance(key))
        answers = []
        for call in calls:
            if call.get("type") != "function":
                error = f"Unsupported tool call type: {call.get('type')}"
                name = (call.get("function") or {}).get("name") or call.get("name", "unknown")
                answers.append((name, {"error": error}, True))
                continue
            function = call.get("function") or {}
            name = function.get("name")
            try:
                if name not in tools:
                    raise ValueError(f"Tool {name} not found.")
                answers.append((name, _run(tools[name](**function.get("arguments", {}))), False))
            except Exception as e:
                answers.append((name, {"error": str(e)}, True))
        return answers

    def finish(self, key: str) -> tuple[float | None, bytes | None]:
        """End the episode: its ``get_reward()`` (a float; None where the environment defines
        none) and the instance cloudpickled (None where it cannot be, or with no factories).
        The key is forgotten first, also when ``get_reward`` raises (that raises here)."""
        import cloudpickle

        with self._lock:
            instance = self._episodes.pop(key, None)
        if instance is None:
            raise LookupError(self._unknown(key))
        if instance is _NO_ENVIRONMENT:
            return None, None
        get_reward = getattr(instance, "get_reward", None)
        reward = _run(get_reward()) if callable(get_reward) else None
        try:
            snapshot = cloudpickle.dumps(instance)
        except Exception:  # a lock, a socket, a client: the episode's record goes without it
            snapshot = None
        return (None if reward is None else float(reward)), snapshot

    def drop(self, key: str) -> None:
        """Forget the key (an abandoned episode); an unknown one is fine."""
        with self._lock:
            self._episodes.pop(key, None)

    def ping(self) -> int:
        """The number of live keys."""
        with self._lock:
            return len(self._episodes)

    def _instance(self, key: str) -> Any:
        with self._lock:
            instance = self._episodes.get(key)
        if instance is None:
            raise LookupError(self._unknown(key))
        return instance

    def _tools(self, instance: Any) -> dict[str, Callable]:
        """The episode's tools by name: the standalone ones, then the environment's methods (a
        method shadows a standalone tool of its name, as in TRL's per-rollout tool dict)."""
        methods = [] if instance is _NO_ENVIRONMENT else environment_tools(instance)
        return {tool.__name__: tool for tool in (*self.spec.tools, *methods)}

    def _unknown(self, key: str) -> str:
        return (
            f"no episode is open under key {key!r} in this environment actor: open it first "
            f"(an actor that replaced a dead one holds none of its episodes)"
        )
