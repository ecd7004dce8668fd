"""Driver: checks of what builds the run's model, before anything starts.

Runs in the driver, before ``ray.init()``, from `inputs.check_inputs`: the built-in model's
``demo`` settings and position limit, a ``tokenizer`` it would not use, ``max_length`` against
a Hugging Face model's ``max_position_embeddings``, and what a model factory returns (built on
the meta device: no memory, no weights), the built-in model's size against this machine's
memory, and ``liger_kernel=True`` against the workers' kind
(GPU), the packages it needs and the model's family. Each refusal is a `TrainingArgsError`
naming the field and the fix; a check that cannot be made cheaply here is left to the workers.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._errors import TrainingArgsError
from ray_trainer._model.spec import ModelSpec, is_builtin

#: The longest ``max_length`` the built-in model takes (its position table has a row per
#: position: ``max_length=1e9`` asked for a 512 GB table). Longer text: a Hugging Face model.
BUILTIN_MAX_LENGTH = 8192
_FRACTIONS = frozenset({"dropout"})  # demo settings that take any number, not only whole ones


def check_model_inputs(args: TrainingArgs) -> None:
    """Refuse model settings that would fail in every worker (or take its memory)."""
    if is_builtin(args.model):
        _check_builtin(args)
    elif callable(args.model):
        _check_factory(args)
    elif isinstance(args.model, str):
        _check_positions(args)
    if args.liger_kernel:
        _check_liger(args)


def _check_builtin(args: TrainingArgs) -> None:
    if args.tokenizer is not None:
        raise TrainingArgsError(
            f"tokenizer={args.tokenizer!r} with the built-in model, which reads text byte by "
            "byte with its own tokenizer: drop tokenizer, or set model to a Hugging Face model "
            "that goes with it"
        )
    on_text = args.data is not None
    if args.max_length > BUILTIN_MAX_LENGTH:
        raise TrainingArgsError(
            f"max_length={args.max_length} is beyond the built-in model's position limit "
            f"({BUILTIN_MAX_LENGTH}: it holds a position table of max_length rows); lower "
            "max_length, or train a Hugging Face model"
        )
    _check_demo(args.demo, on_text, args.max_length)


def _check_demo(demo: dict[str, Any], on_text: bool, max_length: int) -> None:
    """``demo`` holds settings the built-in model (and, without data, its task) knows, and
    they make a model (e.g. ``d_model`` divisible by ``n_heads``) that fits this machine's
    memory (`_check_demo_size`)."""
    from ray_trainer._demo import DEMO_DEFAULTS, TinyLMConfig

    model_keys = {f.name for f in dataclasses.fields(TinyLMConfig)} - {"vocab_size", "max_len"}
    task_keys = set(DEMO_DEFAULTS) - set(TrainingArgs.model_fields)
    known = model_keys if on_text else task_keys
    for key, value in demo.items():
        if key in TrainingArgs.model_fields:
            raise TrainingArgsError(
                f"demo: {key!r} is a training setting, not the demo's: set {key} itself"
            )
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            what = "the built-in model on your data" if on_text else "the demo"
            raise TrainingArgsError(
                f"demo: unknown setting {key!r} for {what}; {hint}known: {', '.join(sorted(known))}"
            )
        if key == "tie_weights":
            right, kind = isinstance(value, bool), "true or false"
        else:
            kinds, kind = ((int, float), "number") if key in _FRACTIONS else (int, "whole number")
            right = isinstance(value, kinds) and not isinstance(value, bool)
        if not right:
            raise TrainingArgsError(f"demo: {key}={value!r}; give a {kind}")
    # The model's settings over the defaults the worker builds it with (the demo task's own;
    # on text, TinyLMConfig's).
    base = {} if on_text else {k: DEMO_DEFAULTS[k] for k in model_keys if k in DEMO_DEFAULTS}
    settings = {**base, **{k: v for k, v in demo.items() if k in model_keys}}
    try:
        TinyLMConfig(vocab_size=256, max_len=1, **settings)
    except (TypeError, ValueError) as e:
        raise TrainingArgsError(f"demo: {e}") from None
    for key in ("digits", "n_train", "n_val", "eval_samples"):
        if key in demo and not on_text and demo[key] < 1:
            raise TrainingArgsError(f"demo: {key}={demo[key]} must be at least 1")
    _check_demo_size(settings, on_text, max_length)


def _check_demo_size(settings: dict[str, Any], on_text: bool, max_length: int) -> None:
    """The built-in model's parameters, counted from its shape (float32: 4 bytes each), within
    this machine's memory: a ``d_model=10**8`` asked every worker for about 1e17 bytes, an
    allocation error after Ray had started. On text its vocabulary is the byte tokenizer's and
    its position table ``max_length`` rows; the demo task's are a few (counted as one row: the
    estimate is a lower bound)."""
    from ray_trainer._data.encode import ByteTokenizer
    from ray_trainer._demo import CharTokenizer, TinyLMConfig

    memory = machine_memory()
    vocab = ByteTokenizer.vocab_size if on_text else CharTokenizer().vocab_size
    config = TinyLMConfig(vocab_size=vocab, max_len=max_length if on_text else 1, **settings)
    need = 4 * config.parameter_count()
    if memory is None or need <= memory:
        return
    shape = ", ".join(
        f"{k}={getattr(config, k)}" for k in ("d_model", "n_layers", "mlp_ratio", "tie_weights")
    )
    rows = f", max_length={max_length} positions" if on_text else ""
    raise TrainingArgsError(
        f"demo: the built-in model of {shape}{rows} has {config.parameter_count():,} parameters, "
        f"{need / 2**30:,.1f} GiB in float32 (training takes about 4 times that: gradients and "
        f"AdamW's two moments), more than this machine's {memory / 2**30:,.1f} GiB of memory; "
        "lower demo's d_model or n_layers (its defaults, d_model=128 and n_layers=2, make "
        "about 0.4 M parameters), or train a Hugging Face model"
    )


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _check_factory(args: TrainingArgs) -> None:
    """A model factory returns an ``nn.Module``: called once here on the meta device (its
    parameters take no memory). A factory that fails there (e.g. it reads weights) is left to
    the workers, whose error names it."""
    try:
        ModelSpec.of(args).build_meta_model()
    except TypeError as e:
        if "not an nn.Module" not in str(e):
            return
        raise TrainingArgsError(
            f"model: {e}; the factory must return the module to train (e.g. model=lambda: "
            "MyNet()), called with no arguments in every worker"
        ) from None
    except Exception:  # not checkable here; the workers report it
        return


def _check_positions(args: TrainingArgs) -> None:
    """A ``max_length`` the user set within a Hugging Face model's ``max_position_embeddings``
    (read from its config; nothing is checked where the config cannot be read here). The
    default is not refused: texts shorter than the limit train whatever max_length says."""
    if "max_length" not in args.model_fields_set:
        return
    try:
        config = ModelSpec.of(args).hf_config()
    except Exception:  # check_model_ref has named a missing model already
        return
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if isinstance(limit, int) and args.max_length > limit:
        raise TrainingArgsError(
            f"max_length={args.max_length} is beyond {args.model}'s position limit "
            f"(max_position_embeddings={limit}); lower max_length to {limit} or less"
        )


def _check_liger(args: TrainingArgs) -> None:
    """``liger_kernel=True``: GPU workers, triton and liger-kernel importable (checked here, as
    compile's toolchain is; each worker checks again), and a model of a family liger-kernel
    patches (its config read, or the factory's model built on the meta device)."""
    from ray_trainer._model.liger_probe import missing_liger_kernel, unsupported_family

    problem = missing_liger_kernel(args.use_gpu)
    if problem:
        raise TrainingArgsError(problem)
    if is_builtin(args.model):
        raise TrainingArgsError(
            "liger_kernel=True with the built-in model, which has none of the layers liger-kernel "
            "replaces; train a Hugging Face Llama, Mistral, Qwen2/3 or Phi-3 model, or set "
            "liger_kernel=False"
        )
    spec = ModelSpec.of(args)
    try:
        config = spec.hf_config() if isinstance(args.model, str) else None
        if config is None:  # a factory's model: built without memory, its config read
            config = getattr(spec.build_meta_model(), "config", None)
    except Exception:  # not readable here (a factory that reads weights): each worker checks
        return
    problem = unsupported_family(getattr(config, "model_type", None))
    if problem:
        raise TrainingArgsError(problem)
