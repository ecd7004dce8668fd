"""Unit-test fixtures: every test leaves the global callback registry as it found it (empty), and
the process environment's Ray settings too (the integration tests run in this process after the
unit tests, and start subprocesses that inherit it)."""

import os

import pytest

from callbacks import global_callbacks

#: Set by Ray itself on import, not by a test.
_SET_BY_RAY = frozenset({"RAY_CLIENT_MODE"})


@pytest.fixture(autouse=True)
def _no_leftover_globals():
    yield
    assert global_callbacks() == [], "a test left a global callback registered"


@pytest.fixture(autouse=True)
def _no_leftover_ray_settings():
    before = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
    keys = (before.keys() | after.keys()) - _SET_BY_RAY
    changed = sorted(k for k in keys if before.get(k) != after.get(k))
    for key in changed:  # put back, so one leak fails one test, not the ones after it
        if key in before:
            os.environ[key] = before[key]
        else:
            os.environ.pop(key, None)
    assert changed == [], f"a test left Ray settings changed in os.environ: {changed}"
