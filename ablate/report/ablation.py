"""The ablation's part of a run's report: contributions with CIs, interactions, skipped arms, a figure.

Everything is computed from the run folder (config.json, ablation_arms.csv) and the runs table, so
`python -m ablate.report.page <path>` rebuilds it exactly as the run wrote it. The arithmetic and its
rules are in ablate/analysis/ablation_plan.py and ablate/analysis/contributions.py.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from ablate.analysis.ablation_plan import ARMS_TABLE, AblationConfig, parse_ablation  # noqa: E402
from ablate.analysis.contributions import METRICS, contributions  # noqa: E402
from ablate.results import write_file_atomic  # noqa: E402

CONTRIBUTIONS_TABLE = "ablation"      # contributions(): technique x metric x kind
FIGURE = "ablation"
KIND_LABELS = {"add_one_in": "add-one-in", "leave_one_out": "leave-one-out"}


def ablation_config(run_dir: Path) -> AblationConfig | None:
    """The run's ablation, or None for another experiment (or a folder written by hand, without config)."""
    if not (run_dir / "config.json").exists():
        return None
    config = json.loads((run_dir / "config.json").read_text())
    raw = (config.get("experiment") or {}).get("ablation")
    return parse_ablation(raw) if raw else None


def in_plan_order(cfg: AblationConfig, arms: pd.DataFrame) -> AblationConfig:
    """The techniques in the order the run declared them: config.json stores mappings with sorted
    keys, the arm table keeps the plan's order (add-one-in arms follow the declaration)."""
    roles = [r.split("; ") for r in arms["roles"]]

    def position(name: str) -> int:
        return next((i for i, r in enumerate(roles) if f"add-one-in {name}" in r), len(roles))

    return replace(cfg, techniques=sorted(cfg.techniques, key=lambda t: position(t.name)))


def section(run_dir: Path, runs: pd.DataFrame | None) -> tuple[str, dict[str, Path]]:
    """The report's ablation section and its figure; ("", {}) for a run that is not an ablation.
    Writes ablation.csv (the contributions) beside the report."""
    from ablate.results import write_atomic

    cfg = ablation_config(run_dir)
    if cfg is None or runs is None or not (run_dir / f"{ARMS_TABLE}.csv").exists():
        return "", {}
    arms = pd.read_csv(run_dir / f"{ARMS_TABLE}.csv", keep_default_na=False)
    cfg = in_plan_order(cfg, arms)
    table = contributions(runs, arms, cfg)
    write_atomic(run_dir / f"{CONTRIBUTIONS_TABLE}.csv", table.to_csv(index=False))
    figure = plot_contributions(table, cfg, run_dir / f"{FIGURE}.png")
    return markdown(table, arms, cfg, runs, figure), {FIGURE: figure}


def ratio_text(row: pd.Series | None) -> str:
    if row is None or pd.isna(row["ratio"]):
        return "-"
    if pd.isna(row["ci_low"]):
        return f"{row['ratio']:.2f}x [no CI: {row['rounds']} rounds]"
    return f"{row['ratio']:.2f}x [{row['ci_low']:.2f}, {row['ci_high']:.2f}]"


def _row(table: pd.DataFrame, technique: str, metric: str, kind: str) -> pd.Series | None:
    found = table[(table["technique"] == technique) & (table["metric"] == metric) & (table["kind"] == kind)]
    return found.iloc[0] if len(found) else None


def contribution_table(table: pd.DataFrame, cfg: AblationConfig) -> pd.DataFrame:
    """Techniques x (metric, add-one-in | leave-one-out)."""
    rows = []
    for technique in cfg.names:
        row = {"technique": technique}
        for metric, (label, _) in METRICS.items():
            for kind, kind_label in KIND_LABELS.items():
                row[f"{label} {kind_label}"] = ratio_text(_row(table, technique, metric, kind))
        rows.append(row)
    return pd.DataFrame(rows)


