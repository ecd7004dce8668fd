"""Driver (and the user's terminal): the ``ray-trainer`` command, parse, build, fit, report.

Runs in the driver process (a terminal, or the entrypoint of a Ray job); ``status`` and
``submit`` run in the user's terminal.

    ray-trainer run CONFIG.yaml [--set key=value ...]
    ray-trainer demo [--num-workers 2] [--max-steps N] [--set key=value ...]
    ray-trainer status RUN_NAME [--address http://HOST:8265 | HOST:PORT] [--json]
    ray-trainer save RUN_NAME [--address ...]     ray-trainer stop RUN_NAME [--address ...]
    ray-trainer submit CONFIG.yaml --address http://HOST:8265 [--set key=value ...] [--no-wait]

Exit codes of ``run`` and ``demo``: 0 trained, 1 training failed, 2 bad input (refused before
anything ran; one message naming the config file and the entry), 128 + N after a clean stop on
signal N (143 for SIGTERM, as ``ray job stop`` sends; 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ray_trainer._config.args import TrainingArgs
from ray_trainer._config.files import import_entries, parse_overrides
from ray_trainer._errors import TrainingArgsError

#: Exit codes of ``run`` and ``demo``: 0 trained, 1 training failed, 2 bad input (nothing ran);
#: 128 + N after a clean, checkpointed stop on signal N (143 SIGTERM, 130 Ctrl-C; a second
#: signal aborts, also 130).
EXIT_OK, EXIT_FAILED, EXIT_INPUT = 0, 1, 2


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


_SET_HELP = (
    "override a TrainingArgs field, the value parsed as YAML (repeatable), e.g. "
    "--set max_steps=200 --set storage_path=/mnt/runs; KEY=null unsets a field"
)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    from ray_trainer._demo import DEMO_DEFAULTS

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(
        prog="ray-trainer",
        description="Distributed PyTorch training on Ray, built around callbacks.",
        epilog="Run 'ray-trainer COMMAND --help' for the options of a command.",
        formatter_class=formatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser(
        "run",
        help="train with the TrainingArgs in a YAML file",
        description="Train with the TrainingArgs fields in a YAML file, on the Ray cluster at "
        "RAY_ADDRESS (or ray_address), else on an embedded local Ray.",
        formatter_class=formatter,
    )
    run.add_argument("config", help="YAML file of TrainingArgs fields")
    run.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP
    )
    run.add_argument("--quiet", action="store_true", help="no per-log progress lines")

    demo = sub.add_parser(
        "demo",
        help="train the built-in demo (no download)",
        description="Train the built-in demo: a tiny transformer learning 3-digit addition, on "
        "data generated on the spot (nothing is downloaded); about 2 minutes on 2 CPU cores.",
        formatter_class=formatter,
    )
    demo.add_argument(
        "--num-workers", type=_positive_int, default=2, help="training workers (processes)"
    )
    demo.add_argument(
        "--max-steps",
        type=_positive_int,
        default=DEMO_DEFAULTS["max_steps"],
        help="optimizer steps to train for",
    )
    demo.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=_SET_HELP
    )
    demo.add_argument("--quiet", action="store_true", help="no per-log progress lines")

    # The cluster commands define their own options, beside the code that reads them.
    from ray_trainer._client import control, grafana, ledger, plot, status, submit

    status.add_parser(sub)
    grafana.add_parser(sub)
    plot.add_parser(sub)
    ledger.add_parser(sub)
    control.add_parsers(sub)
    submit.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(argv)
    if getattr(opts, "main", None) is not None:  # a command with its own entry point
        return opts.main(opts)
    from callbacks import CallbackPicklingError
    from ray_trainer._driver.checks.resources import ResourceRequestError
    from ray_trainer._driver.launch import RunFailedError, run_training
    from ray_trainer._driver.signals import exit_code_of

    source = opts.config if opts.command == "run" else "demo"
    try:
        if opts.command == "run":
            args = TrainingArgs.from_yaml(opts.config, opts.overrides)
        else:
            args = _demo_args(opts)
        args = _with_default_callbacks(args, quiet=opts.quiet, demo=opts.command == "demo")
        result = run_training(args)
    except CallbackPicklingError as e:  # a callback of the config that cannot travel
        print(f"ray-trainer: error: {source}: {e}", file=sys.stderr)
        return EXIT_INPUT
    except (TrainingArgsError, ResourceRequestError, FileNotFoundError, ValueError) as e:
        print(f"ray-trainer: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except RunFailedError as e:
        print(f"ray-trainer: run failed: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as e:  # a second SIGTERM/SIGINT: aborted, nothing more saved
        print(f"ray-trainer: aborted: {e}", file=sys.stderr)
        return 130
    print(result.summary(), flush=True)
    return exit_code_of(result.stop_reason) or EXIT_OK


def _demo_args(opts: argparse.Namespace) -> TrainingArgs:
    from ray_trainer._demo import DEMO_DEFAULTS

    fields: dict[str, Any] = {
        "num_workers": opts.num_workers,
        "max_steps": opts.max_steps,
        "batch_size": DEMO_DEFAULTS["batch_size"],
        "learning_rate": DEMO_DEFAULTS["learning_rate"],
        "warmup_steps": DEMO_DEFAULTS["warmup_steps"],
        "eval_every_steps": DEMO_DEFAULTS.get("eval_every_steps", 100),
        "log_every_steps": 20,
        "storage_path": "./runs",
    }
    fields.update(parse_overrides(opts.overrides))
    # Callbacks given with --set are imported as in a config file.
    return TrainingArgs.coerce(import_entries(fields, "--set"))


if __name__ == "__main__":
    sys.exit(main())
