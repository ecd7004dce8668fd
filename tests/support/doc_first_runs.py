"""The first snippet of a guide, run as a newcomer runs it: in a driver process of its own, with
no `ray.init` of the user's, shortened to a few steps.

    python tests/support/doc_first_runs.py STEPS PAGE [PAGE ...]

Runs in its own process, in the folder it is started in (the test's temporary folder, also its
``HOME``: a run's default ``storage_path`` is ``~/ray_trainer_runs``). The snippet's relative
files (``prompts.jsonl``, ``chat.jsonl``, a model folder ``my/chat-model``) are made there, the
smallest stand-ins that let it start (a tiny chat model, a few records); a path that cannot be
made here (a bucket's) is replaced by a local one, and nothing else of the snippet changes. A
page's snippet is its first block of code: its first ```python block or, where a ```bash block
comes first (getting-started.md), the first example that block runs, with its own
``--max-steps``. `run_training` is shortened by a wrapper: ``max_steps=STEPS``, and a schedule
that the shortened run would never reach (``eval_every_steps=200``) brought within it, so that
what the snippet reads after its run (a validation metric) exists.

The first PAGE runs on the embedded Ray that its `run_training` starts and sizes. The others
share one embedded Ray, started once after it as `run_training` starts one for a run that fits
the machine's cores (``start_embedded_ray`` with the cores, without the dashboard): each run is
first checked to be one the embedded Ray would offer exactly the cores (its processes fit
them), and the run itself checks that the workers fit, as on its own Ray. One Ray start instead
of one a run: about 5 s less each on 2 cores.

Prints, per page, ``PAGE <page> <seconds> ok`` or the error, and last an ``OUTCOME`` line: the
JSON of ``{page: {"seconds": s, "error": text or None, "steps": [global steps of its runs]}}``.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

#: Paths a snippet names that cannot be made in its folder, and the local stand-in for each.
REPLACED = {
    "s3://bucket/models/llama-3-8b": "tiny-chat-model",
    "s3://bucket/chat/*.jsonl": "chat/*.jsonl",
}
#: The schedule fields a shortened run brings within its steps.
SCHEDULES = ("eval_every_steps", "save_every_steps", "log_every_steps")


def first_snippet(page: str) -> tuple[str, str]:
    """(kind, text) of `page`'s first block of code (``text`` blocks are output, not code)."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.fullmatch(r"```(\w+)", line.strip())
        if m and m.group(1) in ("python", "bash"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            return m.group(1), "\n".join(lines[i + 1 : end])
    raise AssertionError(f"docs/{page} has no python or bash block")


def chat_records(n: int) -> list[dict]:
    from ray_trainer.demo import chat_conversations

    return [{"messages": m} for m in chat_conversations(n, seed=1)]


def sums(n: int) -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)][:n]


def write_jsonl(path: str, records: list[dict]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in records))


def make_stand_ins() -> None:
    """The files the pages' first snippets name, as small as a few steps need."""
    from ray_trainer.demo import make_tiny_chat_model

    model = make_tiny_chat_model("tiny-chat-model", max_position_embeddings=4096)
    for name in ("my/chat-model", "path/to/hf-chat-model"):  # rl.md; preference.md, chat.md
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.abspath(model), name)
    prompts = [{"prompt": [{"role": "user", "content": q}], "answer": a} for q, a in sums(64)]
    write_jsonl("prompts.jsonl", prompts)
    write_jsonl("chat.jsonl", chat_records(96))
    write_jsonl("chat/part-0.jsonl", chat_records(96))
    write_jsonl("train.jsonl", [{"text": f"{q}{a}"} for q, a in sums(100)])
    pairs = [
        {"prompt": [{"role": "user", "content": q}],
         "chosen": [{"role": "assistant", "content": a}],
         "rejected": [{"role": "assistant", "content": str(int(a) + 1)}]}
        for q, a in sums(80)
    ]  # fmt: skip
    write_jsonl("pairs.jsonl", pairs[:64])
    write_jsonl("held_out_pairs.jsonl", pairs[64:])


def shorten(real: Any, steps: int, seen: list[int], shared: bool) -> Any:
    """`real` (`ray_trainer.run_training`) with `steps` steps; the global step of each run is
    kept in `seen`. `shared`: on the shared embedded Ray, which a run must fit as its own."""

    def shortened(args: Any = None, **fields: Any) -> Any:
        fields["max_steps"] = steps
        for name in SCHEDULES:
            if fields.get(name) and fields[name] > steps:
                fields[name] = steps
        if shared:
            fits_the_cores(fields)
        result = real(args, **fields)
        seen.append(result.global_step)
        return result

    return shortened


def fits_the_cores(fields: dict[str, Any]) -> None:
    """A run the embedded Ray would start with the machine's cores, saying nothing more."""
    from ray_trainer import TrainingArgs
    from ray_trainer._driver.checks.demand import embedded_cpus, run_demand
    from ray_trainer._driver.checks.inputs import collect_callbacks
    from ray_trainer._driver.checks.resources import embedded_resources

    args = TrainingArgs.coerce(**fields)
    cores = embedded_resources(count_gpus=False)["CPU"]
    cpus = embedded_cpus(run_demand(args, collect_callbacks(args)), cores)
    assert cpus == cores, f"its own embedded Ray would offer {cpus} CPUs: run it first"


def start_shared_ray() -> None:
    """One embedded Ray for the pages after the first, as `run_training` starts one for a run
    that fits the cores (no dashboard: nothing looks at it)."""
    from ray_trainer._driver.checks.resources import embedded_resources
    from ray_trainer._driver.console import start_embedded_ray

    start_embedded_ray(int(embedded_resources(count_gpus=False)["CPU"]), dashboard=False)


def run_page(page: str, steps: int, shared: bool) -> list[int]:
    """Run `page`'s first snippet, shortened to `steps`; the global step of each of its runs."""
    import ray_trainer

    seen: list[int] = []
    real = ray_trainer.run_training
    ray_trainer.run_training = shorten(real, steps, seen, shared)  # what the snippet imports
    try:
        _run(page, steps)
    finally:
        ray_trainer.run_training = real
    return seen


def _run(page: str, steps: int) -> None:
    kind, text = first_snippet(page)
    for path, local in REPLACED.items():
        text = text.replace(path, local)
    if kind == "python":
        exec(compile(text, f"docs/{page}", "exec"), {"__name__": "__main__"})
        return
    command = next(c for c in text.splitlines() if c.startswith("python examples/"))
    argv = shlex.split(command.split("#")[0])[1:]
    if "--max-steps" in argv:
        argv[argv.index("--max-steps") + 1] = str(steps)
    sys.argv = argv
    runpy.run_path(str(ROOT / argv[0]), run_name="__main__")


def main() -> None:
    steps, pages = int(sys.argv[1]), sys.argv[2:]
    make_stand_ins()
    argv, outcome = list(sys.argv), {}
    for i, page in enumerate(pages):
        started, error, seen = time.monotonic(), None, []
        try:
            if i == 1:
                start_shared_ray()
            seen = run_page(page, steps, shared=i > 0)
        except BaseException as e:  # an example's SystemExit too: reported
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        finally:
            sys.argv = argv
        seconds = round(time.monotonic() - started, 1)
        outcome[page] = {"seconds": seconds, "error": error, "steps": seen}
        print(f"PAGE {page} {seconds} {'ok' if error is None else error}", flush=True)
    import ray

    ray.shutdown()  # the shared Ray (the first page's run shut its own down)
    print("OUTCOME " + json.dumps(outcome), flush=True)


if __name__ == "__main__":
    main()