def interaction_table(table: pd.DataFrame, kind: str) -> pd.DataFrame:
    """Per technique (or pair) and metric: the ratio that is 1 for independent effects, flagged."""
    judged = table[table["kind"] == kind]
    rows = []
    for technique, frame in judged.groupby("technique", sort=False):
        row = {"technique": technique}
        for metric, (label, _) in METRICS.items():
            found = frame[frame["metric"] == metric]
            if len(found):
                r = found.iloc[0]
                row[label] = ratio_text(r) + (" **interacts**" if r["interacts"] else "")
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(table: pd.DataFrame, arms: pd.DataFrame, cfg: AblationConfig, runs: pd.DataFrame,
             figure: Path) -> str:
    tolerance = f"{cfg.interaction_tolerance:.0%}"
    lines = ["", "## Ablation", "",
             "Techniques (each arm applies their overrides in this order; a technique may replace what one "
             "it requires set):", ""]
    for t in cfg.techniques:
        needs = f" (requires {', '.join(t.requires)})" if t.requires else ""
        lines.append(f"- **{t.name}**: `{json.dumps(t.overrides, sort_keys=True)}`{needs}")
    lines += ["", "Contributions are *with / without* ratios per round (every arm runs once per round, "
              "interleaved), geometric mean [t 95% CI] over rounds (no CI under 3 rounds). **add-one-in** = arm `+t` (t and what it "
              "requires, over the baseline) / the arm of what t requires (the baseline when nothing); "
              "**leave-one-out** = `full` / `-t` (the full system without t and without every technique that "
              "requires t). Throughput: above 1 is better; TTFT, TPOT and KV bytes: below 1 is better. "
              "A ratio over an arm with no KV (the baseline recomputes) has no finite value: `-`.", "",
              contribution_table(table, cfg).to_markdown(index=False), "",
              "- full system / baseline: " + ", ".join(
                  f"{label} {ratio_text(_row(table, 'all', metric, 'full_vs_baseline'))}"
                  for metric, (label, _) in METRICS.items())]
    full_note = table.loc[table["kind"] == "full_vs_baseline", "note"].fillna("")
    if len(full_note) and full_note.iloc[0]:
        lines.append(f"- full system / baseline, read with its cost: {full_note.iloc[0]}")
    notes = table[(table["kind"].isin(list(KIND_LABELS))) & (table["note"].fillna("") != "")]
    for (technique, kind), frame in notes.groupby(["technique", "kind"], sort=False):
        lines.append(f"- {technique} {KIND_LABELS[kind]}: {frame['note'].iloc[0]}")
    backends = _attention_backends(runs)
    if backends:
        lines.append(f"- attention that ran: {backends}")
    if decode_modes(runs):
        lines.append(f"- {decode_modes(runs)}")
    lines += ["", "### Interactions", "",
              "Per technique: leave-one-out / add-one-in of the same change, per round (for a technique that "
              "others require, adding and removing it together with them). It is 1 when the technique's effect "
              "does not depend on the other techniques. **Rule**: a technique *interacts* when the 95% CI "
              f"exists and excludes 1, and the ratio departs from 1 by more than {tolerance} "
              "(experiment.ablation.interaction_tolerance); above 1: the rest of the system amplifies its "
              "effect, below 1: it damps it (for latency and bytes, where lower is better, read it the "
              "other way round).", "", interaction_table(table, "interaction").to_markdown(index=False), ""]
    flagged = table[(table["kind"] == "interaction") & table["interacts"]]
    if len(flagged):
        for technique, frame in flagged.groupby("technique", sort=False):
            labels = ", ".join(METRICS[m][0] for m in frame["metric"])
            lines.append(f"- **{technique}** interacts with the other techniques in: {labels}")
    else:
        lines.append("- no technique interacts beyond the rule above")
    pairs = table[table["kind"] == "pair"]
    lines.append("")
    if len(pairs):
        lines += ["Pairs: (a and b)·(neither) / ((a alone)·(b alone)) per round, 1 when their effects multiply "
                  "independently; the same rule.", "", interaction_table(table, "pair").to_markdown(index=False), ""]
        for pair, frame in pairs[pairs["interacts"]].groupby("technique", sort=False):
            lines.append(f"- **{pair}** are not independent in: {', '.join(METRICS[m][0] for m in frame['metric'])}")
    else:
        lines.append("Pairs of techniques were not measured (experiment.ablation.pairs=true adds an arm per pair "
                     "and its reference): which technique a flagged one interacts with is not identified.")
    quality = quality_table(runs)
    if quality is not None:
        lines += ["", "### Quality per arm", "",
                  "Greedy-token agreement with the baseline's text (median over rounds) and perplexity of held-out "
                  "text through the arm / through the baseline (ablate/experiment/quality_guard.py). A *degraded* "
                  "arm lost quality beyond experiment.quality's limits: every ratio above that uses it carries "
                  "that cost in its note, and none of its time ratios is a speedup of the same output.", "",
                  quality.to_markdown(index=False)]
    skipped = arms[arms["status"] == "skipped"]
    lines += ["", "### Skipped arms", ""]
    if len(skipped):
        lines += [f"- `{r.arm}` ({r.roles}; techniques {r.techniques or 'none'}): {r.reason}"
                  for r in skipped.itertuples()]
    else:
        lines.append(f"- none: all {len(arms)} planned arms were measured")
    lines += ["", f"![{FIGURE}]({figure.name})", "",
              "*Contribution of each technique (with / without, log scale) as add-one-in and leave-one-out, "
              "with t 95% CIs over rounds.*", ""]
    return "\n".join(lines)


