"""In the rollout actor (or any process holding the engine): the ``"hf"`` rollout engine.

Samples with transformers' ``generate`` from a model built as the trainer builds it (its
`ModelSpec`, the same LoRA wrapping), left-padded batches of ``batch_size`` sequences, under a
sampling seed. The log-probs a `Completion` records are taken from ``generate``'s own logits as
it samples (`StepLogprobs`: ``log_softmax(logits / temperature)`` of each step, before top-k and
top-p, at the token sampled there), so sampling costs no second forward; on the same weights they
equal a teacher-forced forward's, the trainer's, to float rounding (within 1e-5 in fp32: the
cached decode adds in another order). The probe (`HfEngine.logprobs`) is a teacher-forced
forward, as the trainer's, so ``rollout/logprob_diff`` is exact in fp32. A LoRA engine keeps its
base and loads each version's adapter, unmerged.
"""

from __future__ import annotations

import inspect
from typing import Any

from ray_trainer._rollout.engine import (
    EngineSpec,
    RolloutEngine,
    SamplingParams,
    sample_rows,
    token_ids,
)
from ray_trainer._rollout.types import Completion
from ray_trainer._rollout.weights import Receiver, WeightSyncError


class HfEngine(RolloutEngine):
    """The ``"hf"`` backend: a Hugging Face causal LM (peft-wrapped for LoRA) in this process.

    Args:
        model: the module to sample from (built by `build`, or given: tests, a colocated run).
        spec: the engine's settings (device, dtype, batch size, end and padding ids).
    """

    backend = "hf"

    def __init__(self, model: Any, spec: EngineSpec | None = None) -> None:
        import torch

        spec = spec or EngineSpec()
        if not callable(getattr(model, "generate", None)):
            raise ValueError(
                f"the 'hf' rollout engine samples with transformers' generate, and "
                f"{type(model).__name__} has none: use a Hugging Face causal LM (a model name "
                "or folder, or a factory returning a transformers model)"
            )
        device = spec.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.spec = spec
        self.device = torch.device(device)
        self.model = model.to(device=self.device, dtype=getattr(torch, spec.dtype)).eval()
        self.model.requires_grad_(False)
        self.lora = spec.lora is not None or hasattr(model, "peft_config")
        self.eos_token_ids = _eos_ids(self.model, spec)
        pad = spec.pad_token_id
        for config in (self.model.generation_config, self.model.config):
            pad = pad if pad is not None else getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else self.eos_token_ids[0])
        # peft's wrapper passes its keyword arguments on to the base model's forward.
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        self._keeps_logits = "logits_to_keep" in inspect.signature(base.forward).parameters
        self._vocab = int(self.model.get_output_embeddings().weight.shape[0])
        self._receiver: Receiver | None = None

    @classmethod
    def build(cls, spec: EngineSpec, state_dict: dict[str, Any] | None = None) -> HfEngine:
        """The engine of `spec`: its model built as the trainer builds it, with `state_dict`'s
        weights instead when given (the base's, for LoRA), wrapped with the adapter for LoRA (its
        base in NF4 first under ``lora.quantize_base``, as the trainer's)."""
        model = spec.model.build_model()
        if state_dict is not None:
            model.load_state_dict(state_dict)
        if spec.lora is not None:
            from ray_trainer._lora.config import quantize_base, wrap

            # QLoRA: the engine samples from the 4-bit base the trainer's adapters sit on.
            quantize_base(model, spec.lora)
            model = wrap(model, spec.lora)
        return cls(model, spec)

    # ---- sampling ------------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        prompt_indices: list[int] | None = None,
    ) -> list[Completion]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        self._check_ready()
        rows = sample_rows(prompts, params, prompt_indices)
        config = GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_new_tokens=params.max_completion_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
        )
        ends = set(self.eos_token_ids)
        sampled: list[tuple[list[int], bool, int]] = []  # completion, truncated, version
        logprobs: list[list[float]] = []
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.inference_mode():
            torch.manual_seed(params.seed)  # the same seed, weights and prompts: the same samples
            for start in range(0, len(rows), self.spec.batch_size):
                self.boundary()  # weights posted meanwhile are taken between batches
                self._check_ready()
                batch = [ids for _, ids in rows[start : start + self.spec.batch_size]]
                width = max(len(ids) for ids in batch)
                pad = [[self.pad_token_id] * (width - len(ids)) + ids for ids in batch]
                mask = [[0] * (width - len(ids)) + [1] * len(ids) for ids in batch]
                steps = StepLogprobs(params.temperature)
                out = self.model.generate(
                    input_ids=torch.tensor(pad, device=self.device),
                    attention_mask=torch.tensor(mask, device=self.device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([steps]),
                )
                picked = steps.of(out[:, width:]).tolist()
                for row, lps in zip(out[:, width:].tolist(), picked, strict=True):
                    completion, truncated = _until_end(row, ends)
                    sampled.append((completion, truncated, self.version))
                    logprobs.append(lps[: len(completion)])
        return [
            Completion(index, ids, completion, lp, truncated, version)
            for (index, ids), (completion, truncated, version), lp in zip(
                rows, sampled, logprobs, strict=True
            )
        ]

    def logprobs(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> list[float]:
        self._check_ready()
        prompt = token_ids(prompt_ids, "probe")
        return self.sequence_logprobs([(prompt, list(completion_ids))], temperature)[0]

    def sequence_logprobs(
        self, pairs: list[tuple[list[int], list[int]]], temperature: float
    ) -> list[list[float]]:
        """Per-token log-probs of each ``(prompt, completion)``: teacher-forced forwards of
        right-padded batches, ``log_softmax(logits / temperature)`` at each completion token,
        the logits kept from the shortest prompt's last position on; a forward's logits stay
        within ``logits_bytes`` (one sequence at least)."""
        import torch

        longest = max((len(p) + len(c) for p, c in pairs), default=1)
        per_row = longest * self._vocab * 4  # fp32 logits of one sequence, at most
        rows = max(1, min(self.spec.batch_size, self.spec.logits_bytes // per_row))
        out: list[list[float]] = []
        with torch.inference_mode():
            for start in range(0, len(pairs), rows):
                chunk = pairs[start : start + rows]
                seqs = [p + c for p, c in chunk]
                width = max(len(s) for s in seqs)
                ids = torch.tensor(
                    [s + [self.pad_token_id] * (width - len(s)) for s in seqs], device=self.device
                )
                mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
                keep = width - min(len(p) for p, _ in chunk) + 1
                extra = {"logits_to_keep": keep} if self._keeps_logits else {}
                logits = self.model(
                    input_ids=ids, attention_mask=mask.to(self.device), **extra
                ).logits
                first = width - logits.shape[1]  # the position of logits[:, 0]
                for row, (prompt, completion) in enumerate(chunk):
                    at = len(prompt) - 1 - first
                    scores = logits[row, at : at + len(completion)].float() / temperature
                    target = torch.tensor(completion, device=self.device).unsqueeze(-1)
                    picked = torch.log_softmax(scores, dim=-1).gather(-1, target).squeeze(-1)
                    out.append(picked.tolist())
        return out

    # ---- weights -------------------------------------------------------------------------------

    def receiver(self) -> Receiver:
        """A LoRA engine receives its adapter only (its base stays); else every weight."""
        if self._receiver is None:
            named = dict(self.model.named_parameters())
            if self.lora:
                adapter = {n: p for n, p in named.items() if ".lora_" in n}
                self._receiver = Receiver(adapter, "the LoRA adapter")
            else:
                self._receiver = Receiver(named, "every weight")
        return self._receiver

    def _check_ready(self) -> None:
        if self._receiver is not None and self._receiver.syncing:
            raise WeightSyncError(
                f"the weights of version {self._receiver.pending} are being synced (or their "
                "sync failed half way): finish that sync, or start a new one, before sampling"
            )


class StepLogprobs:
    """A logits processor for ``generate`` (in its list, ahead of its warpers): each step's
    ``log_softmax(logits / temperature)``, kept until the next step shows which token was
    sampled from it; `of` gathers the last one. One step's distribution is held at a time."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.picked: list[Any] = []  # per step, [rows]: the log-prob of the token sampled there
        self._pending: Any = None  # the last step's log-probs [rows, vocab], token not yet seen

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        if self._pending is not None:  # input_ids ends with the token sampled from it
            self.picked.append(self._pending.gather(-1, input_ids[:, -1:])[:, 0])
        self._pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def of(self, sampled: Any) -> Any:
        """``[rows, steps]``: the log-prob of each token of `sampled` (``generate``'s new
        tokens); a step ``generate`` undid after sampling is left out."""
        import torch

        steps = sampled.shape[1]
        if len(self.picked) < steps and self._pending is not None:
            at = len(self.picked)
            self.picked.append(self._pending.gather(-1, sampled[:, at : at + 1])[:, 0])
            self._pending = None
        if len(self.picked) < steps:
            raise RuntimeError(
                f"generate sampled {steps} tokens a row but its logits processor saw "
                f"{len(self.picked)} steps: the log-probs of the rest are unknown"
            )
        if steps == 0:
            return torch.zeros((sampled.shape[0], 0))
        return torch.stack(self.picked[:steps], dim=1)


def _eos_ids(model: Any, spec: EngineSpec) -> list[int]:
    """The ids that end a completion: the spec's, else every one the model's generation
    config (then its config) declares, as TRL takes them."""
    ids: Any = spec.eos_token_ids
    for config in (model.generation_config, model.config):
        ids = ids if ids is not None else getattr(config, "eos_token_id", None)
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if not ids:
        raise ValueError(
            "the rollout engine does not know which token ends a completion: the model's "
            "config names no eos_token_id; set EngineSpec(eos_token_ids=[...])"
        )
    return [int(i) for i in ids]


def _until_end(row: list[int], ends: set[int]) -> tuple[list[int], bool]:
    """The completion up to and including its first end token; truncated when it has none."""
    for at, token in enumerate(row):
        if token in ends:
            return row[: at + 1], False
    return row, True
