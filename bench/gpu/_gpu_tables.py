"""Tables 2 to 8 of bench_gpu.py: sharding, packing, LoRA, saves, long sequences, DPO, evals.

Each `table_N(cpu)` returns ``{"table": markdown, "figures": {...}}``; with ``cpu=True`` it runs
the same code on tiny shapes (a smoke run of the script: its figures mean nothing). Every table
runs its own baseline in the same call. A table whose feature has not landed returns
``{"skipped": why}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
import time
from typing import Any

from _support import table

from callbacks import TrainerCallback

GiB = 2**30


class Probe(TrainerCallback):
    """Rank 0, in the training process: each step's begin and end, each log's loss and
    metrics, and the device's peak allocated memory; written to `path` at the end."""

    runs_on = "rank0"

    def __init__(self, path: str) -> None:
        self.path = path
        self.begins: list[float] = []
        self.ends: list[float] = []
        self.logs: list[dict[str, Any]] = []

    def on_train_begin(self, context, **kwargs):
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def on_step_begin(self, context, **kwargs):
        self.begins.append(time.perf_counter())

    def on_step_end(self, context, **kwargs):
        self.ends.append(time.perf_counter())

    def on_log(self, context, **kwargs):
        self.logs.append({"step": context.global_step, "loss": context.loss,
                          **dict(context.batch_metrics or {})})  # fmt: skip

    def on_train_end(self, context, **kwargs):
        import torch

        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
        with open(self.path, "w") as f:
            json.dump({"begins": self.begins, "ends": self.ends, "logs": self.logs,
                       "peak_bytes": peak}, f)  # fmt: skip


def train(fields: dict[str, Any], skip: int) -> dict[str, Any]:
    """One `run_training` with a `Probe`; its mean step time over the steps after `skip`, its
    peak device memory, its losses by step and the median tokens/s of its logs after `skip`."""
    from ray_trainer import run_training

    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        out = os.path.join(tmp, "probe.json")
        run_training(**{"storage_path": os.path.join(tmp, "runs"), "save_at_end": False,
                        **fields, "callbacks": [Probe(out), *fields.get("callbacks", [])]})  # fmt: skip
        with open(out) as f:
            probe = json.load(f)
    begins = probe["begins"]
    window = begins[skip:]
    late = [m for m in probe["logs"] if m["step"] > skip and "tokens_per_s" in m]
    return {
        "step_s": (window[-1] - window[0]) / max(len(window) - 1, 1),
        "peak_bytes": probe["peak_bytes"],
        "losses": {m["step"]: m["loss"] for m in probe["logs"]},
        "tokens_per_s": statistics.median(m["tokens_per_s"] for m in late) if late else None,
        "padding_share": statistics.mean(m.get("padding_share", 0.0) for m in late) if late else None,
        "clock": {"begins": begins, "ends": probe["ends"]},
    }  # fmt: skip


def _device_fields(cpu: bool) -> dict[str, Any]:
    return {"num_workers": 1, "use_gpu": not cpu, "mixed_precision": "no" if cpu else "bf16"}


def _token_fields(cpu: bool, make: Any, shape: dict[str, int], steps: int) -> dict[str, Any]:
    """A one-worker run of `steps` steps of `make()` on random tokens of `shape`."""
    from _gpu_shapes import TokenDataset

    return {
        **_device_fields(cpu),
        "model": make,
        "data": lambda: TokenDataset(shape, steps * shape["batch"]),
        "batch_size": shape["batch"],
        "max_steps": steps,
        "lr_schedule": "constant",
    }


# ---- table 2: FSDP against DDP --------------------------------------------------------------


