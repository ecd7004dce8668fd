"""Terminal (or anywhere): ``ray-trainer ledger RUN``, a GRPO run's per-prompt ledger checked.

Reads ``<run>/ledger/`` (local or a bucket; ``_worker/objectives/grpo_states.py`` writes it) and
prints how the run ended, then per epoch the prompts trained once, more than once and never in
the run's final lineage (the steps a resume rolled back do not count), and those dropped as stale
or asked for again after a lost engine (``_objectives/grpo_ledger.audit``). Every epoch is
checked for what its steps dealt (``Audit.due``), the one the run ended in too when the run
ended cleanly (its last step, its ``max_steps``, a stop); a run that failed or still runs leaves
that one checked for repeats only, and says so. Exit 0 when the ledger is whole, 1 when a prompt
was trained twice or left out, 2 when there is no ledger to read.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ray_trainer._objectives.grpo_ledger import audit, read_states
from ray_trainer._storage import is_uri, locate

EXIT_OK, EXIT_PROBLEM, EXIT_INPUT = 0, 1, 2


def ledger_main(opts: argparse.Namespace) -> int:
    """``ray-trainer ledger RUN [--storage-path PATH]``."""
    run = opts.run
    given = "/" in run or os.sep in run or is_uri(run)
    folder = (locate(run) if given else locate(opts.storage_path).child(run)).child("ledger")
    try:
        segments = read_states(folder) if folder.is_dir() else []
    except (ValueError, KeyError) as e:  # LedgerError is a ValueError
        print(f"ray-trainer: error: {folder.name} cannot be read: {e}", file=sys.stderr)
        return EXIT_INPUT
    if not segments:
        print(
            f"ray-trainer: error: no prompt ledger in {folder.name}: pass a GRPO run's folder, "
            "or its name with --storage-path (the run's storage_path)",
            file=sys.stderr,
        )
        return EXIT_INPUT
    found = audit(segments)
    lines, ok = found.report()
    starts = len({(s.launch, s.attempt) for s in segments})
    print(f"{folder.name}: {starts} worker-group start(s)")
    for line in lines:
        print(f"  {line}")
    unchecked = "" if found.end else " (the last epoch for repeats only: the run did not end)"
    print(
        f"whole: every prompt trained once per epoch{unchecked}" if ok else "NOT whole: see above"
    )
    return EXIT_OK if ok else EXIT_PROBLEM


def add_parser(sub: Any) -> None:
    """The ``ledger`` subcommand's options (``sub`` is argparse's subparsers object)."""
    ledger = sub.add_parser(
        "ledger",
        help="check a GRPO run's per-prompt ledger: every prompt trained once per epoch",
        description="Read a GRPO run's per-prompt ledger (<run>/ledger/) and say how the run "
        "ended and, per epoch, which prompts its steps dealt were trained once, more than once "
        "or never (the epoch the run ended in too, unless the run failed or still runs), and "
        "how many were dropped as stale or asked for again. Exit 0: whole; 1: a prompt trained "
        "twice or left out; 2: no ledger.",
    )
    ledger.add_argument(
        "run", metavar="RUN", help="a run name under --storage-path, or a run folder (or s3://...)"
    )
    ledger.add_argument(
        "--storage-path",
        default="./runs",
        help="where runs are (the run's storage_path; default ./runs)",
    )
    ledger.set_defaults(main=ledger_main)


__all__ = ["add_parser", "ledger_main"]
