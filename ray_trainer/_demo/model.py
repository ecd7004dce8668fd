"""Workers and eval tasks: a small causal transformer in plain torch (the demo's model).

It follows the Hugging Face causal-LM calling convention that the training loop relies on:
``model(input_ids, labels=None, attention_mask=None)`` returns an object with ``.loss`` (``None``
without labels) and ``.logits``; ``labels`` are aligned with ``input_ids`` and the model shifts them
internally, so position ``t`` predicts token ``t + 1``; label ``-100`` takes no loss.

Runs wherever it is called: in the driver (to build it), in every training worker, and in
evaluation tasks. It holds no global state; its initialisation draws from torch's default RNG, so
seed torch before building it for a reproducible model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass
class TinyLMConfig:
    """Shape of a :class:`TinyCausalLM`.

    Args:
        vocab_size: number of token ids.
        max_len: longest sequence the position embedding covers.
        d_model: width of the residual stream; must be divisible by ``n_heads``.
        n_layers: number of transformer blocks.
        n_heads: attention heads per block.
        dropout: dropout probability (embeddings, attention output, MLP output).
        tie_weights: share the token embedding with the output head.
        mlp_ratio: hidden width of the MLP as a multiple of ``d_model``.
    """

    vocab_size: int = 16
    max_len: int = 32
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    dropout: float = 0.0
    tie_weights: bool = True
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TinyLMConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TinyLMConfig.d_model ({self.d_model}) must be divisible by n_heads "
                f"({self.n_heads}); pick e.g. n_heads={_largest_divisor(self.d_model, 8)}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"TinyLMConfig.dropout must be in [0, 1), got {self.dropout!r}")

    def parameter_count(self) -> int:
        """The parameters :class:`TinyCausalLM` holds with this shape (the embeddings, each
        block's attention, MLP and LayerNorms, the final LayerNorm, the head unless tied),
        counted without building it: what a setting like ``d_model=10**8`` would ask for."""
        d, hidden = self.d_model, self.mlp_ratio * self.d_model
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (2 * d * hidden + hidden + d)
        head = 0 if self.tie_weights else d * self.vocab_size
        return (self.vocab_size + self.max_len) * d + self.n_layers * block + 2 * d + head


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, at_most + 1) if n % d == 0)


@dataclass
class CausalLMOutput:
    """What :meth:`TinyCausalLM.forward` returns, shaped like Hugging Face's ``CausalLMOutput``."""

    loss: torch.Tensor | None
    logits: torch.Tensor


class _CausalSelfAttention(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # [B, T, C] -> [B, H, T, C/H]
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        drop = self.dropout if self.training else 0.0
        if attn_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True)
        else:
            # attn_mask already combines causality with key padding.
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=drop)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class _Block(nn.Module):
    def __init__(self, cfg: TinyLMConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = _CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        hidden = cfg.mlp_ratio * cfg.d_model
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, hidden),
            nn.GELU(),
            nn.Linear(hidden, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), attn_mask)
        return x + self.mlp(self.ln2(x))