def table_2(cpu: bool, model: str = "gpt2") -> dict[str, Any]:
    """FSDP (one rank, nccl) against DDP: bf16, compile=True, activation checkpointing. Target:
    FSDP's step at most 1.05x DDP's. `model`: ``"gpt2"``, the GPT-2 124M shape of table 1 (12
    blocks, a ~30 ms step: FSDP2's host time of 1.3-1.9 ms a block a step, measured on the CPU
    by `fsdp_host.py`, may exceed its GPU time); ``"llama1b"``, table 4's 1.1B Llama shape (22
    blocks of width 2,048, sequence 1,024, batch 8: each block's GPU time well above that host
    time, the size FSDP is for)."""
    from _gpu_shapes import FULL, TINY, make_model

    if model == "llama1b":
        config = LLAMA_TINY if cpu else LLAMA_1B
        shape = {
            "vocab": config["vocab_size"],
            "seq": 64 if cpu else 1024,
            "batch": 2 if cpu else 8,
        }
        make = lambda: make_llama(config)  # noqa: E731
        steps, skip = (8, 3) if cpu else (60, 20)
        what = (f"Llama shape ({config['num_hidden_layers']} blocks, width "
                f"{config['hidden_size']})")  # fmt: skip
    elif model == "gpt2":
        shape = TINY if cpu else FULL
        make = lambda: make_model(shape)  # noqa: E731
        steps, skip = (12, 4) if cpu else (120, 40)
        what = f"GPT-2 shape ({shape['n_layer']} blocks, width {shape['n_embd']})"
    else:
        raise ValueError(f"table 2's model: {model!r}; known: 'gpt2', 'llama1b'")
    common = {
        **_token_fields(cpu, make, shape, steps),
        "compile": True,
        "activation_checkpointing": True,
        "log_every_steps": skip if not cpu else 4,
    }
    runs = {}
    for strategy in ("ddp", "fsdp"):
        runs[strategy] = train({**common, "strategy": strategy}, skip)
        print(f"table 2, {strategy}: {runs[strategy]['step_s'] * 1e3:.1f} ms/step", flush=True)
    base = runs["ddp"]
    rows = [
        {
            "configuration": f"{s.upper()}, bf16, compile, activation checkpointing"
            + (" (baseline)" if s == "ddp" else ""),
            "step (ms)": f"{r['step_s'] * 1e3:.1f}",
            "tokens/s": f"{shape['batch'] * shape['seq'] / r['step_s']:,.0f}",
            "peak allocated (GiB)": f"{r['peak_bytes'] / GiB:.2f}",
            "step vs DDP": f"{r['step_s'] / base['step_s']:.3f}",
        }
        for s, r in runs.items()
    ]
    ratio = runs["fsdp"]["step_s"] / base["step_s"]
    head = (
        f"{what}, sequence {shape['seq']}, batch {shape['batch']}, one worker; mean step over "
        f"steps {skip}-{steps}."
    )
    verdict = f"target FSDP step / DDP step <= 1.05: {ratio:.3f} ({'met' if ratio <= 1.05 else 'NOT met'})"
    return {"table": "\n\n".join([head, table(rows), verdict]), "model": model,
            "figures": {"fsdp_vs_ddp_step": ratio,
                        **{f"{s}_step_s": r["step_s"] for s, r in runs.items()},
                        **{f"{s}_peak_bytes": r["peak_bytes"] for s, r in runs.items()}}}  # fmt: skip


# ---- table 3: packed against padded -------------------------------------------------------


