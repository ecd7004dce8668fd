"""Workers, driver and eval tasks: how a run's model is built (demo, factory, Hugging Face).

``ModelSpec`` says how to build the model of a run; ``build_model`` builds it in any process: in
each training worker, and in ``load_model`` (a notebook, an evaluation task), from the spec a
checkpoint records. Hugging Face models need the optional extra ``ray-trainer[hf]``
(transformers). :func:`check_model_ref` runs in the driver before Ray starts, so that a wrong
model name fails at once. Nothing is ever downloaded unless ``allow_download=True``: a name must
be a local directory, a bucket URI (``s3://...``: config and tokenizer are read from it, the
safetensors weights in place, see ``_model/pretrained/``) or a model already in the Hugging Face
cache.
Training workers build a pretrained model with safetensors weights on the meta device and fill
it once sharded (``_worker/model/build.py``); its weights are fp32 whatever the files hold.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_trainer._errors import TrainingArgsError
from ray_trainer._storage import is_uri

BUILTIN_MODELS = ("tiny-lm", "demo")
_INSTALL_HINT = "pip install 'ray-trainer[hf]'"


@dataclass
class ModelSpec:
    """How to build a run's model: the `TrainingArgs` fields that decide it. A checkpoint
    records it as data (`record`: a model's name, or a factory as the ``"module:qualname"``
    that imports it; a lambda or a local function is left out) so that `load_model` can
    rebuild the module anywhere without running code from the checkpoint."""

    model: Any = None  # None, "tiny-lm" or "demo"; a Hugging Face name or path; or a factory
    demo: dict[str, Any] = field(default_factory=dict)
    on_jsonl: bool = False  # the built-in model trained on JSONL text (a byte tokenizer)
    max_length: int = 128
    tokenizer: str | None = None
    allow_download: bool = False
    recorded_factory: str | None = None  # the "module:qualname" a checkpoint named, imported

    @classmethod
    def of(cls, args: Any) -> ModelSpec:
        """The spec of a run's `TrainingArgs`."""
        return cls(
            model=args.model,
            demo=dict(args.demo),
            on_jsonl=args.data is not None,
            max_length=args.max_length,
            tokenizer=args.tokenizer,
            allow_download=args.allow_download,
        )

    def record(self) -> dict[str, Any]:
        """This spec as JSON data: a factory as its ``"module:qualname"`` (None for one that
        cannot be imported by that name), with its name for the error that asks for it."""
        model = os.fspath(self.model) if isinstance(self.model, os.PathLike) else self.model
        fields = {
            "demo": self.demo,
            "on_jsonl": self.on_jsonl,
            "max_length": self.max_length,
            "tokenizer": self.tokenizer,
            "allow_download": self.allow_download,
        }
        if model is None or isinstance(model, str):
            return {"model": model, **fields}
        name = getattr(model, "__qualname__", None) or type(model).__qualname__
        return {"model": None, "factory": factory_ref(model), "factory_name": name, **fields}

    @classmethod
    def from_record(
        cls,
        record: dict[str, Any] | None,
        model: Any = None,
        where: str = "",
        trust_factory: bool = False,
    ) -> ModelSpec:
        """The spec a checkpoint records (`record`'s data; None: the checkpoint records none,
        and `model` builds it). `model`, a factory, builds the model instead of the one
        recorded; it is needed where the run's factory could not be recorded by name. A
        recorded ``"module:qualname"`` is imported from this environment only with
        `trust_factory` (anyone who can write a checkpoint can name any callable there):
        without it, `ModelLoadError` names the factory and both ways out, before any import.
        Fields of the wrong type raise `TypeError` naming them (the checkpoint's reader says
        which file)."""
        if model is not None and not callable(model):
            raise ModelLoadError(f"model= must be a factory (a callable), got {model!r}")
        if record is None:
            if model is None:
                raise ModelLoadError(f"{where}: it records no model spec; pass model=factory")
            return cls(model=model)
        _check_record(record)
        spec = cls(model=record.get("model"), allow_download=bool(record.get("allow_download")))
        spec.demo, spec.on_jsonl = dict(record["demo"] or {}), record["on_jsonl"]
        spec.max_length, spec.tokenizer = record["max_length"], record["tokenizer"]
        if model is not None:
            spec.model = model
        elif "factory" in record:
            ref = record["factory"]
            if ref is None:
                raise ModelLoadError(
                    f"{where}: its model was built by {record.get('factory_name')!r}, a factory "
                    "that cannot be imported by name (a lambda, a local function or one defined "
                    "in __main__), so the checkpoint does not record it; pass it: "
                    "load_model(path, model=factory)"
                )
            if not trust_factory:
                raise ModelLoadError(
                    f"{where}: its model is built by the factory {ref!r}, which loading would "
                    "import and call; a checkpoint can name any importable callable there, so a "
                    "factory it names is called only when you say so: load_model(path, "
                    "model=<your factory>) builds the model with yours; load_model(path, "
                    f"trust_factory=True) imports and calls {ref!r} (if you trust this "
                    "checkpoint)"
                )
            spec.model, spec.recorded_factory = import_factory(ref, where), ref
        return spec

    @property
    def is_demo(self) -> bool:
        """The built-in demo task (its model, its data)."""
        return is_builtin(self.model)

    def build_model(self) -> Any:
        """A freshly initialised module (seed torch first for identical replicas)."""
        from torch import nn

        if self.is_demo and not self.on_jsonl:
            from ray_trainer._demo import build_demo

            return build_demo(**self.demo).model_factory()
        if self.is_demo:
            from ray_trainer._data.encode import ByteTokenizer
            from ray_trainer._demo.model import TinyCausalLM, TinyLMConfig

            fields = TinyLMConfig.__dataclass_fields__
            overrides = {k: v for k, v in self.demo.items() if k in fields}
            overrides.setdefault("max_len", self.max_length)
            return TinyCausalLM(TinyLMConfig(vocab_size=ByteTokenizer.vocab_size, **overrides))
        if isinstance(self.model, str):
            import torch

            folder = self.pretrained_folder()
            if folder is None:  # not safetensors: from_pretrained, in the dtype training keeps
                return load_hf_causal_lm(self.model, self.allow_download, dtype=torch.float32)
            from ray_trainer._model.pretrained import SafetensorsFiles, empty_model, materialize

            model = empty_model(self.hf_config())
            with SafetensorsFiles(folder) as files:
                materialize(model, files, torch.device("cpu"))
            return model
        model = self.model()
        if not isinstance(model, nn.Module):
            raise NotAModuleError(
                f"model factory {self.recorded_factory or _factory_name(self.model)!r} returned "
                f"{type(model).__name__}, not an nn.Module"
            )
        return model

    def build_meta_model(self) -> Any:
        """The model's structure without memory (on the meta device), for the driver's checks;
        a Hugging Face model is built from its config, its weights are never read."""
        import torch

        with torch.device("meta"):
            if isinstance(self.model, str) and not self.is_demo:
                transformers = load_transformers(self.model)
                return transformers.AutoModelForCausalLM.from_config(self.hf_config())
            return self.build_model()

    def hf_config(self) -> Any:
        """The Hugging Face config of the model (read from the bucket for a URI)."""
        from ray_trainer._model.pretrained import config_source

        transformers = load_transformers(self.model)
        name = _check_name(self.model, "model")
        return transformers.AutoConfig.from_pretrained(
            config_source(name), local_files_only=not self.allow_download
        )

    def pretrained_folder(self) -> Any:
        """The folder (a `_storage.Location`) of a pretrained Hugging Face model whose weights
        are safetensors files, which workers load on the meta device and fill in place; None
        for any other model."""
        if not isinstance(self.model, str) or self.is_demo:
            return None
        from ray_trainer._model.pretrained import pretrained_folder

        return pretrained_folder(_check_name(self.model, "model"))

    def build_tokenizer(self) -> Any:
        """The tokenizer for JSONL text: the byte tokenizer for the built-in model, the Hugging
        Face one for a named model (or `tokenizer`), else None."""
        if self.is_demo:
            from ray_trainer._data.encode import ByteTokenizer

            return ByteTokenizer()
        name = self.tokenizer or (self.model if isinstance(self.model, str) else None)
        return load_hf_tokenizer(name, allow_download=self.allow_download) if name else None

    def data_tokenizer(self) -> Any:
        """The tokenizer data is encoded with: `build_tokenizer`'s, else the byte tokenizer."""
        tokenizer = self.build_tokenizer()
        if tokenizer is None:
            from ray_trainer._data.encode import ByteTokenizer

            tokenizer = ByteTokenizer()
        return tokenizer


