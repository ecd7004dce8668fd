"""bench_memory's loss phase (``--phases loss``): a long sequence's peak memory with the chunked
loss against the model's own full-logits loss.

One process per configuration (spawned, one rank: the logits are per rank), which builds a
Llama-shaped model (hidden 256, 2 layers, MLP 1024, 4 heads, a 128,256-token vocabulary as
Llama 3's, untied head: 66M parameters, nearly all in the embedding and the head), takes the
runner's AdamW and trains 2 steps on one sequence of fixed length in which every position takes
the loss (the most logits there can be). "Added" is the peak of the process's anonymous memory
(``RssAnon``, sampled every millisecond) during those steps above its own before them, so what
the model and the optimizer hold is not counted. Lengths 1k to 8k tokens with the chunked loss;
the full-logits loss up to 4k (at 8k its logits and their gradient alone are 8 GiB in fp32, over
what this machine leaves a benchmark). Each process runs with ``MALLOC_MMAP_THRESHOLD_=1 MiB``
(see `_in_process`), so that what is freed leaves RssAnon. At 1k tokens, the step time of other
chunk sizes against the default's: tiny chunks must not slow the step.

Figures: each length's added peak both ways; the rise from 1k to the longest length both ran,
as a multiple of the full fp32 logits' growth over the same lengths (target: chunked <= 0.3x;
the issue measured 3.85x for the full loss); the longest length whose added peak stays within
the full loss's at 2k (target: at least 2x 2k); the step time both ways. And from the demo
chat data rendered with a chat template, with the loss on the assistant's tokens: the share of
positions that needed logits at all.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from _memory_load import AnonPeak, anon_bytes
from _support import table

VOCAB = 128_256
LLAMA = {
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}  # fmt: skip
LENGTHS = (1024, 2048, 4096, 8192)
FULL_LENGTHS = (1024, 2048, 4096)
BUDGET_LENGTH = 2048  # the budget: the full loss's added peak at this length
RISE_TARGET, LENGTH_TARGET = 0.3, 2.0
MiB = 2**20
MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
SWEEP_LENGTH, SWEEP_CHUNKS = 1024, (16, 64, 1024)  # step time against the default chunk


def loss_steps(length: int, chunked: bool, steps: int, chunk: int | None = None) -> dict[str, Any]:
    """One configuration, in its own process: added peak and step times."""
    import torch
    import transformers

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.assemble import _optimizer
    from ray_trainer._worker.model.chunked_loss import default_chunk_size, use_chunked_loss

    torch.manual_seed(0)
    torch.set_num_threads(2)
    model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**LLAMA, attn_implementation="sdpa")
    )
    if chunked:
        assert use_chunked_loss(model, chunk) is None
    args = TrainingArgs(mixed_precision="no")
    optimizer = _optimizer(model, args, torch.device("cpu"))
    ids = torch.randint(VOCAB, (1, length), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    base = anon_bytes()
    sampler = AnonPeak()
    sampler.start()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        out = model(**batch, num_items_in_batch=float(length - 1))
        loss = out["loss"] if isinstance(out, dict) else out.loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del out, loss
        times.append(time.perf_counter() - started)
    peak = sampler.stop()
    size = getattr(model, "_ray_trainer_chunk_size", None) or default_chunk_size(VOCAB, "cpu")
    return {"length": length, "chunked": chunked, "chunk": size if chunked else None,
            "added": max(0, peak - base), "step_s": statistics.median(times[1:] or times)}  # fmt: skip


def _in_process(length: int, chunked: bool, steps: int, chunk: int | None = None) -> dict[str, Any]:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    # glibc's malloc returns a freed block of 1 MiB or more to the system at once; by default
    # its threshold rises to 32 MiB after such frees, and a chunk's freed logits then stay in
    # the process's heap, counted in RssAnon though free (on a GPU, torch's caching allocator
    # reuses them). Read at the child's start.
    before = os.environ.get(MMAP_THRESHOLD)
    os.environ[MMAP_THRESHOLD] = str(MiB)
    try:
        with ctx.Pool(1) as pool:  # a fresh process: its peak is this configuration's alone
            return pool.apply(loss_steps, (length, chunked, steps, chunk))
    finally:
        if before is None:
            del os.environ[MMAP_THRESHOLD]
        else:
            os.environ[MMAP_THRESHOLD] = before


def assistant_share(n: int = 200) -> dict[str, Any]:
    """Of the demo chat data rendered with a ChatML template, loss on the assistant's tokens:
    how many positions have a target (need logits) out of all."""
    import tempfile

    from ray_trainer._data.encode import Encoder
    from ray_trainer._demo.chat import chat_conversations, make_tiny_chat_model

    with tempfile.TemporaryDirectory() as folder:
        path = make_tiny_chat_model(folder, style="chatml")
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
        encoder = Encoder(tokenizer, train_on="assistant", max_length=2048)
        positions = targets = 0
        for messages in chat_conversations(n, seed=0):
            encoded = encoder.encode({"messages": messages}, "messages")
            positions += len(encoded.input_ids)
            targets += encoded.num_labels
    return {"conversations": n, "positions": positions, "targets": targets,
            "share": targets / positions}  # fmt: skip


def summarise_loss(
    rows: list[dict[str, Any]], share: dict[str, Any], sweep: list[dict[str, Any]]
) -> dict[str, Any]:
    """The phase's table and ratios from every configuration's figures (pure)."""
    by = {(r["length"], r["chunked"]): r for r in rows}
    default = by[(SWEEP_LENGTH, True)]
    sweep_rows = [
        {"chunk (positions)": r["chunk"], "added (MiB)": round(r["added"] / MiB),
         "step (s)": round(r["step_s"], 2), "vs default": round(r["step_s"] / default["step_s"], 2)}
        for r in sorted([*sweep, default], key=lambda r: r["chunk"])
    ]  # fmt: skip
    longest = max(length for length in FULL_LENGTHS if (length, True) in by)
    short = min(FULL_LENGTHS)
    logits_growth = (longest - short) * VOCAB * 4  # the full fp32 logits' growth
    rise_full = (by[(longest, False)]["added"] - by[(short, False)]["added"]) / logits_growth
    rise_chunked = (by[(longest, True)]["added"] - by[(short, True)]["added"]) / logits_growth
    budget = by[(BUDGET_LENGTH, False)]["added"]
    fits = [n for n in LENGTHS if (n, True) in by and by[(n, True)]["added"] <= budget]
    fitting = max(fits, default=0)
    table_rows = []
    for length in LENGTHS:
        full, chunked = by.get((length, False)), by.get((length, True))
        table_rows.append({
            "tokens": length,
            "fp32 logits (MiB)": round(length * VOCAB * 4 / MiB),
            "added, full loss (MiB)": round(full["added"] / MiB) if full else "not run",
            "added, chunked (MiB)": round(chunked["added"] / MiB) if chunked else "not run",
            "step, full (s)": round(full["step_s"], 2) if full else "",
            "step, chunked (s)": round(chunked["step_s"], 2) if chunked else "",
        })  # fmt: skip
    ratios = {
        "loss_rise_full_x_logits": rise_full,
        "loss_rise_chunked_x_logits": rise_chunked,
        "loss_length_at_budget_x": fitting / BUDGET_LENGTH,
        "assistant_target_share": share["share"],
        **{f"loss_chunk_{r['chunk']}_step_x": r["step_s"] / default["step_s"] for r in sweep},
    }
    text = (
        table(table_rows)
        + f"\n\nrise of the added peak from {short} to {longest} tokens, as a multiple of the "
        f"full fp32 logits' growth: full loss {rise_full:.2f}x, chunked {rise_chunked:.3f}x "
        f"(target <= {RISE_TARGET}x: {'met' if rise_chunked <= RISE_TARGET else 'NOT met'})"
        f"\nlongest length within the full loss's added peak at {BUDGET_LENGTH} tokens "
        f"({budget / MiB:.0f} MiB): {fitting} tokens, {fitting / BUDGET_LENGTH:.1f}x (target >= "
        f"{LENGTH_TARGET}x: {'met' if fitting / BUDGET_LENGTH >= LENGTH_TARGET else 'NOT met'})"
        f"\nchat data, loss on the assistant's tokens: {share['targets']:,} of "
        f"{share['positions']:,} positions need logits ({share['share']:.1%}; "
        f"{share['conversations']} conversations of the demo chat data, ChatML)"
        f"\n\nchunk size at {SWEEP_LENGTH} tokens (default {default['chunk']}):\n"
        + table(sweep_rows)
    )
    return {"table": text, "ratios": ratios, "rows": rows, "share": share, "sweep": sweep}


def run_loss_phase(steps: int = 2, quick: bool = False) -> dict[str, Any]:
    lengths = LENGTHS[:2] if quick else LENGTHS
    rows = []
    for length in lengths:
        rows.append(_in_process(length, True, steps))
        if length in FULL_LENGTHS:
            rows.append(_in_process(length, False, steps))
    sweep = [_in_process(SWEEP_LENGTH, True, steps, chunk) for chunk in SWEEP_CHUNKS]
    return summarise_loss(rows, assistant_share(), sweep)
