"""In the rollout actor (or any process holding an engine): what every rollout engine offers.

A rollout engine holds a copy of the policy and samples completions from it. It is built once and
never restarted for new weights: the trainer sends them (``weights.py``, ``transport.py``) in
buckets between ``begin_sync`` and ``finish_sync``, and each completion records the policy
version that sampled it. A backend (``"hf"``: transformers' ``generate``; ``"vllm"`` later) is
one subclass of `RolloutEngine`, registered in ``engines.py``; the rest of the code asks this
interface, never the backend's name.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ray_trainer._model.spec import ModelSpec
from ray_trainer._rollout.types import Completion
from ray_trainer._rollout.weights import Bucket, Receiver


@dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled, with TRL 1.16's ``GRPOConfig`` names and defaults.

    Attributes:
        num_generations: completions per prompt.
        max_completion_length: the most tokens a completion may have.
        temperature: > 0; the log-probs a `Completion` records are taken at it too.
        top_p, top_k: nucleus and top-k sampling (``top_k=0``: off).
        seed: the sampling seed: the same seed, weights and prompts give the same completions.
    """

    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_generations", "max_completion_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not self.temperature > 0:
            raise ValueError(
                f"temperature must be > 0 (the log-probs are taken at logits / temperature), "
                f"got {self.temperature!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")


#: The vLLM engine settings `EngineSpec.vllm` takes (the child's ``rollout_start``).
VLLM_SETTINGS = (
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "max_model_len",
    "enforce_eager",
)


@dataclass
class EngineSpec:
    """How to build a rollout engine: plain data, so it travels to the rollout actor.

    Attributes:
        model: the model to sample from, built as the trainer builds it (`ModelSpec`: a
            Hugging Face name or folder, or a factory).
        lora: the run's LoRA fields (``TrainingArgs.lora`` normalised): the engine wraps its
            base as the trainer does and each sync loads the adapter only; None: full weights.
        device: ``"cpu"``, ``"cuda"`` ... (default: ``"cuda"`` where the process sees a GPU).
        dtype: the engine's weights' dtype, a torch dtype name (``"float32"``).
        batch_size: sequences per ``generate`` call and, at most, per log-prob forward.
        logits_bytes: the most memory one log-prob forward's logits may take: fewer sequences
            go into a forward where the vocabulary or the completions are long.
        eos_token_ids: the tokens that end a completion (default: every id the model's
            generation config declares, as TRL takes them).
        pad_token_id: the padding id (default: the model's, else the first end id).
        python: ``"vllm"``: the interpreter of the vLLM environment its child runs under
            (default: ``RAY_TRAINER_VLLM_PYTHON``, else this one where vLLM is importable).
        vllm: ``"vllm"``: vLLM's engine settings: ``gpu_memory_utilization`` (its share of the
            GPU's memory: on a shared GPU, the rollout actor's fraction, e.g. 0.3),
            ``kv_cache_memory_bytes`` (on CPU: 1 GiB unless given), ``max_model_len``,
            ``enforce_eager`` (default True).
        timeout_s: ``"vllm"``: the longest one request to its child may take (its start too).
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    lora: dict[str, Any] | None = None
    device: str | None = None
    dtype: str = "float32"
    batch_size: int = 64
    logits_bytes: int = 2**30
    eos_token_ids: list[int] | None = None
    pad_token_id: int | None = None
    python: str | None = None
    vllm: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("batch_size", "logits_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        unknown = sorted(set(self.vllm) - set(VLLM_SETTINGS))
        if unknown:
            raise ValueError(
                f"vllm: unknown settings {unknown}; vLLM's engine settings here are "
                f"{', '.join(VLLM_SETTINGS)}"
            )
        share = self.vllm.get("gpu_memory_utilization")
        if share is not None and not 0 < share <= 1:
            raise ValueError(
                f"vllm['gpu_memory_utilization'] must be in (0, 1] (vLLM's share of the GPU's "
                f"memory, e.g. 0.3 beside rollout_resources={{'GPU': 0.3}}), got {share!r}"
            )


def token_ids(prompt: Any, index: Any) -> list[int]:
    """A prompt's token ids as ints; refused naming `index` when it has none."""
    ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError(f"prompt {index} has no token: a completion needs a prompt to follow")
    return ids


def sample_rows(
    prompts: list[list[int]], params: SamplingParams, prompt_indices: list[int] | None = None
) -> list[tuple[int, list[int]]]:
    """What a backend's ``generate`` samples: one ``(prompt index, token ids)`` row per
    completion, each prompt's ``num_generations`` rows together (a group)."""
    indices = list(range(len(prompts))) if prompt_indices is None else list(prompt_indices)
    if len(indices) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(indices)} prompt_indices")
    return [
        (index, token_ids(prompt, index))
        for index, prompt in zip(indices, prompts, strict=True)
        for _ in range(params.num_generations)
    ]


class RolloutEngine(abc.ABC):
    """A rollout engine: samples completions, takes new weights in place, scores a probe.

    The weights' side is common to the backends that hold a torch module (`Receiver`); a
    backend whose weights live elsewhere (vLLM's workers) overrides the three sync methods.
    """

    #: The policy version of the weights held (0: the weights it was built with).
    version: int = 0
    #: Called at each request boundary (`boundary`): where the rollout actor loads weights
    #: posted while the engine sampled (``actor.RolloutActor.post``); None: nothing to do.
    on_boundary: Callable[[], None] | None = None

    @classmethod
    @abc.abstractmethod
    def build(cls, spec: EngineSpec, state_dict: dict[str, Any] | None = None) -> RolloutEngine:
        """The engine `spec` describes, with `state_dict`'s weights when given."""

    @abc.abstractmethod
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> list[Completion]:
        """``params.num_generations`` completions of each prompt (token ids), grouped by
        prompt in the prompts' order; `prompt_indices` (default ``0..n-1``) tag them."""

    @abc.abstractmethod
    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> list[float]:
        """The engine's per-token log-probs of `completion_ids` after `prompt_ids` at
        `temperature` (the probe: compared with the trainer's forward on the same weights)."""

    @abc.abstractmethod
    def receiver(self) -> Receiver:
        """What loads the weights of a sync (``weights.Receiver``)."""

    def begin_sync(self, version: int) -> None:
        """A sync of weights for policy `version` starts; generating waits for its end."""
        self.receiver().begin(version)

    def load_bucket(self, bucket: Bucket) -> int:
        """Copy one bucket of the sync into the weights, in place; returns its bytes."""
        return self.receiver().load(bucket)

    def finish_sync(self, version: int) -> dict[str, Any]:
        """Check that the sync covered every weight it must, then take `version`."""
        summary = self.receiver().finish(version)
        self.version = version
        return summary

    def boundary(self) -> None:
        """A request boundary: before each batch of sequences ``generate`` samples (``hf``:
        each ``batch_size`` rows; ``vllm``: each request, and inside it between two decoding
        steps once weights are `posted`). Weights posted meanwhile are taken here, so a
        request may cross versions; each completion records the version that sampled it."""
        if self.on_boundary is not None:
            self.on_boundary()

    def posted(self) -> None:  # noqa: B027  (a backend that can pause inside a request says so)
        """Weights were posted while a request runs (the rollout actor's ``post``, on another
        thread): a backend that can take them inside the request sooner than at its next
        `boundary` arranges it here (``vllm``: between two decoding steps); they are loaded
        on the request's thread either way."""

    def close(self) -> None:  # noqa: B027  (a backend with processes of its own ends them)
        """Free what the engine holds."""