class ModelLoadError(TrainingArgsError):
    """A model or tokenizer reference that cannot be loaded; the message says why and the fix."""


class NotAModuleError(ModelLoadError, TypeError):
    """A model factory that returned something other than an ``nn.Module`` (a `TypeError` too,
    as it was before it was a `ModelLoadError`)."""


#: A model spec's record (`ModelSpec.record`): each field's JSON types.
_RECORD_TYPES: dict[str, tuple[type, ...]] = {
    "model": (str, type(None)),
    "demo": (dict, type(None)),
    "on_jsonl": (bool,),
    "max_length": (int,),
    "tokenizer": (str, type(None)),
    "allow_download": (bool,),
    "factory": (str, type(None)),
    "factory_name": (str, type(None)),
}
_REQUIRED = ("demo", "on_jsonl", "max_length", "tokenizer")


def _check_record(record: dict[str, Any]) -> None:
    """A `TypeError` (`KeyError` for a missing field) naming a field of `record` that is not
    what `ModelSpec.record` writes; the demo's settings are numbers, strings or bools."""
    missing = [key for key in _REQUIRED if key not in record]
    if missing:
        raise KeyError(missing[0])
    for key, kinds in _RECORD_TYPES.items():
        if key in record and type(record[key]) not in kinds:
            raise TypeError(f"{key} is a {type(record[key]).__name__}")
    for key, value in (record["demo"] or {}).items():
        if type(value) not in (int, float, str, bool, type(None)):
            raise TypeError(f"demo[{key!r}] is a {type(value).__name__}")