def table_3(cpu: bool) -> dict[str, Any]:
    """Non-padding tokens/s packed against padded on bench_packing's data (log-normal chat
    lengths, the longest 2,048), one GPU, bf16, eager; and the bf16 loss of the same steps in
    both (the same samples in each step, the same initial weights)."""
    import bench_packing
    from transformers import AutoTokenizer

    from ray_trainer._demo.chat import make_tiny_chat_model

    n, steps, skip = (60, 8, 2) if cpu else (800, 60, 15)
    work = tempfile.mkdtemp(prefix="bench_gpu_packing_")
    size = {"hidden_size": 64, "num_layers": 2} if cpu else {
        "hidden_size": 1024, "num_layers": 12, "num_heads": 16, "vocab_size": 8192}  # fmt: skip
    model = str(make_tiny_chat_model(os.path.join(work, "model"), **size))
    tokenizer = AutoTokenizer.from_pretrained(model)
    data, lengths, max_tokens = bench_packing.write_chat_data(tokenizer, n, work)
    common = {
        **_device_fields(cpu),
        "model": model,
        "data": data,
        "max_length": bench_packing.MAX_LENGTH,
        "batch_size": bench_packing.BATCH,
        "max_steps": steps,
        "log_every_steps": 1,  # every step's loss, for the parity
        "warmup_steps": 0,
        "learning_rate": 1e-4,
    }
    runs = {
        "padded": train(common, skip),
        "packed": train({**common, "packing": True, "max_tokens_per_batch": max_tokens}, skip),
    }
    base = runs["padded"]["tokens_per_s"]
    rows = packing_rows(runs, {"padded": "padded batches (baseline)", "packed": "packed"})
    padded, packed = runs["padded"]["losses"], runs["packed"]["losses"]
    compared = sorted(set(padded) & set(packed))[:10]
    first = abs(packed[compared[0]] - padded[compared[0]]) / abs(padded[compared[0]])
    worst = max(abs(packed[s] - padded[s]) / abs(padded[s]) for s in compared)
    tolerance = 1e-2
    head = (
        f"Qwen2-shaped chat model ({size.get('num_layers')} layers, width {size['hidden_size']}, "
        f"vocabulary {size.get('vocab_size', 1024)}), {n} conversations (tokens median "
        f"{statistics.median(lengths):.0f}, longest {max(lengths)}), {bench_packing.BATCH} "
        f"samples a step, one worker, bf16, eager; max_tokens_per_batch={max_tokens} (the padded "
        f"run's mean positions per micro-batch); tokens/s: the median of the per-step logs after "
        f"step {skip}."
    )
    parity = (
        f"bf16 loss, packed against padded, steps {compared[0]}-{compared[-1]}: relative "
        f"difference {first:.2e} at step {compared[0]}, at most {worst:.2e}; tolerance "
        f"{tolerance:.0e} ({'met' if worst <= tolerance else 'NOT met'})"
    )
    return {"table": "\n\n".join([head, table(rows), parity]),
            "figures": {"packed_vs_padded_tokens_per_s": runs["packed"]["tokens_per_s"] / base,
                        "loss_rel_diff_first": first, "loss_rel_diff_max": worst,
                        "losses": {k: r["losses"] for k, r in runs.items()}}}  # fmt: skip


def packing_rows(runs: dict[str, dict], labels: dict[str, str]) -> list[dict[str, str]]:
    """The rows of a padded (the baseline) against packed table: non-padding tokens/s, the
    ratio to padded, padding share, step time and peak device memory."""
    base = runs["padded"]["tokens_per_s"]
    return [
        {
            "configuration": labels[name],
            "tokens/s (non-padding)": f"{r['tokens_per_s']:,.0f}",
            "vs padded": f"{r['tokens_per_s'] / base:.3f}",
            "padding share": f"{r['padding_share']:.3f}",
            "step (ms)": f"{r['step_s'] * 1e3:.1f}",
            "peak allocated (GiB)": f"{r['peak_bytes'] / GiB:.2f}",
        }
        for name, r in runs.items()
    ]


# ---- table 5: saves, and loading ------------------------------------------------------------


def table_5(cpu: bool) -> dict[str, Any]:
    """The time a step stands still at an asynchronous save against a synchronous one (one
    GPU, a GPT-2 124M shape with AdamW's state: each checkpoint ~1.5 GB); and a pretrained
    Llama-shaped model's load, on the meta device against `from_pretrained`, in host memory."""
    saves = _saves(cpu)
    loads = _loads(cpu)
    return {"table": saves["table"] + "\n\n" + loads["table"],
            "figures": {**saves["figures"], **loads["figures"]}}  # fmt: skip


