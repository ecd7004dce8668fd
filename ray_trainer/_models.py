"""Workers, driver and eval tasks: how a run's model is built (demo, factory, Hugging Face).

``ModelSpec`` says how to build the model of a run; ``build_model`` builds it in any process: in
each training worker, and in ``load_model`` (a notebook, an evaluation task), from the spec a
checkpoint records. Hugging Face models need the optional extra ``ray-trainer[hf]``
(transformers). :func:`check_model_ref` runs in the driver before Ray starts, so that a wrong
model name fails at once. Nothing is ever downloaded unless ``allow_download=True``: a name must
be a local directory, a bucket URI (``s3://...``: config and tokenizer are read from it, the
safetensors weights in place, see ``_pretrained/``) or a model already in the Hugging Face cache.
Training workers build a pretrained model with safetensors weights on the meta device and fill
it once sharded (``_worker/loading.py``); its weights are fp32 whatever the files hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ray_trainer._config import TrainingArgsError

BUILTIN_MODELS = ("tiny-lm", "demo")
_INSTALL_HINT = "pip install 'ray-trainer[hf]'"


@dataclass
class ModelSpec:
    """How to build a run's model: the `TrainingArgs` fields that decide it. A checkpoint
    records it (cloudpickled: a model factory travels by value) so that `load_model` can
    rebuild the module anywhere."""

    model: Any = None  # None, "tiny-lm" or "demo"; a Hugging Face name or path; or a factory
    demo: dict[str, Any] = field(default_factory=dict)
    on_jsonl: bool = False  # the built-in model trained on JSONL text (a byte tokenizer)
    max_length: int = 128
    tokenizer: str | None = None
    allow_download: bool = False

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

    @property
    def is_demo(self) -> bool:
        """The built-in demo task (its model, its data)."""
        return is_builtin_model(self.model) or self.model is None

    def build_model(self) -> Any:
        """A freshly initialised module (seed torch first for identical replicas)."""
        from torch import nn

        if self.is_demo and not self.on_jsonl:
            from ray_trainer._demo import build_demo

            return build_demo(**self.demo).model_factory()
        if self.is_demo:
            from ray_trainer._data import ByteTokenizer
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
            from ray_trainer._pretrained import SafetensorsFiles, empty_model, materialize

            model = empty_model(self.hf_config())
            with SafetensorsFiles(folder) as files:
                materialize(model, files, torch.device("cpu"))
            return model
        model = self.model()
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model factory {self.model!r} returned {type(model).__name__}, not an nn.Module"
            )
        return model

    def build_meta_model(self) -> Any:
        """The model's structure without memory (on the meta device), for the driver's checks;
        a Hugging Face model is built from its config, its weights are never read."""
        import torch

        with torch.device("meta"):
            if isinstance(self.model, str) and not self.is_demo:
                transformers = _transformers(self.model)
                return transformers.AutoModelForCausalLM.from_config(self.hf_config())
            return self.build_model()

    def hf_config(self) -> Any:
        """The Hugging Face config of the model (read from the bucket for a URI)."""
        from ray_trainer._pretrained import config_source

        transformers = _transformers(self.model)
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
        from ray_trainer._pretrained import pretrained_folder

        return pretrained_folder(_check_name(self.model, "model"))

    def build_tokenizer(self) -> Any:
        """The tokenizer for JSONL text: the byte tokenizer for the built-in model, the Hugging
        Face one for a named model (or `tokenizer`), else None."""
        if self.is_demo:
            from ray_trainer._data import ByteTokenizer

            return ByteTokenizer()
        name = self.tokenizer or (self.model if isinstance(self.model, str) else None)
        return load_hf_tokenizer(name, allow_download=self.allow_download) if name else None

    def data_tokenizer(self) -> Any:
        """The tokenizer data is encoded with: `build_tokenizer`'s, else the byte tokenizer."""
        tokenizer = self.build_tokenizer()
        if tokenizer is None:
            from ray_trainer._data import ByteTokenizer

            tokenizer = ByteTokenizer()
        return tokenizer


class ModelLoadError(ValueError):
    """A model or tokenizer reference that cannot be loaded; the message says why and the fix."""


class ShardingError(TrainingArgsError):
    """The model has no blocks to shard (or to checkpoint) as asked; the message lists the
    model's candidate block classes."""


