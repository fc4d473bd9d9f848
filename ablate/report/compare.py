"""`python -m ablate compare <run> <run>`: two runs side by side, what differs between them, and
whether each difference is beyond noise.

For each grid point x arm present in both runs and each metric: the geometric mean over repeats of
each, the ratio B / A and its 95% CI by Welch's t on the logs (ablate.analysis.stats.
log_ratio_interval: the two runs' repeats are independent samples). A difference is beyond noise
when that CI excludes 1; with fewer than 3 repeats on a side there is no interval and nothing is
claimed ("n/a"). Speedup is compared on its per-round ratios
(baseline time / arm time within one round), so a machine that got slower for both arms alike does
not show up as a change of speedup.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ablate.analysis.stats import Interval, log_ratio_interval
from ablate.report.declared import Declarations
from ablate.results import TABLES, Results, load

METRICS = ("speedup", "duration_s", "output_throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
           "tpot_p99_ms", "peak_memory_bytes", "kv_reserved_peak_bytes")
NOT_COMPARED = ("results_dir", "wandb", "redo")      # config keys that say where, not what, was measured
# environment.json keys whose difference is shown (tf32: whether fp32 matmuls ran in TF32)
ENVIRONMENT = ("device", "device_name", "tf32", "git_commit", "python", "platform", "versions")


class RunUnreadable(ValueError):
    """A run folder that cannot be read or holds no runs: the message names the folder (or the file)."""


def load_readable(path: str | Path) -> Results:
    """ablate.results.load, with one message naming the file when one is truncated or corrupt."""
    path = Path(path)
    if not path.is_dir():
        raise RunUnreadable(f"{path}: no such run folder (run folders live in results/<experiment>/<run-id>/)")
    try:
        return load(path)
    except FileNotFoundError as err:
        raise RunUnreadable(f"{err.filename}: missing; the run folder is incomplete" if err.filename
                            else str(err)) from None
    except (OSError, ValueError, pd.errors.ParserError) as err:
        for name in ("config.json", "environment.json"):
            try:
                json.loads((path / name).read_text())
            except (OSError, ValueError):
                raise RunUnreadable(f"{path / name}: missing, truncated or not valid JSON ({err}); the run "
                                    "folder is corrupt: re-run its config with redo=true") from None
        bad = next((path / f"{name}.csv" for name in TABLES if _unreadable_csv(path / f"{name}.csv")), path)
        raise RunUnreadable(f"{bad}: truncated or unreadable ({type(err).__name__}: {err}); re-run its config "
                            "with redo=true") from None


def _unreadable_csv(file: Path) -> bool:
    try:
        if file.exists() and file.stat().st_size > 1:
            pd.read_csv(file)
    except (OSError, ValueError, pd.errors.ParserError):
        return True
    return False


def why_no_runs(path: Path) -> str:
    """Why a run folder holds no runs: it failed (failed.json's error), never finished, or runs.csv is gone."""
    try:
        failed = json.loads((path / "failed.json").read_text())
        return f"the run failed ({failed.get('status', 'failed')}: {failed.get('error')})"
    except (OSError, ValueError, AttributeError):
        pass
    if not (path / "done.json").exists():
        return "the run never finished (no done.json): it is still running, or it was stopped"
    return "runs.csv is missing, empty or has no 'arm' column"


def load_runs(path: str | Path) -> Results:
    """A run folder with its per-round runs, or a RunUnreadable naming the folder and why not."""
    res = load_readable(path)
    if res.runs.empty or not {"arm", "repeat", "duration_s"} <= set(res.runs.columns):
        raise RunUnreadable(f"{path}: no runs to compare: {why_no_runs(Path(path))}")
    if not (Path(path) / "done.json").exists():     # the rounds it kept are partial: not the run as configured
        raise RunUnreadable(f"{path}: {why_no_runs(Path(path))}; its {res.runs['repeat'].nunique()} kept round(s) "
                            "are partial: run the same config again to finish it, then compare")
    return res


def verdict(interval: Interval) -> str:
    """Beyond noise only where an interval exists and excludes 1."""
    if not interval.is_supported:
        return f"n/a ({interval.note})" if interval.note else "n/a"
    return "beyond noise" if interval.excludes(1.0) else "within noise"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}"""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, value in A, value in B) for every flattened key whose values differ."""
    fa, fb = flatten(a), flatten(b)
    return [(k, fa.get(k, "-"), fb.get(k, "-")) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]


def baseline_arm(res: Results) -> str:
    """The arm speedups are relative to, as ablate.experiment.run chose it: experiment.baseline, else the
    first arm. config.json stores the arms with sorted keys, so the first arm is read from runs.csv
    instead: round 0 runs the arms in their order and its rows come first."""
    named = (res.config.get("experiment") or {}).get("baseline")
    return named or res.runs.loc[res.runs["repeat"] == 0, "arm"].iloc[0]


def grid_runs(res: Results, point_keys: list[str]) -> pd.DataFrame:
    """runs with a column per grid key: a key that is not this run's grid gets its workload's value
    (a run at prompt_len=32 matches the prompt_len=32 point of a run that swept prompt_len)."""
    workload = res.config.get("workload") or {}
    return res.runs.assign(**{k: workload.get(k) for k in point_keys if k not in res.runs})


