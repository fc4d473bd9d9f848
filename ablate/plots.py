"""The report's figures, drawn from an experiment's summary table (one row per grid point x arm).

Which figures are drawn follows from the columns present: speedup with its CI, throughput,
memory, latency percentiles — each against the first grid key (sequence length, request rate,
k, ...) or, with no grid, per arm as bars.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

FIGURES = {
    # name: (title, [(column, label)], y label, log y)
    "speedup": ("Speedup over the baseline (median, 95% CI)", [("speedup", "")], "speedup (x)", False),
    "throughput": ("Output throughput", [("output_throughput_tok_s", "")], "tokens / s", False),
    "memory": ("Peak memory and KV reserved",
               [("peak_memory_bytes", "peak"), ("kv_reserved_peak_bytes", "KV reserved")], "MiB", False),
    "latency": ("Latency percentiles",
                [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99"), ("tpot_p50_ms", "TPOT p50"),
                 ("tpot_p99_ms", "TPOT p99")], "ms", True),
    "kv_utilisation": ("KV utilisation (used / reserved, time-weighted)",
                       [("kv_util_mean", "measured"), ("kv_cache.predicted_kv_util", "predicted")], "fraction", False),
    "goodput": ("Goodput: requests meeting every SLO", [("goodput_req_s", "")], "requests / s", False),
}


def _values(frame: pd.DataFrame, column: str) -> np.ndarray:
    values = frame[column].to_numpy(float)
    return values / 2**20 if column.endswith("bytes") else values


def draw(summary: pd.DataFrame, point_keys: list[str], out_dir: Path) -> dict[str, Path]:
    """Write one PNG per figure whose columns exist; returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    x_key = point_keys[0] if point_keys else None
    written = {}
    for name, (title, series, ylabel, log_y) in FIGURES.items():
        series = [(c, label) for c, label in series if c in summary and summary[c].notna().any()]
        if not series:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        arms = list(dict.fromkeys(summary["arm"]))
        for column, label in series:
            for i, arm in enumerate(arms):
                frame = summary[summary["arm"] == arm]
                tag = f"{arm} {label}".strip()
                y = _values(frame, column)
                if x_key is not None:
                    x = frame[x_key].to_numpy()
                    if column == "speedup" and "speedup_ci_low" in frame:
                        err = np.vstack([y - frame["speedup_ci_low"], frame["speedup_ci_high"] - y])
                        ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=tag)
                    else:
                        ax.plot(x, y, marker="o", label=tag)
                else:
                    width = 0.8 / len(series)
                    offset = series.index((column, label)) * width
                    yerr = None
                    if column == "speedup" and "speedup_ci_low" in frame:
                        yerr = np.vstack([y - frame["speedup_ci_low"], frame["speedup_ci_high"] - y])
                    ax.bar(i + offset, y, width=width, yerr=yerr, capsize=3,
                           label=label if i == 0 and label else None, color=f"C{series.index((column, label))}")
        if x_key is None:
            ax.set_xticks(range(len(arms)), arms, rotation=20, ha="right")
        else:
            ax.set_xlabel(x_key)
        if log_y:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        if labels:
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written[name] = path
    return written