def find_blocks(model: Any, names: list[str] | None = None, why: str = "fsdp") -> list[Any]:
    """The model's blocks, in order: the modules FSDP shards one by one and activation
    checkpointing recomputes. Of the classes ``names`` when given; else of the classes in a
    Hugging Face model's ``_no_split_modules``; else the children of its ``nn.ModuleList``s.

    Runs in the driver (on the model built on the meta device) and in each training worker.

    Raises:
        ShardingError: no such block, or a class in ``names`` the model does not contain.
    """
    from torch import nn

    present = {type(m).__name__ for m in model.modules()}
    wanted = list(names) if names else list(getattr(model, "_no_split_modules", None) or [])
    if names:
        missing = [n for n in names if n not in present]
        if missing:
            raise ShardingError(
                f"fsdp_shard_modules names {', '.join(map(repr, missing))}, which "
                f"{type(model).__name__} does not contain; {_candidates(model)}"
            )
    if wanted:
        blocks = [m for m in model.modules() if type(m).__name__ in wanted and m is not model]
    else:
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        blocks = [child for lst in lists for child in lst]
    if not blocks:
        what = "activation_checkpointing" if why == "checkpointing" else "strategy='fsdp'"
        raise ShardingError(
            f"{what}: {type(model).__name__} has no blocks to "
            f"{'recompute' if why == 'checkpointing' else 'shard'} (no _no_split_modules and "
            f"no nn.ModuleList); name them with fsdp_shard_modules=[...]. {_candidates(model)}"
        )
    return blocks


def _candidates(model: Any) -> str:
    """The classes that look like blocks: repeated submodules with parameters."""
    from collections import Counter

    counts = Counter(
        type(m).__name__
        for m in model.modules()
        if m is not model and any(True for _ in m.parameters(recurse=True))
    )
    repeated = [name for name, n in counts.most_common() if n > 1]
    shown = ", ".join(repeated[:8]) if repeated else "none that repeat"
    return f"its candidate block classes: {shown}"


def missing_compile_toolchain(use_gpu: bool) -> str | None:
    """What ``torch.compile`` (inductor) lacks in this process, or None: on a GPU the triton
    package, on a CPU a C++ compiler. Checked in the driver and again in each worker."""
    import shutil

    if use_gpu:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return "compile=True on GPU workers needs the triton package (pip install triton)"
        return None
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if any(c and shutil.which(c) for c in compilers):
        return None
    return (
        "compile=True on CPU workers needs a C++ compiler for torch.compile's CPU code "
        "(g++ or clang++, e.g. apt-get install g++); install one on every node, or set "
        "compile=False"
    )


def is_builtin_model(name: object) -> bool:
    """True for the names of the built-in demo transformer (``"tiny-lm"``, ``"demo"``)."""
    return isinstance(name, str) and name in BUILTIN_MODELS


def _transformers(name_or_path: str) -> Any:
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
    if is_builtin_model(name_or_path):
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
    if is_builtin_model(name_or_path):
        return
    name = _check_name(name_or_path, "model")
    transformers = _transformers(name)
    if "://" in name:
        _check_bucket_model(name)
        return
    try:
        transformers.AutoConfig.from_pretrained(name, local_files_only=not allow_download)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("model", name, e, allow_download)) from e


def _check_bucket_model(uri: str) -> None:
    """A model on a bucket needs its config and safetensors weights there (read in place)."""
    from ray_trainer._pretrained import local_files, weight_files
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
    transformers = _transformers(name)
    kwargs.setdefault("local_files_only", not allow_download)
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("model", name, e, allow_download)) from e


def load_hf_tokenizer(name_or_path: str, allow_download: bool = False, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained`` that never downloads unless ``allow_download``.

    Runs in the process that calls it. Extra keyword arguments go to ``from_pretrained``.
    """
    from ray_trainer._pretrained import config_source

    name = _check_name(name_or_path, "tokenizer")
    transformers = _transformers(name)
    kwargs.setdefault("local_files_only", not allow_download)
    try:
        return transformers.AutoTokenizer.from_pretrained(config_source(name), **kwargs)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(_not_found("tokenizer", name, e, allow_download)) from e


#: The words of `make_tiny_causal_lm`'s tokenizer (after <pad>=0, <eos>=1, <unk>=2).
TINY_WORDS: tuple[str, ...] = (
    "the", "cat", "dog", "sat", "ran", "on", "mat", "home", "what", "did", "do", "?", "it",
)  # fmt: skip


def make_tiny_causal_lm(
    path: str | os.PathLike[str],
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 2,
    n_positions: int = 32,
    dropout: float = 0.0,
    seed: int = 0,
) -> Path:
    """Save a tiny randomly initialised GPT-2 and a word-level tokenizer to `path`, as
    ``save_pretrained`` writes them, and return `path`. Nothing is downloaded.

    Runs in the calling process (examples, tests). The tokenizer splits on whitespace and knows
    ``TINY_WORDS``; pad is 0, eos is 1, unknown words map to 2.

    Example:
        >>> run_training(model=str(make_tiny_causal_lm("runs/tiny-gpt2")), data="train.jsonl")
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers = _transformers("tiny GPT-2")
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *TINY_WORDS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    config = transformers.GPT2Config(
        vocab_size=len(vocab),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=1,
        eos_token_id=1,
        pad_token_id=0,
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
    )
    path = Path(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformers.GPT2LMHeadModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
