"""The load phase of bench_memory.py: each worker's host memory while it loads a pretrained model.

A Llama-shaped model (253M parameters with the defaults: 16 layers, width 1024, MLP 2816, 16
heads of which 8 key/value, vocabulary 32000, untied head) is saved once with
``save_pretrained`` in bf16 (as checkpoints usually are), over several safetensors files. Then
each configuration is N spawned processes in a gloo group (no Ray; nccl, each on its own GPU,
where the machine has one per process) that load it as a runner worker does and take one
training step:

* **meta** (the runner now): ``loading.build_model`` builds it on the meta device and
  ``parallel.prepare`` shards it (FSDP) and fills each rank's shards from the files, each rank
  reading only its rows; under DDP the whole model is filled in place;
* **whole** (before): ``from_pretrained(dtype=float32)`` in every worker (the whole model, in
  the dtype training keeps), then ``parallel.prepare``.

Memory is the process's anonymous memory (``RssAnon``: what the process allocated, not the
file pages it maps, which ``from_pretrained``'s memory-mapped safetensors add to RSS and to
``VmHWM`` though the kernel can drop them), sampled every millisecond by a thread during the
load; "added" is its peak above the process's own before the load (libraries imported, process
group up). ``VmHWM`` (peak RSS, file pages included) is reported beside it. Time: the load, and
the load plus the first step (forward, backward, AdamW step on 1 x 64 tokens), from the same
start. Target, FSDP: added <= (model bytes / N) x 1.1 + the largest tensor, model bytes in fp32.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from typing import Any

LLAMA = {
    "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
    "num_attention_heads": 16, "num_key_value_heads": 8, "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}  # fmt: skip
#: Table 4's 1.1B Llama (TinyLlama's shape; ``_gpu_tables.LLAMA_1B``, which imports this
#: module, so the shape is written here again): the QLoRA phase's default model.
LLAMA_1B = {
    "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
    "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}  # fmt: skip
QUICK_LLAMA = {**LLAMA, "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 704,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
MiB = 2**20
#: The QLoRA configuration of the ``qlora`` phase (issue 52).
QLORA = {"r": 16, "lora_alpha": 32, "quantize_base": "nf4"}


def save_model(folder: str, config: dict[str, Any], writer: Any = None) -> dict[str, Any]:
    """Save a randomly initialised Llama of `config` in bf16 into `folder` (in a child process,
    so that this process never holds it; `writer`: ``_save``, transformers' initialisation and
    ``save_pretrained``, or `write_random_model`); its size figures."""
    import multiprocessing

    target = writer or _save
    process = multiprocessing.get_context("spawn").Process(target=target, args=(folder, config))
    process.start()
    process.join()
    if process.exitcode != 0:
        raise RuntimeError(f"saving the benchmark model failed ({process.exitcode})")
    from safetensors import safe_open

    numel, largest = 0, 0
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():  # noqa: SIM118  (safe_open has no __iter__)
                    shape = f.get_slice(key).get_shape()
                    count = 1
                    for size in shape:
                        count *= size
                    numel, largest = numel + count, max(largest, count)
    files = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    on_disk = sum(os.path.getsize(os.path.join(folder, n)) for n in files)
    return {"numel": numel, "fp32_bytes": 4 * numel, "largest_bytes": 4 * largest,
            "file_bytes": on_disk, "files": len(files)}  # fmt: skip


def write_random_model(folder: str, config: dict[str, Any]) -> None:
    """Write a Llama of `config` with random bf16 weights into `folder` (config.json and
    safetensors files of at most ~500 MiB with their index) a tensor at a time, never building
    the model: a 1.1B shape is written holding one file's tensors (in a child process, as
    `save_model`'s). Matrices are N(0, 0.02), norms ones; as ``_save`` gives, in law."""
    import json

    import torch
    import transformers
    from safetensors.torch import save_file

    llama = transformers.LlamaConfig(**config)
    llama.save_pretrained(folder)
    with torch.device("meta"):
        shapes = {
            n: tuple(p.shape) for n, p in transformers.LlamaForCausalLM(llama).named_parameters()
        }
    generator = torch.Generator().manual_seed(0)
    files: list[dict[str, Any]] = [{}]
    size = 0
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)
        if files[-1] and size + tensor.numel() * 2 > 500 * MiB:
            _write_file(folder, files, save_file)
            files.append({})
            size = 0
        files[-1][name] = tensor
        size += tensor.numel() * 2
    _write_file(folder, files, save_file)
    count = len(files)
    weight_map = {}
    for i in range(count):
        old = os.path.join(folder, f"part-{i}.safetensors")
        new = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.rename(old, os.path.join(folder, new))
        weight_map.update(dict.fromkeys(files[i], new))
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _write_file(folder: str, files: list[dict[str, Any]], save_file: Any) -> None:
    """Write the last of `files` as ``part-<i>.safetensors`` and keep only its names."""
    i = len(files) - 1
    save_file(files[i], os.path.join(folder, f"part-{i}.safetensors"), metadata={"format": "pt"})
    files[i] = dict.fromkeys(files[i])