def _factory_name(factory: Any) -> str:
    return factory_ref(factory) or getattr(factory, "__qualname__", None) or repr(factory)


def is_builtin(model: object) -> bool:
    """True for the built-in demo transformer: ``model=None`` or its names (``"tiny-lm"``,
    ``"demo"``)."""
    return model is None or (isinstance(model, str) and model in BUILTIN_MODELS)


def factory_ref(factory: Any) -> str | None:
    """``"module:qualname"`` that imports `factory` again, or None for one that cannot be
    imported by name (a lambda, a local function, one defined in ``__main__``)."""
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        found = _import_name(module, qualname)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is factory else None


def import_factory(ref: str, where: str = "") -> Any:
    """The factory a ``"module:qualname"`` names, imported from this environment."""
    module, _, qualname = str(ref).partition(":")
    try:
        found = _import_name(module, qualname)
    except (ImportError, AttributeError, ValueError) as e:
        raise ModelLoadError(
            f"{where}: its model factory {ref!r} cannot be imported here ({_short(e)}); install "
            "the code that defines it, or pass the factory: load_model(path, model=factory)"
        ) from None
    if not callable(found):
        raise ModelLoadError(f"{where}: the model factory {ref!r} is not callable")
    return found


def _import_name(module: str, qualname: str) -> Any:
    if not module or not qualname:
        raise ValueError("expected 'module:qualname'")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def is_causal_lm(model: Any) -> bool:
    """A model that predicts token t+1 at position t (its labels are shifted inside)."""
    from ray_trainer._demo.model import TinyCausalLM

    name = type(model).__name__
    return isinstance(model, TinyCausalLM) or name.endswith(("ForCausalLM", "LMHeadModel"))


def load_transformers(name_or_path: str) -> Any:
    """The transformers module, or a `ModelLoadError` naming `name_or_path` and the extra."""
    try:
        import transformers
    except ImportError:
        raise ModelLoadError(
            f"model {name_or_path!r} is not a built-in model name ({', '.join(BUILTIN_MODELS)}), "
            f"and loading a Hugging Face model needs transformers: {_INSTALL_HINT}"
        ) from None
    return transformers


