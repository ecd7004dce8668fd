"""Multi-turn GRPO episodes (``tools``/``environment_factory``): episodes/s, and waits that overlap.

Runs in this benchmark's own process (the driver), with its embedded Ray: one ``hf`` rollout
engine actor (`RemoteEngine`, one CPU) holding a tiny ChatML model warmed up to call a
``multiply`` tool (``ray_trainer.demo.make_tool_model``, sampled at temperature 0.5: it calls the
tool in nearly every episode), and the run's environment actors (`EnvironmentPool`, one actor of
a quarter CPU), driven by the same `AgentSampler` a training worker uses for its step's
episodes. No training: what is measured is the rollout side of a step.

* **Episodes/s against concurrent episodes** (``--episodes``: 16, 64, 256): one step's episodes
  at once (prompts x ``--generations``), a trivial environment (``multiply`` answers at once);
  the step's wall time, episodes/s, turns per episode, tool calls per episode.
* **A tool that waits** (at ``--wait-episodes``, 64): the same step where ``multiply`` sleeps
  ``--sleep`` s (1.0) before answering, against the instant one, in the same round: the ratio of
  the step times. The waits overlap (the actor's threads) and never hold back another episode's
  turn, so the ratio stays near 1 + sleep / step (target: at most 1.5x).

Rounds rotate the order; medians. ``--smoke`` (in CI): 4 and 8 episodes, a sleep of 0.2 s, one
round, a warm-up of 20 steps.

Usage: python bench/runner/bench_agents.py [--episodes 16,64,256] [--wait-episodes 64]
       [--sleep 1.0] [--generations 8] [--rounds 2] [--warmup-steps 150] [--smoke] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # bench/: _bench_path adds every bench folder
import _bench_path  # noqa: E402, F401
from _support import emit, init_ray, machine, table  # noqa: E402

#: The target: the step with a tool that sleeps against the instant one.
TARGET = 1.5


class Product:
    """The benchmark's environment: ``multiply``, after `sleep_s` of waiting (0: at once)."""

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s

    def reset(self, **row: Any) -> str | None:
        return None

    def multiply(self, a: int, b: int) -> int:
        """Multiply two whole numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return a * b


def sampler_for(model: str, sleep_s: float, name: str) -> Any:
    """An `AgentSampler` over a pool of one environment actor for `Product(sleep_s)`."""
    import functools

    import transformers

    from ray_trainer._agents.environments import EnvironmentPool, EnvironmentSpec
    from ray_trainer._agents.loop import AgentSampler
    from ray_trainer._agents.tools import resolve_agent_tools, run_template

    agent = resolve_agent_tools(None, functools.partial(Product, sleep_s))
    tok = transformers.AutoTokenizer.from_pretrained(model)
    template, response = run_template(tok, None)
    spec = EnvironmentSpec(factories=agent.factories, timeout_s=60.0)
    pool = EnvironmentPool(spec, name=name)
    return AgentSampler(agent, tok, template, response, pool, max_iterations=2)


def encoded_prompts(model: str, n: int, seed: int) -> list[Any]:
    """`n` prompt records "a*b=" rendered with the tool's schema (as the driver encodes them)."""
    import transformers

    from ray_trainer._data.prompts import EncodedPrompt
    from ray_trainer.demo import multiply, product_prompts

    tok = transformers.AutoTokenizer.from_pretrained(model)
    out = []
    for r in product_prompts(n, seed):
        ids = tok.apply_chat_template(
            r["prompt"], tools=[multiply], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        )  # fmt: skip
        out.append(EncodedPrompt(list(ids), r["prompt"], "", {"answer": r["answer"]}))
    return out


def one_step(sampler: Any, engine: Any, prompts: list[Any], generations: int, seed: int) -> dict:
    """One step's episodes on `engine`: its wall time and counts."""
    from ray_trainer._rollout.engine import SamplingParams

    params = SamplingParams(
        num_generations=generations, max_completion_length=100, temperature=0.5, seed=seed
    )
    started = time.perf_counter()
    out = sampler.sample(engine, prompts, list(range(len(prompts))), params, f"bench:{seed}")
    wall = time.perf_counter() - started
    episodes = [c.episode for c in out]
    return {
        "seconds": wall,
        "episodes": len(out),
        "turns": statistics.mean(e.turns for e in episodes),
        "calls": statistics.mean(e.tool_calls for e in episodes),
        "mismatch": sum(e.prefix_mismatch for e in episodes),
    }


