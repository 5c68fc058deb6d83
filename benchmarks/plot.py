"""Bar chart of `benchmarks/step.py` results: step time per measurement, per system, with the lower bound.

    python benchmarks/step.py --plot benchmarks/results/step.png
    python benchmarks/plot.py benchmarks/results/results_step_w1.json benchmarks/results/step.png   # from saved JSON
"""

from __future__ import annotations

import json
import sys
from typing import Any

MEASUREMENT_LABELS = {"forward": "forward", "train_sgd": "SGD", "train_adagrad": "Adagrad",
                      "train_rowwise_adagrad": "RowwiseAdagrad"}


def _label(measurement: str) -> str:
    return MEASUREMENT_LABELS.get(measurement, measurement.removeprefix("train_"))


def plot_steps(results: dict[str, Any], path: str) -> None:
    """Grouped bars (log scale, ms): one group per measurement, one bar per system, the bound as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["comparison"]
    measurements = list(dict.fromkeys(r["measurement"] for r in rows))
    systems = {r["system"]: r["label"] for r in rows}
    width = 0.8 / max(1, len(systems))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.8 * len(measurements) + 2), 4.5))
    for k, (key, label) in enumerate(systems.items()):
        times = {r["measurement"]: r["median_ms"] for r in rows if r["system"] == key}
        xs = [i - 0.4 + (k + 0.5) * width for i, m in enumerate(measurements) if m in times]
        bars = ax.bar(xs, [times[m] for m in measurements if m in times], width, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=1)
    bound = results["lower_bound"]["ms"]
    for i, m in enumerate(measurements):
        ax.hlines(bound["issue"][m], i - 0.45, i + 0.45, colors="black", linewidths=1.5,
                  label="lower bound (issue's bandwidths)" if i == 0 else None)
        ax.hlines(bound["measured"][m], i - 0.45, i + 0.45, colors="gray", linestyles="dashed",
                  label="lower bound (numpy-measured)" if i == 0 else None)
    w, env = results["workload"], results["env"]
    ax.set_xticks(range(len(measurements)), [_label(m) for m in measurements])
    ax.set_yscale("log")
    ax.set_ylabel("median ms per step (log scale)")
    ax.set_title(f"workload {w['name']}: {w['tables']} x {w['rows']:,} x {w['dim']}, batch {w['batch']} x "
                 f"{w['ids_per_sample']} ids; CPU, {env['threads']} threads", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python benchmarks/plot.py RESULTS.json OUT.png")
    with open(sys.argv[1]) as f:
        plot_steps(json.load(f), sys.argv[2])