def _save(folder: str, config: dict[str, Any]) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config)).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="200MB")


def anon_bytes() -> int:
    """This process's anonymous resident memory now (``RssAnon``), in bytes."""
    return _status_kib("RssAnon:") * 1024


def hwm_bytes() -> int:
    """This process's peak resident memory (``VmHWM``: file pages included), in bytes."""
    return _status_kib("VmHWM:") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class AnonPeak(threading.Thread):
    """Samples `anon_bytes` every `interval_s` in the background; `peak` is the largest."""

    def __init__(self, interval_s: float = 0.001) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.peak = anon_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.peak = max(self.peak, anon_bytes())
            time.sleep(self.interval_s)

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, anon_bytes())
        return self.peak


def load_and_step(rank: int, world: int, strategy: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank: load the saved model as `opts["how"]` says, prepare it, take one step; its
    memory and times. A collective: every rank of the configuration calls it."""
    import torch
    import transformers
    from accelerate import Accelerator

    from ray_trainer._config.args import TrainingArgs
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._worker.assemble import _optimizer
    from ray_trainer._worker.model.build import build_model
    from ray_trainer._worker.model.parallel import prepare

    path = opts["path"]
    lora = QLORA if opts["how"] == "qlora" else None
    args = TrainingArgs(
        model=path, strategy=strategy, num_workers=world, mixed_precision="no", lora=lora
    )
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
    with torch.device("meta"):  # import the model's code now: it is not part of the load
        config = transformers.AutoConfig.from_pretrained(path)
        transformers.AutoModelForCausalLM.from_config(config)
    import safetensors.torch  # noqa: F401  (what from_pretrained reads with)

    if lora is not None:  # torchao's import is not part of the load either
        from ray_trainer._model.nf4 import torchao_nf4

        torchao_nf4()

    torch.distributed.barrier()  # every rank starts together, libraries imported
    baseline = anon_bytes()
    sampler = AnonPeak()
    sampler.start()
    started = time.perf_counter()
    if opts["how"] in ("meta", "qlora"):
        model, materialize = build_model(ModelSpec.of(args))
        if lora is not None:  # QLoRA: quantized on meta, each weight quantized as it is read
            from ray_trainer._worker.model.adaptation import apply_lora

            model, materialize, _ = apply_lora(model, materialize, ModelSpec.of(args), args)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        materialize = None
    parallel = prepare(
        model, args, accelerator, lambda m: _optimizer(m, args, accelerator.device), "no",
        materialize,
    )  # fmt: skip
    del model
    loaded = time.perf_counter()
    load_peak = sampler.stop()
    after_load = anon_bytes()
    ids = torch.randint(opts["vocab_size"], (1, 64), generator=torch.Generator().manual_seed(rank))
    ids = ids.to(accelerator.device)
    loss = parallel.model(input_ids=ids, labels=ids).loss
    loss.backward()
    parallel.optimizer.step()
    stepped = time.perf_counter()
    from ray_trainer._model.nf4 import resident_bytes

    local = sum(resident_bytes(p) for p in parallel.model.parameters())
    base = sum(resident_bytes(p) for p in parallel.model.parameters() if not p.requires_grad)
    return {
        "rank": rank,
        "baseline": baseline,
        "load_peak": load_peak,
        "added": load_peak - baseline,
        "after_load": after_load - baseline,
        "hwm": hwm_bytes(),
        "load_s": loaded - started,
        "first_step_s": stepped - started,
        "param_bytes": local,
        "base_bytes": base,  # the frozen parameters' (QLoRA: the 4-bit base and what stays)
        "loss": float(loss.detach()),
    }


def summarise_load(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's figures: the largest rank's memory, the slowest rank's times."""
    return {
        "added": max(r["added"] for r in ranks),
        "after_load": max(r["after_load"] for r in ranks),
        "hwm": max(r["hwm"] for r in ranks),
        "load_s": max(r["load_s"] for r in ranks),
        "first_step_s": max(r["first_step_s"] for r in ranks),
        "param_bytes": max(r["param_bytes"] for r in ranks),
        "base_bytes": max(r.get("base_bytes", 0) for r in ranks),
    }


def load_target(model: dict[str, Any], world: int, strategy: str) -> int:
    """The most a load may add: this rank's share of the fp32 model (+10%) and one tensor."""
    share = model["fp32_bytes"] / (world if strategy == "fsdp" else 1)
    return int(share * 1.1 + model["largest_bytes"])


def load_rows(results: dict[tuple, dict[str, Any]], model: dict[str, Any]) -> tuple[list, dict]:
    """Table rows and ratios: each configuration, its peak added memory against the target,
    the model's size and the whole load of the same configuration."""
    rows, ratios = [], {}
    for (strategy, world, how), r in sorted(
        results.items(), key=lambda kv: (kv[0][0] == "fsdp", kv[0][1], kv[0][2] != "whole")
    ):
        whole = results.get((strategy, world, "whole"))
        target = load_target(model, world, strategy) if strategy == "fsdp" else None
        label = f"{strategy.upper()}, {world} workers, " + (
            "meta device + own rows (now)" if how == "meta" else "from_pretrained whole (before)"
        )
        rows.append({
            "configuration": label,
            "added at peak (MiB)": f"{r['added'] / MiB:,.0f}",
            "vs model (fp32)": f"{r['added'] / model['fp32_bytes']:.2f}",
            "vs whole load": f"{r['added'] / whole['added']:.2f}" if whole else "",
            "target (MiB)": f"{target / MiB:,.0f}" if target else "",
            "met": ("yes" if r["added"] <= target else "NO") if target else "",
            "after load (MiB)": f"{r['after_load'] / MiB:,.0f}",
            "VmHWM (MiB)": f"{r['hwm'] / MiB:,.0f}",
            "load (s)": f"{r['load_s']:.1f}",
            "to first step (s)": f"{r['first_step_s']:.1f}",
        })  # fmt: skip
        if how == "meta" and whole:
            ratios[f"{strategy} {world} workers: load memory vs whole"] = (
                r["added"] / whole["added"]
            )
            ratios[f"{strategy} {world} workers: time to first step vs whole"] = (
                r["first_step_s"] / whole["first_step_s"]
            )
    return rows, ratios


def run_load_phase(run_configuration: Any, workers: list[int], quick: bool) -> dict[str, Any]:
    """The load phase: the model saved once, then DDP on 2 workers and FSDP on each of
    `workers`, each loaded whole and on the meta device (in ABBA order), each configuration a
    process group of its own (`run_configuration(strategy, world, opts)`, bench_memory's)."""
    from _support import table

    config = QUICK_LLAMA if quick else LLAMA
    folder = tempfile.mkdtemp(prefix="bench_memory_model_")
    try:
        model = save_model(folder, config)
        opts = {"path": folder, "vocab_size": config["vocab_size"]}
        plan = [("ddp", 2)] + [("fsdp", w) for w in workers]
        results = {}
        for i, (strategy, world) in enumerate(plan):
            for how in ("whole", "meta") if i % 2 == 0 else ("meta", "whole"):
                ranks = run_configuration(strategy, world, {**opts, "how": how})
                results[(strategy, world, how)] = summarise_load(ranks)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    rows, ratios = load_rows(results, model)
    head = (
        f"Loading a pretrained Llama-shaped model: {model['numel'] / 1e6:.0f}M parameters, "
        f"saved in bf16 ({model['file_bytes'] / MiB:,.0f} MiB in {model['files']} safetensors "
        f"files), trained in fp32 ({model['fp32_bytes'] / MiB:,.0f} MiB; largest tensor "
        f"{model['largest_bytes'] / MiB:,.0f} MiB). Peak anonymous memory each worker added "
        "while loading (largest rank), against the model, the whole load and the target "
        "(FSDP: model / N x 1.1 + the largest tensor):"
    )
    return {"table": head + "\n\n" + table(rows), "ratios": ratios, "model": model,
            "results": {"_".join(map(str, k)): v for k, v in results.items()}}  # fmt: skip


def run_qlora_phase(
    run_configuration: Any, workers: list[int], quick: bool, shape: str = "1.1b"
) -> dict[str, Any]:
    """The QLoRA phase (``--phases qlora``, issue 52): a bf16 Llama loaded as a QLoRA worker
    loads it (on the meta device, each weight read in row blocks and quantized to NF4, this
    rank's rows kept), on 1 worker and under FSDP on each of `workers`. `shape`: ``"1.1b"``,
    table 4's 1.1B Llama (TinyLlama's shape, bench/gpu; its embeddings and head are 12% of it,
    near a real LLM's share), written from random weights, or ``"254m"``, the load phase's
    (26%). Each worker's peak added
    memory against the bf16 model's bytes (targets: <= 0.4 on one worker, <= 0.4 / N + 10%
    on N), and the resident bytes of the base's weights (the frozen parameters: NF4 codes
    and scales, plus the embeddings, head and norms that stay) against bf16's (target <= 0.3
    for the linear layers quantized; the whole base is reported beside)."""
    from _support import table

    config = QUICK_LLAMA if quick else LLAMA_1B if shape == "1.1b" else LLAMA
    folder = tempfile.mkdtemp(prefix="bench_memory_qlora_")
    try:
        model = save_model(folder, config, write_random_model)
        opts = {"path": folder, "vocab_size": config["vocab_size"], "how": "qlora"}
        plan = [("ddp", 1)] + [("fsdp", w) for w in workers]
        results = {key: summarise_load(run_configuration(*key, opts)) for key in plan}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    bf16 = 2 * model["numel"]
    embed = 2 * config["vocab_size"] * config["hidden_size"]  # the embeddings' and head's values
    rows, ratios = [], {}
    for (strategy, world), r in results.items():
        share = bf16 / world
        target = 0.4 * share * (1.1 if world > 1 else 1.0)
        kept = 2 * embed / world  # the embeddings and head stay, in bf16 (nf4.store_outside)
        rows.append({
            "configuration": f"QLoRA NF4, {strategy.upper()}, {world} worker(s)",
            "added at peak (MiB)": f"{r['added'] / MiB:,.0f}",
            "vs bf16 model / N": f"{r['added'] / share:.2f}",
            "target": f"{target / share:.2f}",
            "met": "yes" if r["added"] <= target else "NO",
            "base resident (MiB)": f"{r['base_bytes'] / MiB:,.0f}",
            "base vs bf16 / N": f"{r['base_bytes'] / share:.2f}",
            "quantized layers (+ norms) vs bf16": f"{(r['base_bytes'] - kept) / (share - 2 * embed / world):.2f}",
            "load (s)": f"{r['load_s']:.1f}",
        })  # fmt: skip
        ratios[f"qlora {strategy} {world}: load peak vs bf16 share"] = r["added"] / share
        ratios[f"qlora {strategy} {world}: base resident vs bf16 share"] = r["base_bytes"] / share
    head = (
        f"QLoRA (lora r=16, quantize_base='nf4'): a Llama-shaped model (width "
        f"{config['hidden_size']}, {config['num_hidden_layers']} layers, vocabulary "
        f"{config['vocab_size']}), {model['numel'] / 1e6:.0f}M parameters, {bf16 / MiB:,.0f} MiB in bf16. Peak anonymous "
        "memory a worker added while loading it (largest rank) and the resident bytes of its "
        "frozen base, against bf16's share of the model per worker:"
    )
    return {"table": head + "\n\n" + table(rows), "ratios": ratios, "model": model,
            "results": {"_".join(map(str, k)): v for k, v in results.items()}}  # fmt: skip
