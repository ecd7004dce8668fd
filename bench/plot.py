"""Draw `bench/results.png` from `bench/results.json`: one panel of ratios per benchmark.

Each panel shows every configuration's ratio to its benchmark's baseline (measured in the same
run) as a horizontal bar, the baseline as a line at 1.0, and the target where the benchmark has
one (or, under ``targets``, a target per bar). Used by `run_all.py`; also runs alone to redraw
the plot: python bench/plot.py [bench/results.json] [bench/results.png]
"""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def draw(results: dict[str, Any], path: str) -> None:
    """Write the PNG at `path` for a results dict as `run_all.py` builds it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, b) for name, b in results["benchmarks"].items() if b.get("ratios")]
    if not panels:
        return
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, bench) in zip(axes.flat, panels, strict=False):
        _panel(ax, name, bench)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Ratios to each benchmark's baseline, same run ({results['date']}, "
        f"{'quick' if results.get('quick') else 'full'} run)\n{results['machine']}",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    # No timestamp or version in the file's metadata: the same figures give the same bytes.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def _panel(ax: Any, name: str, bench: dict[str, Any]) -> None:
    ratios: dict[str, float] = bench["ratios"]
    baseline = bench.get("baseline")
    higher_better = bool(bench.get("higher_is_better"))
    labels = list(ratios)
    values = [ratios[k] for k in labels]
    colors = []
    for label, value in zip(labels, values, strict=True):
        if label == baseline:
            colors.append("#9e9e9e")
        elif (value >= 1.0) == higher_better:
            colors.append("#2e7d32")  # better than the baseline
        else:
            colors.append("#c62828")
    y = list(range(len(labels)))[::-1]  # first configuration on top
    ax.barh(y, values, color=colors, height=0.6)
    ax.set_yticks(y, [textwrap.fill(label.replace("`", ""), 42) for label in labels], fontsize=7)
    spread = max(values) / max(min(values), 1e-12)
    if spread > 20:
        ax.set_xscale("log")
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1, label="baseline = 1.0")
    target = bench.get("target")
    if target is not None:
        ax.axvline(
            target,
            color="#ef6c00",
            linestyle=":",
            linewidth=1.5,
            label=f"target {'≥' if higher_better else '≤'} {target:g}",
        )
    _per_bar_targets(ax, labels, y, bench.get("targets") or {})
    for yi, value in zip(y, values, strict=True):
        ax.annotate(
            f"{value:.3g}",
            (value, yi),
            xytext=(3, 0),
            textcoords="offset points",
            va="center",
            fontsize=7,
        )
    better = "higher" if higher_better else "lower"
    ax.set_title(f"{bench.get('title', name)} ({better} is better)", fontsize=9)
    ax.set_xlabel(bench.get("unit", "ratio to baseline"), fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, loc="best")
    ax.margins(x=0.15)


def _per_bar_targets(ax: Any, labels: list[str], y: list[int], targets: dict[str, float]) -> None:
    """A target of its own on each bar that has one (e.g. 1/N + 10% for N workers)."""
    shown = [(yi, targets[label]) for label, yi in zip(labels, y, strict=True) if label in targets]
    for i, (yi, target) in enumerate(shown):
        ax.plot(
            [target, target],
            [yi - 0.4, yi + 0.4],
            color="#ef6c00",
            linestyle=":",
            linewidth=1.5,
            label="target of the bar" if i == 0 else None,
        )


def main() -> None:
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "results.json")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "results.png")
    with open(src) as f:
        draw(json.load(f), out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
