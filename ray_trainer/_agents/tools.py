"""Driver and training workers: a GRPO run's tools and environments, as TRL 1.16 takes them.

``tools=[fn, ...]`` are Python functions with type hints and a Google-style docstring (their
JSON schemas, made by transformers' ``get_json_schema``, go to the chat template);
``environment_factory`` is a callable (or ``"module:Class"``) returning an environment with
``reset(**row) -> str | None``, whose public methods become the episode's tools, and optionally
``get_reward() -> float``; a dict of factories selects one by the row's ``environment`` field.

:func:`resolve_agent_tools` checks all of it in the driver before Ray starts (it builds one
instance of each factory, as TRL's ``GRPOTrainer`` does, to read its tools) and returns
:class:`AgentTools`: plain data that travels to the workers. :func:`check_tool_template`
checks that the run's chat template can express a tool-calling conversation, keeps earlier
turns' tokens as later turns render them (a prefix), and that the sampled text can be parsed
back into tool calls by transformers' response parsing (``tokenizer.parse_response``).
Nothing here imports Ray or torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._agents.env_host import environment_tools
from ray_trainer._errors import TrainingArgsError
from ray_trainer._named import import_named

#: The row field that picks an environment when ``environment_factory`` is a dict (TRL's).
ENVIRONMENT_FIELD = "environment"

#: transformers' response template for ChatML templates that write a tool call as
#: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen 2.5 and 3, and ours in
#: ``ray_trainer.demo``): the same template TRL sets for the Qwen family.
CHATML_TOOL_CALLS = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {
            "open": "<think>",
            "close_pattern": r"</think>\s*",
            "content": "text",
        },
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}
_FIX_TEMPLATE = (
    "set TrainingArgs.chat_template to a template that renders an assistant message's "
    "tool_calls and 'tool' messages (e.g. the tool-use template of the model's family)"
)


@dataclass(frozen=True)
class AgentTools:
    """A run's tools, resolved (plain data: it travels to the workers pickled).

    Attributes:
        tools: the standalone tool functions (every episode has them).
        factories: ``{None: factory}`` for one environment, ``{name: factory}`` for several
            (the row's ``environment`` field picks), ``{}`` with no environment.
        schemas: the JSON schemas each environment's episodes see (standalone tools first,
            then the environment's methods by name, as TRL orders them), by environment name.
        rewarded: the environments whose instances define ``get_reward``, by name, to the
            class name their reward is logged under (``rewards/<Class>/mean``).
    """

    tools: tuple[Callable[..., Any], ...] = ()
    factories: dict[str | None, Callable[[], Any]] = field(default_factory=dict)
    schemas: dict[str | None, list[dict]] = field(default_factory=dict)
    rewarded: dict[str | None, str] = field(default_factory=dict)

    @property
    def multi(self) -> bool:
        """Several environments: each row names its own in its ``environment`` field."""
        return bool(self.factories) and None not in self.factories

    def environment_of(self, row: dict, where: str) -> str | None:
        """The environment name of a data row (None: the only one, or none); refused naming
        the row and the names when it names no factory."""
        if not self.multi:
            return None
        name = row.get(ENVIRONMENT_FIELD)
        if name not in self.factories:
            known = ", ".join(map(repr, self.factories))
            raise TrainingArgsError(
                f"{where}: its {ENVIRONMENT_FIELD!r} field is {name!r}, which names no "
                f"environment of environment_factory (it has {known}); set the field to one "
                "of them"
            )
        return name

    def schemas_of(self, environment: str | None) -> list[dict]:
        return self.schemas.get(environment, [])


def tool_schema(fn: Callable[..., Any], where: str) -> dict:
    """The JSON schema of a tool (transformers' ``get_json_schema``: its name, docstring and
    type hints), or a :class:`TrainingArgsError` naming the tool and the fix."""
    from transformers.utils import get_json_schema

    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException
        raise TrainingArgsError(
            f"{where} {name!r}: {e}; a tool needs a type hint on every parameter and a "
            "Google-style docstring: a description, then 'Args:' with one 'name: what it is' "
            "line per parameter (transformers' get_json_schema reads them)"
        ) from None


def resolve_agent_tools(tools: Any, environment_factory: Any) -> AgentTools | None:
    """``TrainingArgs.tools`` and ``environment_factory`` resolved and checked (None when both
    are None). Runs in the driver before Ray starts: each factory is called once, and its
    instance checked for ``reset``, its tools for type hints and docstrings."""
    if tools is None and environment_factory is None:
        return None
    items = tools if isinstance(tools, (list, tuple)) else ([] if tools is None else [tools])
    fns = tuple(
        import_named(t, f"tools[{i}]", "my_tools:multiply", "a function with type hints and a docstring")
        for i, t in enumerate(items)
    )  # fmt: skip
    own = [tool_schema(fn, f"tools[{i}]") for i, fn in enumerate(fns)]
    names = [s["function"]["name"] for s in own]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise TrainingArgsError(
            f"tools: two tools are named {twice[0]!r}; the model calls a tool by its name, so "
            "give each its own"
        )
    if isinstance(environment_factory, dict):
        if not environment_factory:
            raise TrainingArgsError("environment_factory: an empty dict; give one factory or more")
        specs = {str(k): v for k, v in environment_factory.items()}
    else:
        specs = {} if environment_factory is None else {None: environment_factory}
    factories, schemas, rewarded = {}, {}, {}
    for key, spec in specs.items():
        where = "environment_factory" + ("" if key is None else f"[{key!r}]")
        factory = import_named(
            spec, where, "my_envs:Game", "a class or function returning an environment", "Class"
        )
        instance = _probe(factory, where)
        methods = environment_tools(instance)
        schemas[key] = own + [tool_schema(m, f"{where} method") for m in methods]
        factories[key] = factory
        if callable(getattr(instance, "get_reward", None)):
            rewarded[key] = type(instance).__name__
    if not specs:
        schemas[None] = own
    return AgentTools(fns, factories, schemas, rewarded)


def _probe(factory: Callable[[], Any], where: str) -> Any:
    try:
        instance = factory()
    except Exception as e:
        raise TrainingArgsError(
            f"{where}: calling it with no arguments raised {type(e).__name__}: {e}; the "
            "factory builds one environment per episode, with no arguments (a class whose "
            "__init__ takes none, or a function)"
        ) from None
    if not callable(getattr(instance, "reset", None)):
        raise TrainingArgsError(
            f"{where}: returned a {type(instance).__name__} with no reset method; an "
            "environment defines reset(self, **row) -> str | None (its text is appended to "
            "the prompt's last user message), and its public methods are the tools"
        )
    return instance


def agent_prompts(args: Any, tokenizer: Any) -> dict[str, Any]:
    """What a run's ``PromptEncoder`` needs to render a multi-turn run's prompts with its tools
    (``tools``: the schemas by environment, ``environments``: the names a row picks from),
    the chat template checked for tool calls first; ``{}`` for a run without tools. Driver,
    before Ray starts."""
    agent = resolve_agent_tools(args.tools, args.environment_factory)
    if agent is None:
        return {}
    run_template(tokenizer, args.chat_template)
    names = tuple(k for k in agent.factories if k is not None)
    return {"tools": agent.schemas, "environments": names}


def run_template(tokenizer: Any, chat_template: str | None) -> tuple[str, dict]:
    """The run's chat template (Jinja text) and the response template its tool calls parse
    with, checked (:func:`check_tool_template`)."""
    from ray_trainer._data.chat import ChatTemplateError
    from ray_trainer._data.template import resolve_chat_template

    where = "TrainingArgs.chat_template" if chat_template else "the tokenizer's chat template"
    try:
        template = resolve_chat_template(tokenizer, chat_template)
    except ChatTemplateError as e:
        raise TrainingArgsError(f"tools: {e}") from None
    return template, check_tool_template(tokenizer, template, where)


# -- the chat template ------------------------------------------------------------------------


def check_tool_template(tokenizer: Any, template: str, where: str) -> dict:
    """Check that `template` (the run's chat template, named by `where`) can render a whole
    tool-calling exchange, renders earlier turns as a prefix of later ones, and that sampled
    text parses back: returns the response template to parse with (the tokenizer's own
    ``response_template``; else ours for ChatML ``<tool_call>`` templates; else TRL's for the
    families it knows, when TRL is installed). Raises :class:`TrainingArgsError` naming the
    template and the fix."""
    name, key, value, result = "tool_n4me", "arg_k3y", "arg_v4lue", "result_c0ntent"
    calls = [{"type": "function", "function": {"name": name, "arguments": {key: value}}}]
    convo = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "name": name, "content": result},
    ]
    try:
        shown = tokenizer.apply_chat_template(convo, chat_template=template, tokenize=False)
    except Exception as e:
        raise TrainingArgsError(
            f"tools: {where} cannot render a tool call and its result "
            f"({type(e).__name__}: {e}); {_FIX_TEMPLATE}"
        ) from None
    missing = [s for s in (name, key, value, result) if s not in shown]
    if missing:
        raise TrainingArgsError(
            f"tools: {where} drops part of a tool-calling exchange (it does not write "
            f"{', '.join(map(repr, missing))} of a user -> assistant tool_calls -> tool "
            f"conversation); {_FIX_TEMPLATE}"
        )
    first = tokenizer.apply_chat_template(convo[:2], chat_template=template, tokenize=False)
    after = tokenizer.apply_chat_template(
        convo, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(first):
        raise TrainingArgsError(
            f"tools: {where} renders the turns before a tool result differently once it "
            "follows, so an episode's tokens could not be built by concatenation (the trainer "
            f"would score other tokens than the engine sampled); {_FIX_TEMPLATE} and keeps "
            "earlier turns as they were"
        )
    return response_template(tokenizer, template, where, shown)


def response_template(tokenizer: Any, template: str, where: str, shown: str = "") -> dict:
    """How the sampled text is parsed into a message with tool calls (transformers'
    ``parse_response``)."""
    own = getattr(tokenizer, "response_template", None)
    if own is not None:
        return own
    if "<tool_call>" in shown and "<|im_start|>assistant\n" in shown:
        return CHATML_TOOL_CALLS
    try:  # TRL knows the response templates of several model families
        from trl.chat_template_utils import add_response_schema
    except ImportError:
        add_response_schema = None
    if add_response_schema is not None:
        holder = _TemplateHolder(template)
        try:
            add_response_schema(holder)
        except ValueError:
            pass
        else:
            if holder.response_template is not None:
                return holder.response_template
    raise TrainingArgsError(
        f"tools: no response template to parse tool calls written by {where}; set "
        "tokenizer.response_template (transformers' response parsing) and save the tokenizer "
        "with it, or use a ChatML template that writes <tool_call>{...}</tool_call>"
    )


class _TemplateHolder:
    """What TRL's ``add_response_schema`` reads and sets on a tokenizer."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template
        self.response_template: dict | None = None
        self.response_schema: dict | None = None