def measure(opts: argparse.Namespace) -> dict[str, Any]:
    from ray_trainer._model.spec import ModelSpec
    from ray_trainer._rollout.actor import RemoteEngine
    from ray_trainer._rollout.engine import EngineSpec
    from ray_trainer.demo import make_tool_model

    folder = tempfile.mkdtemp(prefix="bench_agents_")
    started = time.perf_counter()
    model = make_tool_model(os.path.join(folder, "model"), steps=opts.warmup_steps)
    warmup_s = time.perf_counter() - started
    init_ray(3)
    engine = RemoteEngine("hf", EngineSpec(model=ModelSpec(model=model)), {"CPU": 1})
    instant = sampler_for(model, 0.0, "bench-agents-instant")
    waiting = sampler_for(model, opts.sleep, "bench-agents-sleep")
    sizes = sorted(set(opts.episodes) | {opts.wait_episodes})
    prompts = {n: encoded_prompts(model, max(1, n // opts.generations), n) for n in sizes}
    one_step(instant, engine, prompts[sizes[0]], opts.generations, 0)  # warm: model, actors
    runs: dict[str, list[dict]] = {}
    for r in range(opts.rounds):
        order = [("instant", n) for n in sizes] + [("sleep", opts.wait_episodes)]
        order = order[r % len(order) :] + order[: r % len(order)]
        for kind, n in order:
            sampler = instant if kind == "instant" else waiting
            step = one_step(sampler, engine, prompts[n], opts.generations, 1000 * r + n)
            runs.setdefault(f"{kind}:{n}", []).append(step)
            print(f"round {r}, {kind} tool, {step['episodes']} episodes: {step['seconds']:.2f} s, "
                  f"{step['turns']:.2f} turns, {step['calls']:.2f} calls", flush=True)  # fmt: skip
    for s in (instant, waiting):
        s.pool.close()
    engine.close()
    return {"runs": runs, "warmup_s": warmup_s}


def summarise(runs: dict[str, list[dict]], opts: argparse.Namespace) -> dict[str, Any]:
    """The table and the ratio of the sleeping tool's step to the instant one's."""
    rows = []

    def med(key: str, field: str) -> float:
        return statistics.median(x[field] for x in runs[key])

    for n in sorted(set(opts.episodes)):
        key = f"instant:{n}"
        episodes = runs[key][0]["episodes"]
        rows.append({
            "setting": f"{episodes} episodes, instant tool",
            "step (s)": f"{med(key, 'seconds'):.2f}",
            "episodes/s": f"{episodes / med(key, 'seconds'):.1f}",
            "turns": f"{med(key, 'turns'):.2f}", "tool calls": f"{med(key, 'calls'):.2f}",
            "prefix mismatch": int(med(key, "mismatch")),
        })  # fmt: skip
    base = med(f"instant:{opts.wait_episodes}", "seconds")
    slow = med(f"sleep:{opts.wait_episodes}", "seconds")
    ratio = slow / base
    key = f"sleep:{opts.wait_episodes}"
    rows.append({
        "setting": f"{runs[key][0]['episodes']} episodes, tool sleeps {opts.sleep:g} s",
        "step (s)": f"{slow:.2f}", "episodes/s": f"{runs[key][0]['episodes'] / slow:.1f}",
        "turns": f"{med(key, 'turns'):.2f}", "tool calls": f"{med(key, 'calls'):.2f}",
        "prefix mismatch": int(med(key, "mismatch")), "ratio": f"{ratio:.3f}x",
    })  # fmt: skip
    return {"rows": rows, "ratio": ratio, "max_episodes": max(opts.episodes)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", default="16,64,256")
    p.add_argument("--wait-episodes", type=int, default=64)
    p.add_argument("--sleep", type=float, default=1.0)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warmup-steps", type=int, default=150)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--json")
    opts = p.parse_args(argv)
    if opts.smoke:
        opts.episodes, opts.wait_episodes, opts.sleep, opts.rounds = "4,8", 8, 0.2, 1
        opts.generations, opts.warmup_steps = 4, 20
    opts.episodes = [int(x) for x in str(opts.episodes).split(",")]
    found = measure(opts)
    summary = summarise(found["runs"], opts)
    report = {
        "machine": machine(),
        "table": table(summary["rows"]),
        "ratios": {summary["rows"][-1]["setting"]: summary["ratio"]},
        "target": TARGET,
        "max_episodes": summary["max_episodes"],
        "warmup_s": found["warmup_s"],
    }
    return emit(report, opts.json)


if __name__ == "__main__":
    main()