class TinyCausalLM(nn.Module):
    """A small pre-LayerNorm causal transformer language model.

    Token and learned position embeddings, ``n_layers`` blocks of causal self-attention
    (``scaled_dot_product_attention``) and a GELU MLP, a final LayerNorm and a linear head, tied
    to the token embedding when ``config.tie_weights``.

    Args:
        config: the model's shape; see :class:`TinyLMConfig`.

    Example:
        >>> torch.manual_seed(0)
        >>> model = TinyCausalLM(TinyLMConfig(vocab_size=14, max_len=16))
        >>> out = model(torch.tensor([[2, 3, 12, 4, 13]]), labels=torch.tensor([[-100] * 4 + [5]]))
        >>> out.logits.shape, out.loss.ndim
        (torch.Size([1, 5, 14]), 0)
    """

    def __init__(self, config: TinyLMConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(_Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual projections down with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layers) ** 0.5)
        if config.tie_weights:
            self.head.weight = self.tok_emb.weight

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self) -> int:
        """Number of distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        num_items_in_batch: float | torch.Tensor | None = None,
    ) -> CausalLMOutput:
        """Logits for every position and, with ``labels``, the mean next-token loss (with
        ``num_items_in_batch``, as Hugging Face models take it: the summed loss divided by it).

        ``attention_mask`` (1 = real token, 0 = padding) matters only for left or inner padding:
        with right padding causality already keeps real tokens from seeing the padding.
        """
        t = input_ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(
                f"sequence length {t} exceeds TinyLMConfig.max_len={self.config.max_len}; "
                "truncate the input or build the model with a larger max_len"
            )
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        mask = _attention_bias(attention_mask, t)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.ln_f(x))
        loss = None if labels is None else causal_lm_loss(logits, labels, num_items_in_batch)
        return CausalLMOutput(loss=loss, logits=logits)


def _attention_bias(attention_mask: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """A boolean [B, 1, T, T] mask, or None when plain causal attention is enough."""
    if attention_mask is None:
        return None
    keep = attention_mask.bool()
    # Right padding (every row is 1...1 0...0) needs nothing beyond causality: this is the common
    # case and keeps the fast fused path. The check is a CPU-GPU sync point on an accelerator.
    if bool((keep[:, 1:] <= keep[:, :-1]).all()):
        return None
    causal = torch.ones(t, t, dtype=torch.bool, device=keep.device).tril()
    mask = causal[None, None] & keep[:, None, None, :]
    # A query at a padding position could otherwise see no key at all, which gives NaN; let every
    # position see itself (its output is padding and takes no loss anyway).
    return mask | torch.eye(t, dtype=torch.bool, device=keep.device)[None, None]


def causal_lm_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    num_items_in_batch: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Cross entropy of ``logits[:, t]`` against ``labels[:, t + 1]``, skipping ``-100``: the
    mean over the labelled tokens, or their sum divided by ``num_items_in_batch`` when given.

    A batch with no labelled token gives a zero loss that still has a gradient path, rather than
    NaN, so that one empty batch cannot poison a data-parallel all-reduce.
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    count = (shift_labels != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


@torch.no_grad()
def generate_greedy(
    model: nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    eos_id: int,
    prompt_lengths: torch.Tensor | list[int] | None = None,
) -> list[list[int]]:
    """Greedy continuation of each prompt in a batch; returns the new token ids of each row.

    ``input_ids`` is ``[B, T]``; prompts of different lengths may be right-padded, with
    ``prompt_lengths`` giving each row's real length (default: every row is ``T`` long). Each row
    stops at ``eos_id`` (not included in the result) or after ``max_new_tokens`` tokens, or when
    the model's ``max_len`` is reached. The whole sequence is re-run at each step (no KV cache):
    fine for the short sequences of the demo. Does not change ``model.training``; call it under
    ``model.eval()`` for deterministic output.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    b, t = input_ids.shape
    device = input_ids.device
    if prompt_lengths is None:
        lengths = torch.full((b,), t, dtype=torch.long, device=device)
    else:
        lengths = torch.as_tensor(prompt_lengths, dtype=torch.long, device=device).clone()
    # Look through a DistributedDataParallel wrapper for the config.
    inner = getattr(model, "module", model)
    config = getattr(model, "config", None) or getattr(inner, "config", None)
    max_len = getattr(config, "max_len", None)
    width = int(lengths.max()) + max_new_tokens
    if max_len is not None:
        width = min(width, max_len)
    buf = torch.zeros(b, max(width, t), dtype=torch.long, device=device)
    buf[:, :t] = input_ids
    rows = torch.arange(b, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    out: list[list[int]] = [[] for _ in range(b)]
    for _ in range(max_new_tokens):
        active = ~done & (lengths < width)
        if not bool(active.any()):
            break
        cur = int(lengths[active].max())
        # Right padding after a row's end does not affect it: attention is causal.
        logits = model(buf[:, :cur]).logits
        nxt = logits[rows, (lengths - 1).clamp(max=cur - 1)].argmax(dim=-1)
        stop = active & (nxt == eos_id)
        grow = active & ~stop
        buf[rows[grow], lengths[grow]] = nxt[grow]
        for i in grow.nonzero().flatten().tolist():
            out[i].append(int(nxt[i]))
        lengths = lengths + grow.long()
        done |= stop
    return out