def with_round_speedups(res: Results, point_keys: list[str]) -> pd.DataFrame:
    """runs plus `speedup`: the baseline's time / the arm's time, in the same round and grid point."""
    runs = grid_runs(res, point_keys)
    base = runs[runs["arm"] == baseline_arm(res)][[*point_keys, "repeat", "duration_s"]]
    merged = runs.merge(base.rename(columns={"duration_s": "_baseline_s"}), on=[*point_keys, "repeat"], how="left")
    return merged.assign(speedup=merged["_baseline_s"] / merged["duration_s"]).drop(columns="_baseline_s")


def compare(path_a: str, path_b: str) -> pd.DataFrame:
    """One row per grid point x arm x metric: A and B geometric means, B / A with its CI, the verdict."""
    a, b = load_runs(path_a), load_runs(path_b)
    grids = [list((r.config.get("experiment") or {}).get("grid") or {}) for r in (a, b)]
    point_keys = list(dict.fromkeys(grids[0] + grids[1]))
    runs_a, runs_b = with_round_speedups(a, point_keys), with_round_speedups(b, point_keys)
    keys = [*point_keys, "arm"]
    # the core's metrics, then the numeric stats the plugins of both runs declare in a report table
    declared = {**Declarations.load(a.path).stats, **Declarations.load(b.path).stats}
    metrics = [*METRICS, *(column for column, stat in declared.items() if stat.table and stat.unit != "text")]
    rows = []
    for key, frame_a in runs_a.groupby(keys, sort=False):
        mask = np.logical_and.reduce([runs_b[k] == v for k, v in zip(keys, key)])
        frame_b = runs_b[mask]
        if frame_b.empty:
            continue
        for metric in metrics:
            if metric not in frame_a or metric not in frame_b or frame_a[metric].isna().all():
                continue
            values_a, values_b = frame_a[metric].to_numpy(float), frame_b[metric].to_numpy(float)
            if metric == "speedup" and (values_a == 1).all() and (values_b == 1).all():
                continue     # the baseline against itself
            interval = log_ratio_interval(values_a, values_b)
            num_a, num_b = int(np.sum(~np.isnan(values_a))), int(np.sum(~np.isnan(values_b)))
            rows.append({**dict(zip(keys, key)), "metric": metric, "A": _geometric_mean(values_a),
                         "B": _geometric_mean(values_b), "B/A": interval.center, "ci_low": interval.low,
                         "ci_high": interval.high, "repeats": f"{num_a}/{num_b}", "verdict": verdict(interval)})
    return pd.DataFrame(rows)


def _geometric_mean(values: np.ndarray) -> float:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return np.nan
    return float(np.exp(np.log(values).mean())) if (values > 0).all() else float(np.median(values))


def header(path_a: str, path_b: str) -> list[str]:
    """Which runs, and what differs between them: the measured config, then the environment."""
    a, b = load_readable(path_a), load_readable(path_b)
    lines = [f"A: {path_a}", f"B: {path_b}", ""]
    config = differences({k: v for k, v in a.config.items() if k not in NOT_COMPARED},
                         {k: v for k, v in b.config.items() if k not in NOT_COMPARED})
    lines.append("config (A -> B): " + ("the same" if not config else ""))
    lines += [f"  {k}: {va!r} -> {vb!r}" for k, va, vb in config]
    env = differences({k: a.environment.get(k) for k in ENVIRONMENT}, {k: b.environment.get(k) for k in ENVIRONMENT})
    lines.append("environment (A -> B): " + ("the same" if not env else ""))
    lines += [f"  {k}: {va!r} -> {vb!r}" for k, va, vb in env]
    return lines


def format_table(table: pd.DataFrame) -> str:
    shown = table.assign(**{"95% CI": [f"[{lo:.3f}, {hi:.3f}]" for lo, hi in zip(table["ci_low"], table["ci_high"])]})
    shown = shown.drop(columns=["ci_low", "ci_high"])
    with pd.option_context("display.width", 250, "display.max_rows", 1000, "display.max_colwidth", 40):
        return shown.to_string(index=False, float_format=lambda x: f"{x:,.4g}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ablate compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", help="a run folder (results/<experiment>/<run-id>)")
    parser.add_argument("run_b", help="another run folder, compared against the first (ratios are B / A)")
    args = parser.parse_args(argv)
    try:
        table = compare(args.run_a, args.run_b)
    except RunUnreadable as err:
        raise SystemExit(f"error: {err}") from None
    if table.empty:
        raise SystemExit("the two runs share no grid point and arm")
    print("\n".join(header(args.run_a, args.run_b)) + "\n")
    print(format_table(table))
    beyond = table[table["verdict"] == "beyond noise"]
    print(f"\n{len(beyond)} of {len(table)} differences beyond noise (Welch t 95% CI of B / A excludes 1)")
    where = list(table.columns[:table.columns.get_loc("metric") + 1])     # grid point, arm, metric
    for _, row in beyond.iterrows():
        print(f"  {' '.join(str(row[k]) for k in where)}: B/A {row['B/A']:.3f} [{row['ci_low']:.3f}, "
              f"{row['ci_high']:.3f}]")


if __name__ == "__main__":
    main()
