"""Workers and eval tasks: the demo task, multi-digit addition written as text.

Everything here is generated from a seed, so the demo needs no download. Datasets are built in
the driver and shipped to the workers (they are small tensors); :func:`exact_match` runs wherever
evaluation runs (a training worker or an evaluation task) and touches only the model it is given.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils.data import Dataset

from .model import IGNORE_INDEX, generate_greedy

_SPLITS = ("train", "val")


class CharTokenizer:
    """Character tokenizer for addition strings: pad, eos, the ten digits, ``+`` and ``=``.

    Example:
        >>> tok = CharTokenizer()
        >>> tok.decode(tok.encode("12+3=15", add_eos=True))
        '12+3=15'
    """

    SYMBOLS = "0123456789+="

    def __init__(self) -> None:
        self.pad_id = 0
        self.eos_id = 1
        self._to_id = {ch: i + 2 for i, ch in enumerate(self.SYMBOLS)}
        self._to_ch = {i: ch for ch, i in self._to_id.items()}

    @property
    def vocab_size(self) -> int:
        return len(self.SYMBOLS) + 2

    def encode(self, text: str, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``; raises ``ValueError`` on a character outside the vocabulary."""
        try:
            ids = [self._to_id[ch] for ch in text]
        except KeyError as err:
            raise ValueError(
                f"CharTokenizer cannot encode {err.args[0]!r} in {text!r}; "
                f"it knows only {self.SYMBOLS!r}"
            ) from None
        return [*ids, self.eos_id] if add_eos else ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; pad and eos are dropped, or shown as ``<pad>``/``<eos>``."""
        out = []
        for i in ids:
            i = int(i)
            if i in self._to_ch:
                out.append(self._to_ch[i])
            elif not skip_special_tokens:
                out.append("<pad>" if i == self.pad_id else "<eos>" if i == self.eos_id else "?")
        return "".join(out)


def _is_val_pair(a: int, b: int, val_fraction: float) -> bool:
    """Route a pair to a split by a hash of its text: stable across seeds, sizes and processes."""
    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=8, key=b"ray-trainer").digest()
    return int.from_bytes(digest, "little") % 1_000_000 < val_fraction * 1_000_000


class AdditionDataset(Dataset):
    """Generated ``a+b=c<eos>`` examples, padded to one fixed length.

    Each item is ``{"input_ids": LongTensor[T], "labels": LongTensor[T]}`` with
    ``T = 3 * digits + 4``; the labels are ``-100`` on the prompt ``"a+b="`` and on the padding, so
    the loss is taken only on the answer digits and the EOS. Operand lengths are drawn uniformly
    from ``1..digits``, so short and long sums are equally common. Every ``(a, b)`` pair belongs to
    exactly one split (by a hash of the pair), so train and val never share a pair, whatever the
    seeds and sizes. The same arguments always give the same items.

    Args:
        n_samples: number of examples (pairs may repeat within a split).
        digits: the largest operand length.
        seed: the sampling seed.
        split: ``"train"`` or ``"val"``.
        val_fraction: share of all pairs that belong to ``"val"``.

    Example:
        >>> ds = AdditionDataset(100, digits=2, split="val")
        >>> ds.prompt(0) + ds.answer(0) == ds.tokenizer.decode(ds[0]["input_ids"])
        True
    """

    def __init__(
        self,
        n_samples: int,
        digits: int = 3,
        seed: int = 0,
        split: str = "train",
        val_fraction: float = 0.1,
    ) -> None:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if not 1 <= digits <= 9:
            raise ValueError(f"digits must be between 1 and 9, got {digits}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.tokenizer = CharTokenizer()
        self.digits = digits
        self.split = split
        self.seq_len = 3 * digits + 4
        rng = random.Random(f"addition:{seed}:{split}:{digits}")
        want_val = split == "val"
        self.pairs: list[tuple[int, int]] = []
        while len(self.pairs) < n_samples:
            a, b = _operand(rng, digits), _operand(rng, digits)
            if _is_val_pair(a, b, val_fraction) == want_val:
                self.pairs.append((a, b))

        # Build plain lists and convert once: per-row tensor writes are ~10x slower.
        pad = self.tokenizer.pad_id
        rows, label_rows, prompt_lengths = [], [], []
        for i in range(n_samples):
            prompt = self.tokenizer.encode(self.prompt(i))
            answer = self.tokenizer.encode(self.answer(i), add_eos=True)
            fill = self.seq_len - len(prompt) - len(answer)
            rows.append(prompt + answer + [pad] * fill)
            label_rows.append([IGNORE_INDEX] * len(prompt) + answer + [IGNORE_INDEX] * fill)
            prompt_lengths.append(len(prompt))
        input_ids = torch.tensor(rows, dtype=torch.long)
        labels = torch.tensor(label_rows, dtype=torch.long)
        prompt_lengths = torch.tensor(prompt_lengths, dtype=torch.long)
        self.input_ids = input_ids
        self.labels = labels
        self.prompt_lengths = prompt_lengths

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}

    def prompt(self, i: int) -> str:
        """The question of item ``i``, e.g. ``"123+45="``."""
        a, b = self.pairs[i]
        return f"{a}+{b}="

    def answer(self, i: int) -> str:
        """The true answer of item ``i``, e.g. ``"168"`` (without EOS)."""
        a, b = self.pairs[i]
        return str(a + b)


def _operand(rng: random.Random, digits: int) -> int:
    length = rng.randint(1, digits)
    low = 0 if length == 1 else 10 ** (length - 1)
    return rng.randint(low, 10**length - 1)


def exact_match(
    model: nn.Module,
    dataset: AdditionDataset,
    n: int | None = None,
    device: str | torch.device | None = None,
    batch_size: int = 256,
) -> float:
    """Share of the first ``n`` items whose greedy answer equals the true sum exactly.

    The model sees only the prompt ``"a+b="`` and decodes greedily until EOS; an answer counts
    only if its digits match and it then stops. Runs in the calling process under
    ``torch.no_grad()`` with the model in eval mode, and restores the model's previous mode.
    ``device`` defaults to the device of the model's parameters.
    """
    n = len(dataset) if n is None else min(n, len(dataset))
    if n < 1:
        raise ValueError("exact_match needs at least one item")
    if device is None:
        device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    # An answer has at most digits + 1 characters; one more slot lets a model that does not stop
    # produce a longer (wrong) answer instead of being cut off at the right length.
    max_new = dataset.digits + 2
    try:
        with torch.no_grad():
            for start in range(0, n, batch_size):
                stop = min(start + batch_size, n)
                lengths = dataset.prompt_lengths[start:stop]
                width = int(lengths.max())
                ids = dataset.input_ids[start:stop, :width].clone()
                # Blank everything after each prompt so the model cannot see the answer.
                ids[torch.arange(width)[None, :] >= lengths[:, None]] = dataset.tokenizer.pad_id
                generated = generate_greedy(
                    model,
                    ids.to(device),
                    max_new_tokens=max_new,
                    eos_id=dataset.tokenizer.eos_id,
                    prompt_lengths=lengths.to(device),
                )
                for i, tokens in zip(range(start, stop), generated, strict=True):
                    correct += tokens == dataset.tokenizer.encode(dataset.answer(i))
    finally:
        model.train(was_training)
    return correct / n
