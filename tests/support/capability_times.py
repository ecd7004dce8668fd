"""pytest plugin (both tiers, loaded by ``-p capability_times`` in pyproject.toml): after the
run, the seconds each capability's tests took, so that a CI log shows what a capability costs
(GRPO's budget, and its asynchronous mode's: "CI grows by at most 3 minutes").

A test belongs to every capability whose pattern its node id matches (a module, a fixture's
test or a parameter). The seconds are its setup, call and teardown summed; a session fixture's
setup falls in the first test that asks for it. Under pytest-xdist (the unit tier) the tests run
in parallel: the tier's wall share is about the sum over the processes.
"""

from __future__ import annotations

import collections
import re

import pytest

#: Capability -> the node ids it takes.
CAPABILITIES = {
    "grpo": re.compile(r"grpo|rollout|reward"),
    "dpo": re.compile(r"dpo|preference"),
    "qlora": re.compile(r"qlora|nf4"),
    "elastic and node loss": re.compile(r"elastic|node_loss|lost_nodes"),
    "multi-node cluster": re.compile(r"test_multinode"),
}

_seconds: collections.Counter[str] = collections.Counter()
_tests: dict[str, set[str]] = collections.defaultdict(set)
_all = [0.0]


def pytest_runtest_logreport(report) -> None:
    _all[0] += report.duration
    for name, pattern in CAPABILITIES.items():
        if pattern.search(report.nodeid):
            _seconds[name] += report.duration
            _tests[name].add(report.nodeid)


@pytest.hookimpl(trylast=True)  # after --durations' list: the last lines of the log
def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _all[0]:
        return
    workers = getattr(config.option, "numprocesses", None) or 1
    parts = [f"{name} {_seconds[name]:.1f} s ({len(_tests[name])} tests)"
             for name in CAPABILITIES if _tests[name]]  # fmt: skip
    terminalreporter.write_line(
        f"seconds by capability (summed over {workers} process(es); all tests "
        f"{_all[0]:.1f} s): " + "; ".join(parts)
    )