def _not_found(what: str, name_or_path: str, cause: BaseException, allow_download: bool) -> str:
    p = Path(name_or_path).expanduser()
    if p.is_dir():
        where = f"the directory {p} exists but holds no loadable {what} ({_short(cause)})"
    elif p.exists():
        where = f"{p} is a file; give the directory that save_pretrained wrote"
    elif name_or_path.startswith(("/", "./", "../", "~")):
        where = f"there is no such directory ({p.resolve()})"
    elif allow_download:
        where = f"it could not be loaded or downloaded ({_short(cause)})"
    else:
        where = (
            "it is neither a local directory nor in the Hugging Face cache, and downloads are off; "
            f"download it first (`hf download {name_or_path}`), or set "
            "TrainingArgs.allow_download=True (allow_download: true in a config file)"
        )
    return (
        f"{what} {name_or_path!r} is not a built-in model name ({', '.join(BUILTIN_MODELS)}) "
        f"nor a loadable local path or cached model: {where}"
    )


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}{'...' if len(text) > 300 else ''}"


def _check_name(name_or_path: Any, what: str) -> str:
    if isinstance(name_or_path, os.PathLike):
        name_or_path = os.fspath(name_or_path)
    if not isinstance(name_or_path, str) or not name_or_path:
        raise ModelLoadError(f"{what} must be a model name or a path, got {name_or_path!r}")
    if is_builtin(name_or_path):
        raise ModelLoadError(
            f"{what} {name_or_path!r} is the built-in demo transformer, not a Hugging Face model; "
            "build it with ray_trainer._demo (TrainingArgs(model='tiny-lm') does this)"
        )
    return str(Path(name_or_path).expanduser()) if name_or_path.startswith("~") else name_or_path


def check_model_ref(name_or_path: str, allow_download: bool = False) -> None:
    """Fail fast, in the driver, on a model reference that workers could not load.

    Built-in names pass. Other names must resolve to a Hugging Face config without a download
    (unless ``allow_download``); only the config is read, never the weights.
    """
    if is_builtin(name_or_path):
        return
    name = _check_name(name_or_path, "model")
    transformers = load_transformers(name)
    if is_uri(name):
        _check_bucket_model(name)
        return
    try:
        transformers.AutoConfig.from_pretrained(name, local_files_only=not allow_download)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("model", name, e, allow_download)) from e


def _check_bucket_model(uri: str) -> None:
    """A model on a bucket needs its config and safetensors weights there (read in place)."""
    from ray_trainer._model.pretrained import local_files, weight_files
    from ray_trainer._storage import locate

    try:
        local_files(uri.rstrip("/"))
        if not weight_files(locate(uri)):
            raise ValueError(
                "no *.safetensors weights in it; a model on a bucket is read in "
                "place: save it with save_pretrained(safe_serialization=True)"
            )
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"model {uri!r}: {_short(e)}") from e


def load_hf_causal_lm(name_or_path: str, allow_download: bool = False, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained`` that never downloads unless ``allow_download``.

    Runs in the process that calls it (each training worker, or an evaluation task). Extra
    keyword arguments go to ``from_pretrained`` (e.g. ``dtype``).
    """
    name = _check_name(name_or_path, "model")
    transformers = load_transformers(name)
    kwargs.setdefault("local_files_only", not allow_download)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("model", name, e, allow_download)) from e


def load_hf_tokenizer(name_or_path: str, allow_download: bool = False, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` that never downloads unless ``allow_download``.

    Runs in the process that calls it. Extra keyword arguments go to ``from_pretrained``.
    """
    from ray_trainer._model.pretrained import config_source

    name = _check_name(name_or_path, "tokenizer")
    transformers = load_transformers(name)
    kwargs.setdefault("local_files_only", not allow_download)
    try:
        return transformers.AutoTokenizer.from_pretrained(config_source(name), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("tokenizer", name, e, allow_download)) from e
