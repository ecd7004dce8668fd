"""Make `tests/` importable (shared builders such as `tiny_hf`) for unit and integration tests."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
