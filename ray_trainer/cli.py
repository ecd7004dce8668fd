"""The ``ray-trainer`` command: parse, build, fit, report.

Runs in the driver process (a terminal, or the entrypoint of a Ray job).

    ray-trainer run CONFIG.yaml [--set key=value ...]
    ray-trainer demo [--num-workers 2] [--max-steps N] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ray_trainer._config import TrainingArgs, TrainingArgsError


def _print_progress(context: Any) -> None:
    """Print one progress line per `on_log`; runs in the rank-0 training process."""
    m = context.batch_metrics or {}
    total = context.max_steps or "?"
    print(
        f"[{context.run_name}] step {context.global_step}/{total} "
        f"loss {m.get('loss', float('nan')):.4f} lr {m.get('learning_rate', 0):.2e} "
        f"{m.get('tokens_per_s', 0):.0f} tok/s",
        flush=True,
    )


def _print_eval(context: Any) -> None:
    """Print validation metrics; runs in the rank-0 training process."""
    metrics = " ".join(f"{k} {v:.4f}" for k, v in sorted((context.val_metrics or {}).items()))
    print(f"[{context.run_name}] eval at step {context.global_step}: {metrics}", flush=True)


_print_progress.runs_on = "rank0"
_print_eval.runs_on = "rank0"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ray-trainer", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train with the TrainingArgs in a YAML file")
    run.add_argument("config", help="YAML file of TrainingArgs fields")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    run.add_argument("--quiet", action="store_true", help="no per-log progress lines")

    demo = sub.add_parser("demo", help="train the built-in demo (no download)")
    demo.add_argument("--num-workers", type=int, default=2)
    demo.add_argument("--max-steps", type=int, default=None)
    demo.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    demo.add_argument("--quiet", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    from ray_trainer._launch import ResourceRequestError, RunFailedError, run_training

    try:
        if opts.command == "run":
            args = TrainingArgs.from_yaml(opts.config, opts.overrides)
        else:
            args = _demo_args(opts)
        if not opts.quiet:
            args = args.model_copy(
                update={
                    "on_log": [*(args.on_log or []), _print_progress],
                    "on_evaluate": [*(args.on_evaluate or []), _print_eval],
                }
            )
        result = run_training(args)
    except (TrainingArgsError, ResourceRequestError, FileNotFoundError, ValueError) as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return 2
    except RunFailedError as e:
        print(f"ray-trainer: run failed: {e}", file=sys.stderr)
        return 1
    print(result.summary(), flush=True)
    return 0


def _demo_args(opts: argparse.Namespace) -> TrainingArgs:
    from ray_trainer._demo import DEMO_DEFAULTS

    fields: dict[str, Any] = {
        "num_workers": opts.num_workers,
        "max_steps": opts.max_steps or DEMO_DEFAULTS["max_steps"],
        "batch_size": DEMO_DEFAULTS["batch_size"],
        "learning_rate": DEMO_DEFAULTS["learning_rate"],
        "warmup_steps": DEMO_DEFAULTS["warmup_steps"],
        "eval_every_steps": DEMO_DEFAULTS.get("eval_every_steps", 100),
        "log_every_steps": 20,
        "storage_path": "./runs",
    }
    for item in opts.overrides:
        import yaml

        key, _, value = item.partition("=")
        fields[key] = yaml.safe_load(value)
    return TrainingArgs.coerce(fields)


if __name__ == "__main__":
    sys.exit(main())
