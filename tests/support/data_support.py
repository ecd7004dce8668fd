"""Encoding a run's data in this process (the preparation tasks' own function, without Ray),
for unit tests of what the workers do with the token cache."""

from __future__ import annotations

from typing import Any


def encode_here(args: Any) -> dict[str, str]:
    """Plan the run's data as the driver does, encode every piece here, complete the caches;
    returns ``field -> cache folder`` as the workers get it."""
    from ray_trainer._data.prepare import encode_piece
    from ray_trainer._driver.data import finish_cache, plan_data

    plans = plan_data(args)
    for plan in plans.values():
        if plan.meta is None:
            results = [
                encode_piece(plan.source, i, piece, plan.settings, plan.cache.name,
                             args.storage_filesystem)
                for i, piece in enumerate(plan.source.pieces)
            ]  # fmt: skip
            plan.meta = finish_cache(plan, args, results, 0.0)
    return {field: plan.cache.name for field, plan in plans.items()}