def quality_table(runs: pd.DataFrame) -> pd.DataFrame | None:
    """arm, status, perplexity ratio, token agreement; None when the run scored no quality."""
    if "ppl_ratio" not in runs and "token_agreement" not in runs:
        return None
    rows = []
    for arm, frame in runs.groupby("arm", sort=False):
        statuses = frame["status"].fillna("ok")
        status = "degraded" if (statuses == "degraded").any() else statuses.iloc[0]
        ppl = frame["ppl_ratio"].dropna() if "ppl_ratio" in frame else pd.Series(dtype=float)
        agree = frame["token_agreement"].dropna() if "token_agreement" in frame else pd.Series(dtype=float)
        rows.append({"arm": arm, "status": status, "perplexity / baseline": f"{ppl.iloc[0]:.3f}" if len(ppl) else "-",
                     "token agreement": f"{agree.median():.0%}" if len(agree) else "-"})
    return pd.DataFrame(rows)


def decode_modes(runs: pd.DataFrame) -> str:
    """How each arm ran its decode steps under engine.graphs (ablate/engine/graphs.py): "" when no arm
    asked for graphs, else a note naming the arms that replayed CUDA graphs, compiled, or ran eagerly
    and why."""
    if "engine.graphs" not in runs or set(runs["engine.graphs"].dropna()) <= {"eager"}:
        return ""
    found = runs.groupby("arm", sort=False)["engine.graphs"].last()
    return "decode steps: " + "; ".join(f"`{mode}` in {', '.join(group.index)}"
                                        for mode, group in found.groupby(found, sort=False))


def _attention_backends(runs: pd.DataFrame) -> str:
    """Which attention ran in which arms, beside the naive baseline (attention=flash runs SDPA where
    Triton cannot run, and SDPA names the kernel PyTorch picked)."""
    if "attention_backend" not in runs:
        return ""
    found = runs.groupby("arm", sort=False)["attention_backend"].first()
    found = found[found.map(lambda b: isinstance(b, str) and b != "naive")]
    return "; ".join(f"`{backend}` in {', '.join(group.index)}" for backend, group in found.groupby(found, sort=False))


def plot_contributions(table: pd.DataFrame, cfg: AblationConfig, path: Path) -> Path:
    """One panel per metric: each technique's add-one-in and leave-one-out ratio as a bar from 1 (no
    effect) to the geometric mean, CI error bars, log y (a halving and a doubling look alike)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), squeeze=False)
    x = np.arange(len(cfg.names))
    width = 0.38
    for ax, (metric, (label, higher_better)) in zip(axes.flat, METRICS.items()):
        for i, (kind, kind_label) in enumerate(KIND_LABELS.items()):
            rows = [_row(table, t, metric, kind) for t in cfg.names]
            y = np.array([r["ratio"] if r is not None else np.nan for r in rows], dtype=float)
            lo = np.array([r["ci_low"] if r is not None else np.nan for r in rows], dtype=float)
            hi = np.array([r["ci_high"] if r is not None else np.nan for r in rows], dtype=float)
            ok = np.isfinite(y) & (y > 0)     # a ratio over zero KV (recompute) has no bar
            err = np.vstack([np.clip(y - lo, 0, None), np.clip(hi - y, 0, None)])[:, ok]
            ax.bar(x[ok] + (i - 0.5) * width, y[ok] - 1, width, bottom=1, yerr=err, capsize=3, color=f"C{i}",
                   label=kind_label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}x" if v in (0.2, 0.5, 2, 5) else ""))
        ax.set_xticks(x, cfg.names, rotation=25, ha="right")
        ax.set_title(f"{label} ({'higher' if higher_better else 'lower'} is better)", fontsize=10)
        ax.set_ylabel("with / without")
        ax.grid(alpha=0.3, axis="y", which="both")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("What each technique contributes (geometric mean over rounds, t 95% CI)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomic(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return path


def wandb_extras(run_dir: Path) -> tuple[dict[str, float], dict[str, pd.DataFrame]]:
    """W&B summary keys (ablation/<kind>/<technique>/<metric>: ratio) and tables, from the run folder;
    nothing for a run that is not an ablation."""
    contributions_csv = run_dir / f"{CONTRIBUTIONS_TABLE}.csv"
    if not contributions_csv.exists():
        return {}, {}
    table = pd.read_csv(contributions_csv)
    summary = {f"ablation/{r.kind}/{r.technique}/{r.metric}": float(r.ratio)
               for r in table.itertuples() if pd.notna(r.ratio)}
    tables = {CONTRIBUTIONS_TABLE: table, ARMS_TABLE: pd.read_csv(run_dir / f"{ARMS_TABLE}.csv", keep_default_na=False)}
    return summary, tables