def _saves(cpu: bool) -> dict[str, Any]:
    from bench_save import boundary_gaps, pause_per_save

    from ray_trainer._demo.tiny_hf import TINY_WORDS
    from ray_trainer.demo import make_tiny_causal_lm

    n_layer, n_embd = (2, 64) if cpu else (12, 768)
    steps, every = (12, 4) if cpu else (60, 20)
    work = tempfile.mkdtemp(prefix="bench_gpu_saves_")
    model = str(make_tiny_causal_lm(os.path.join(work, "gpt2"), n_layer=n_layer, n_embd=n_embd,
                                    n_head=max(2, n_embd // 64), n_positions=64))  # fmt: skip
    data = os.path.join(work, "train.jsonl")
    with open(data, "w") as f:
        for i in range(2000):
            words = [TINY_WORDS[(i * 7 + j) % len(TINY_WORDS)] for j in range(40)]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    common = {**_device_fields(cpu), "model": model, "data": data, "batch_size": 16,
              "max_length": 64, "max_steps": steps, "log_every_steps": 1000}  # fmt: skip
    clocks = {}
    for mode in ("none", "sync", "async"):
        fields = dict(common)
        if mode != "none":
            fields.update(save_every_steps=every, save_at_end=True, async_checkpoint=mode == "async",
                          storage_path=os.path.join(work, f"runs-{mode}"))  # fmt: skip
        clocks[mode] = train(fields, 1)["clock"]
        print(f"table 5, saves {mode}: done", flush=True)
    normal = statistics.median(boundary_gaps(clocks["none"])[:-1])
    rows, pauses = [], {}
    for mode, clock in clocks.items():
        at, later = pause_per_save(boundary_gaps(clock)[:-1], normal, every)
        pauses[mode] = at + later
        step = statistics.median(
            e - b for b, e in zip(clock["begins"], clock["ends"], strict=False)
        )
        rows.append({
            "configuration": {"none": "no saves", "sync": "synchronous saves (baseline)",
                              "async": "async_checkpoint=True"}[mode],
            "step stands still per save (s)": f"{pauses[mode]:.3f}" if mode != "none" else "",
            "of which at the save's step (s)": f"{at:.3f}" if mode != "none" else "",
            "median step (ms)": f"{step * 1e3:.1f}",
        })  # fmt: skip
    ratio = pauses["async"] / pauses["sync"] if pauses["sync"] else float("nan")
    head = (
        f"GPT-2 shape, {n_layer} blocks of width {n_embd}, one worker, bf16, {steps} steps, a "
        f"save every {every} (model, AdamW state, hf/ export) on local disk."
    )
    return {"table": "\n\n".join([head, table(rows), f"pause async / sync: {ratio:.3f}"]),
            "figures": {"save_pause_async_vs_sync": ratio,
                        **{f"save_pause_{m}_s": p for m, p in pauses.items()}}}  # fmt: skip


def _loads(cpu: bool) -> dict[str, Any]:
    import shutil

    from _memory_load import LLAMA, QUICK_LLAMA, MiB, load_rows, save_model, summarise_load
    from bench_memory import run_configuration

    config = QUICK_LLAMA if cpu else LLAMA
    folder = tempfile.mkdtemp(prefix="bench_gpu_model_")
    try:
        model = save_model(folder, config)
        opts = {"path": folder, "vocab_size": config["vocab_size"]}
        results = {}
        for how in ("whole", "meta"):
            results[("ddp", 1, how)] = summarise_load(
                run_configuration("ddp", 1, {**opts, "how": how})
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows, ratios = load_rows(results, model)
    head = (
        f"Loading a pretrained Llama-shaped model ({model['numel'] / 1e6:.0f}M parameters, saved "
        f"in bf16, {model['file_bytes'] / MiB:,.0f} MiB) onto one "
        f"{'CPU worker' if cpu else 'GPU'}: host memory (RssAnon) the load added at its peak."
    )
    return {"table": head + "\n\n" + table(rows), "figures": ratios}


# ---- tables 4, 6, 7, 8 -----------------------------------------------------------------------


LLAMA_1B = {
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}  # fmt: skip  (TinyLlama's)
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


def make_llama(config: dict[str, Any]):
    """A Llama of `config`, seeded (every configuration starts from the same weights)."""
    import torch
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**config, attn_implementation="sdpa")
    )


def table_4(cpu: bool) -> dict[str, Any]:
    """LoRA (r=16 on every linear layer) and QLoRA (the same adapters on an NF4 base, torchao)
    against a full fine-tune of a 1.1B Llama shape (random weights): step time, peak allocated
    memory, tokens/s; one GPU, bf16, eager. Without torchao the QLoRA row says why and is
    skipped; a QLoRA run that fails says so in its row, the other rows kept."""
    from ray_trainer._model.nf4 import QuantizeError, torchao_nf4

    config = LLAMA_TINY if cpu else LLAMA_1B
    shape = {"vocab": config["vocab_size"], "seq": 64 if cpu else 1024, "batch": 2 if cpu else 8}
    steps, skip = (8, 3) if cpu else (60, 20)
    common = {
        **_token_fields(cpu, lambda: make_llama(config), shape, steps),
        "learning_rate": 1e-4,
        "log_every_steps": skip,
    }
    adapters = {"r": 16, "lora_alpha": 32}
    runs = {"full": train(common, skip), "lora": train({**common, "lora": adapters}, skip)}
    try:
        torchao_nf4()
        runs["qlora"] = train({**common, "lora": {**adapters, "quantize_base": "nf4"}}, skip)
        no_qlora = None
    except QuantizeError as e:  # torchao missing: refused before training
        no_qlora = str(e)
    except Exception as e:  # a failed QLoRA run must not lose the rows above
        no_qlora = f"failed: {type(e).__name__}: {str(e)[:300]}"
    print("table 4: done", flush=True)
    params = sum(p.numel() for p in make_llama(config).parameters())
    base, lora = runs["full"], runs["lora"]
    names = {"full": "full fine-tune (baseline)", "lora": "LoRA r=16, every linear",
             "qlora": "QLoRA: LoRA r=16 on an NF4 base"}  # fmt: skip
    rows = [
        {
            "configuration": names[k],
            "step (ms)": f"{r['step_s'] * 1e3:.1f}",
            "tokens/s": f"{shape['batch'] * shape['seq'] / r['step_s']:,.0f}",
            "peak allocated (GiB)": f"{r['peak_bytes'] / GiB:.2f}",
            "step vs full": f"{r['step_s'] / base['step_s']:.3f}",
            "memory vs full": f"{r['peak_bytes'] / max(base['peak_bytes'], 1):.3f}",
            "step vs LoRA": f"{r['step_s'] / lora['step_s']:.3f}",
            "memory vs LoRA": f"{r['peak_bytes'] / max(lora['peak_bytes'], 1):.3f}",
        }
        for k, r in runs.items()
    ]
    if no_qlora:
        rows.append({"configuration": names["qlora"], "step (ms)": f"skipped: {no_qlora}"})
    head = (
        f"Llama shape, {params / 1e9:.2f}B parameters ({config['num_hidden_layers']} layers, width "
        f"{config['hidden_size']}), sequence {shape['seq']}, batch {shape['batch']}, one worker, "
        f"bf16, AdamW; mean step over steps {skip}-{steps}."
    )
    figures = {f"{k}_vs_full_{what}": runs[k][key] / max(base[key], 1e-12)
               for k in runs if k != "full" for what, key in (("step", "step_s"), ("memory", "peak_bytes"))}  # fmt: skip
    if "qlora" in runs:
        figures["qlora_vs_lora_step"] = runs["qlora"]["step_s"] / lora["step_s"]
        figures["qlora_vs_lora_memory"] = runs["qlora"]["peak_bytes"] / max(lora["peak_bytes"], 1)
    else:
        figures["qlora_skipped"] = no_qlora
    figures |= {f"{k}_peak_bytes": r["peak_bytes"] for k, r in runs.items()}
    return {"table": head + "\n\n" + table(rows), "figures": figures}


# ---- table 6: long sequences ---------------------------------------------------------------

LONG = {"vocab_size": 128_256, "hidden_size": 1024, "intermediate_size": 4096,
        "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
        "max_position_embeddings": 131_072, "tie_word_embeddings": False}  # fmt: skip
LONG_TINY = {**LONG, "vocab_size": 4096, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
LONG_BUDGET = 24 * GiB  # the fixed memory every configuration gets


#: Table 6's losses: the model's own from the full logits, the chunked loss, liger-kernel's fused
#: linear cross-entropy (with its RMSNorm, RoPE and SwiGLU: `liger_kernel=True`).
LOSSES = {"full": "full logits (baseline)", "chunked": "chunked", "liger": "liger-kernel"}


def long_steps(config: dict[str, Any], length: int, loss: str, offload: bool, steps: int,
               budget: int | None) -> dict[str, Any]:  # fmt: skip
    """In a fresh process: `steps` training steps on one sequence of `length` tokens (every
    position takes the loss, `loss` one of `LOSSES`), activation checkpointing on, bf16
    autocast, the runner's AdamW; the step time, or "oom" when it does not fit in `budget`
    bytes of the device."""
    import torch

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._worker.assemble import _optimizer
    from ray_trainer._worker.model.chunked_loss import use_chunked_loss
    from ray_trainer._worker.model.offload import ActivationOffload
    from ray_trainer._worker.model.parallel import checkpoint_forward

    gpu = torch.cuda.is_available()
    device = torch.device("cuda" if gpu else "cpu")
    if gpu and budget:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    model = make_llama(config).to(device)
    model.config.use_cache = False
    for block in model.model.layers:
        checkpoint_forward(block)
    if loss == "chunked":
        assert use_chunked_loss(model, None) is None
    elif loss == "liger":
        from ray_trainer._worker.model.liger import use_liger

        assert use_liger(model, TrainingArgs(use_gpu=gpu, liger_kernel=True)) is None
    optimizer = _optimizer(model, TrainingArgs(mixed_precision="bf16"), device)
    ids = torch.randint(config["vocab_size"], (1, length), device=device)
    offloader = ActivationOffload(device) if offload and gpu else contextlib.nullcontext()
    times = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            with offloader, torch.autocast(device.type, dtype=torch.bfloat16):
                out = model(input_ids=ids, labels=ids, num_items_in_batch=float(length - 1))
                loss = out["loss"] if isinstance(out, dict) else out.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del out, loss
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    except torch.OutOfMemoryError:
        return {"length": length, "fits": False}
    peak = torch.cuda.max_memory_allocated() if gpu else 0
    return {"length": length, "fits": True, "step_s": statistics.median(times[1:] or times),
            "peak_bytes": peak}  # fmt: skip


def _fresh(fn: Any, *args: Any) -> Any:
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def table_6(cpu: bool) -> dict[str, Any]:
    """The longest sequence that fits in a fixed memory (24 GiB of the GPU), chunked loss
    against the full logits, each with and without activation offloading, and liger-kernel's
    fused linear cross-entropy without; and the step time of each loss at a length all fit.
    A Llama shape with Llama 3's 128,256-token vocabulary, activation checkpointing on. Target:
    the chunked (or liger) step at most 1.03x the full logits'. Liger's rows need a GPU,
    triton and liger-kernel: without them they say why and are skipped."""
    from ray_trainer._model.liger_probe import missing_liger_kernel

    config = LONG_TINY if cpu else LONG
    lengths = (128, 256) if cpu else (8192, 16384, 32768, 65536, 131072)
    steps = 2 if cpu else 3
    no_liger = missing_liger_kernel(use_gpu=not cpu)
    losses = [k for k in LOSSES if k != "liger" or no_liger is None]
    timed = lengths[0]  # timed first: a run cut short in the search still has the ratios
    speed = {k: _fresh(long_steps, config, timed, k, False, 4 if cpu else 8, None) for k in losses}
    ratios = {k: speed[k]["step_s"] / speed["full"]["step_s"] for k in losses if k != "full"}
    print(f"table 6: step at {timed:,}: " + ", ".join(
        f"{LOSSES[k]} {speed[k]['step_s']:.4f} s" for k in losses), flush=True)  # fmt: skip
    longest, rows = {}, []
    searches = [(k, o) for k in ("full", "chunked") for o in (False, True)] + [("liger", False)]
    for loss, offload in searches:
        row = {"loss": LOSSES[loss], "activation offloading": "on" if offload else "off"}
        if loss not in losses:
            rows.append({**row, "longest sequence that fits": f"skipped: {no_liger}"})
            continue
        fits = 0
        for length in lengths:  # doubling until it no longer fits
            budget = None if cpu else LONG_BUDGET
            r = _fresh(long_steps, config, length, loss, offload, steps, budget)
            if not r["fits"]:
                break
            fits = length
            print(f"table 6: loss={loss} offload={offload} {length} fits", flush=True)
        longest[(loss, offload)] = fits
        rows.append({**row, "longest sequence that fits": f"{fits:,}" if fits else f"< {lengths[0]:,}"})  # fmt: skip
    head = (
        f"Llama shape, {config['num_hidden_layers']} layers of width {config['hidden_size']}, "
        f"vocabulary {config['vocab_size']:,}, untied head; one sequence, every position taking "
        f"the loss; activation checkpointing; bf16 autocast; AdamW. Memory: "
        f"{'unbounded (CPU smoke)' if cpu else f'{LONG_BUDGET / GiB:.0f} GiB of the GPU'}; "
        f"lengths tried: {', '.join(f'{n:,}' for n in lengths)}."
    )
    timing = f"step at {timed:,} tokens: full logits {speed['full']['step_s'] * 1e3:.1f} ms"
    for k, ratio in ratios.items():
        verdict = "met" if ratio <= 1.03 else "NOT met"
        timing += f"; {LOSSES[k]} {speed[k]['step_s'] * 1e3:.1f} ms: {ratio:.3f}x (target <= 1.03: {verdict})"  # fmt: skip
    if "liger" in ratios:
        faster = "liger" if ratios["liger"] < ratios["chunked"] else "chunked"
        timing += f". Faster of the two: {LOSSES[faster]} ({ratios['liger'] / ratios['chunked']:.3f}x liger / chunked)"  # fmt: skip
    else:
        timing += f". liger-kernel skipped: {no_liger}"
    figures = {f"{k}_vs_full_step": r for k, r in ratios.items()}
    figures |= {f"longest loss={k} offload={o}": n for (k, o), n in longest.items()}
    if no_liger:
        figures["liger_skipped"] = no_liger
    return {"table": "\n\n".join([head, table(rows), timing]), "figures": figures}


def table_7(cpu: bool) -> dict[str, Any]:
    """DPO on one GPU, bf16: non-padding tokens/s of pairs padded against packed (bench_dpo's
    pairs of uneven lengths), and the reference pass's wall time (Ray tasks on the GPU, before
    the worker starts) against the training's."""
    import glob

    import bench_dpo
    from transformers import AutoTokenizer

    from ray_trainer._demo.chat import make_tiny_chat_model

    n, steps, skip, batch = (48, 6, 2, 4) if cpu else (1024, 60, 15, 8)
    work = tempfile.mkdtemp(prefix="bench_gpu_dpo_")
    size = {"hidden_size": 64, "num_layers": 2} if cpu else {
        "hidden_size": 1024, "num_layers": 12, "num_heads": 16, "vocab_size": 8192}  # fmt: skip
    model = str(make_tiny_chat_model(os.path.join(work, "model"), **size))
    pairs = bench_dpo.preference_pairs(n)
    lengths = bench_dpo.pair_lengths(AutoTokenizer.from_pretrained(model), pairs)
    max_tokens = int(bench_dpo.padded_positions(lengths, batch))
    storage = os.path.join(work, "runs")  # one storage: the packed run reuses the reference
    common = {
        **_device_fields(cpu), "objective": "dpo", "model": model,
        "data": bench_dpo.write_pairs(pairs, work), "max_length": bench_dpo.MAX_LENGTH,
        "batch_size": batch, "max_steps": steps, "log_every_steps": 1, "warmup_steps": 0,
        "learning_rate": 1e-5, "storage_path": storage,
    }  # fmt: skip
    runs = {
        "padded": train(common, skip),
        "packed": train({**common, "packing": True, "max_tokens_per_batch": max_tokens}, skip),
    }
    (found,) = glob.glob(os.path.join(storage, ".ray_trainer", "data-cache", "*", "reference-*",
                                      "meta.json"))  # fmt: skip
    with open(found) as f:
        reference = json.load(f)
    base = runs["padded"]["tokens_per_s"]
    rows = packing_rows(runs, {"padded": "padded pairs (baseline)", "packed": "packed pairs"})
    train_s = runs["padded"]["step_s"] * steps
    sequences = reference["sequences"]
    head = (
        f"DPO (sigmoid, beta 0.1) on a Qwen2-shaped chat model ({size['num_layers']} layers, "
        f"width {size['hidden_size']}, vocabulary {size.get('vocab_size', 1024)}), {n} pairs "
        f"(sequence tokens median {statistics.median(t for p in lengths for t in p):.0f}, longest "
        f"{max(t for p in lengths for t in p)}), {batch} pairs a step, one worker, bf16; "
        f"max_tokens_per_batch={max_tokens} (a padded micro-batch's mean positions); tokens/s: "
        f"the median of the per-step logs after step {skip}."
    )
    pass_line = (
        f"reference pass: {sequences:,} sequences in {reference['wall_s']:.1f} s ("
        f"{reference['tasks']} Ray task(s) on {reference['device']}, {reference['dtype']}), before "
        f"the worker starts; the padded training's {steps} steps: {train_s:.1f} s; per sequence, "
        f"the pass takes {reference['wall_s'] / sequences / (train_s / (2 * batch * steps)):.3f} "
        "of a training step's time"
    )
    return {"table": "\n\n".join([head, table(rows), pass_line]),
            "figures": {"packed_vs_padded_tokens_per_s": runs["packed"]["tokens_per_s"] / base,
                        "padded_tokens_per_s": base, "reference_wall_s": reference["wall_s"],
                        "reference_device": reference["device"], "train_s": train_s}}  # fmt: skip


# ---- table 8: generation evaluations --------------------------------------------------------


def generation_checkpoint(folder: str, cpu: bool) -> str:
    """A checkpoint folder whose ``hf/`` export is a Llama of table 4's 1.1B shape (random
    weights, bf16, its vocabulary the tiny chat tokenizer's 1,024 tokens: about 1.0B parameters)
    with that tokenizer and its Llama 3 chat template; on the CPU, table 4's tiny shape."""
    import torch
    import transformers

    from ray_trainer._demo.chat import make_tiny_chat_model

    hf = os.path.join(folder, "hf")
    make_tiny_chat_model(hf, style="llama3")  # the tokenizer, template and special ids
    config = transformers.AutoConfig.from_pretrained(hf)
    shape = LLAMA_TINY if cpu else LLAMA_1B
    config.update({k: v for k, v in shape.items() if k != "vocab_size"})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.float32 if cpu else torch.bfloat16)
    model.save_pretrained(hf)
    return folder


def _generation_task(evaluate: Any, checkpoint: str) -> dict[str, Any]:
    """In a Ray task, as `EvalOnSave` runs its function: the metrics and the task's seconds."""
    started = time.perf_counter()
    metrics = evaluate(checkpoint, step=1)
    return {**metrics, "task_s": time.perf_counter() - started}


def table_8(cpu: bool) -> dict[str, Any]:
    """`GenerationEval` with transformers (`backend="hf"`) on one checkpoint of a ~1B Llama,
    in a Ray task with the GPU, as `EvalOnSave` runs it: load and generation seconds, answer
    tokens/s, at two batch sizes. vLLM is not on the GPU machine, and its wheels are far more
    than a call may carry (64 MiB): its row says so."""
    import ray

    from callbacks import GenerationEval
    from ray_trainer._demo.chat import chat_conversations

    n, new_tokens = (4, 8) if cpu else (64, 128)
    work = tempfile.mkdtemp(prefix="bench_gpu_generation_")
    checkpoint = generation_checkpoint(os.path.join(work, "checkpoint"), cpu)
    prompts = [{"messages": m} for m in chat_conversations(n, seed=3)]  # last answer: reference
    # A fresh worker process per task (max_calls=1): each row loads the checkpoint itself.
    task = ray.remote(num_gpus=0 if cpu else 1, max_calls=1)(_generation_task)
    rows, figures = [], {}
    for batch in (16, 64) if not cpu else (2, 4):
        engine = {"batch_size": batch, **({} if cpu else {"dtype": "bfloat16"})}
        evaluate = GenerationEval(prompts, name="gen", backend="hf", max_new_tokens=new_tokens,
                                  metrics=["exact_match"], engine=engine)  # fmt: skip
        m = ray.get(task.remote(evaluate, checkpoint))
        answer_tokens = m["gen/answer_tokens_mean"] * n
        tokens_per_s = answer_tokens / m["gen/generate_s"]
        figures[f"hf_batch_{batch}_answer_tokens_per_s"] = tokens_per_s
        print(f"table 8: hf, batch {batch}: {tokens_per_s:,.0f} answer tokens/s", flush=True)
        rows.append({
            "backend": f"hf (transformers), batch {batch}",
            "load (s)": f"{m['gen/load_s']:.1f}",
            "generate (s)": f"{m['gen/generate_s']:.1f}",
            "answer tokens/s": f"{tokens_per_s:,.0f}",
            "mean answer tokens": f"{m['gen/answer_tokens_mean']:.1f}",
            "task wall (s)": f"{m['task_s']:.1f}",
        })  # fmt: skip
    rows.append({"backend": "vllm", "load (s)": "-", "generate (s)": "-", "answer tokens/s": "-",
                 "mean answer tokens": "-",
                 "task wall (s)": "not run: vLLM is not on the GPU machine"})  # fmt: skip
    head = (
        f"One checkpoint of a Llama ({'tiny, CPU smoke' if cpu else '1.0B parameters, bf16'}), "
        f"random weights; {n} chat prompts, greedy, max_new_tokens={new_tokens}; GenerationEval "
        f"called in a Ray task with {'no GPU' if cpu else 'the GPU'} (as EvalOnSave runs it)."
    )
    return {"table": head + "\n\n" + table(rows), "figures": figures}


TABLES = {2: table_2, 3: table_3, 4: table_4, 5: table_5, 6: table_6, 7: table_7, 8: table_8}
