"""Unit-test fixtures: every test leaves the global callback registry as it found it (empty)."""

import pytest

from callbacks import global_callbacks


@pytest.fixture(autouse=True)
def _no_leftover_globals():
    yield
    assert global_callbacks() == [], "a test left a global callback registered"
