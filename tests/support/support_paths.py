"""Where the shared test helpers live, for the processes that do not get pytest's `sys.path`.

pytest puts this folder on its own `sys.path` (`pythonpath` in pyproject.toml), and spawned
Python processes inherit it; Ray workers, the callback actor and the scripts a test starts do
not, so they get it through `PYTHONPATH` (a job's `runtime_env`, or a subprocess's environment).
"""

from __future__ import annotations

import os

#: This folder: `rt_support`, `slow_storage` and the driver scripts.
SUPPORT = os.path.dirname(os.path.abspath(__file__))


def pythonpath(*first: str, env: dict[str, str] | None = None) -> str:
    """A `PYTHONPATH` value: `first`, then this folder, then what `env` (default: this process's
    environment) already has, so that a checkout's `ray_trainer` named there is still found."""
    current = (os.environ if env is None else env).get("PYTHONPATH")
    return os.pathsep.join(p for p in (*first, SUPPORT, current) if p)
