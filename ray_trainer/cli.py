"""Driver (and the user's terminal): the ``ray-trainer`` command, parse, build, fit, report.

Runs in the driver process (a terminal, or the entrypoint of a Ray job); ``status`` and
``submit`` run in the user's terminal.

    ray-trainer run CONFIG.yaml [--set key=value ...]
    ray-trainer demo [--num-workers 2] [--max-steps N] [--set key=value ...]
    ray-trainer status RUN_NAME [--address HOST:PORT] [--json]
    ray-trainer submit CONFIG.yaml --address http://HOST:8265 [--set key=value ...] [--wait]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ray_trainer._config import TrainingArgs, TrainingArgsError


def _with_default_callbacks(args: TrainingArgs, *, quiet: bool, demo: bool) -> TrainingArgs:
    """Add a ProgressBar (and, for the demo, a JsonlLogger) unless the config has one.

    Both run on the callback actor: progress lines come from one process, readable in
    `ray job logs`, and never slow the training loop.
    """
    from callbacks import JsonlLogger, ProgressBar

    have = {type(cb) for cb in args.callbacks}
    extra: list[Any] = []
    if not quiet and ProgressBar not in have:
        extra.append(ProgressBar())
    if demo and JsonlLogger not in have:
        extra.append(JsonlLogger())
    return args.model_copy(update={"callbacks": [*args.callbacks, *extra]}) if extra else args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ray-trainer",
        description="Distributed PyTorch training on Ray, built around callbacks.",
    )
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

    # The cluster commands define their own options, beside the code that reads them.
    from ray_trainer._driver import status, submit

    status.add_parser(sub)
    submit.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if getattr(opts, "main", None) is not None:  # a command with its own entry point
        return opts.main(opts)
    from ray_trainer._driver.checks import ResourceRequestError
    from ray_trainer._driver.launch import RunFailedError, run_training

    try:
        if opts.command == "run":
            args = TrainingArgs.from_yaml(opts.config, opts.overrides)
        else:
            args = _demo_args(opts)
        args = _with_default_callbacks(args, quiet=opts.quiet, demo=opts.command == "demo")
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
