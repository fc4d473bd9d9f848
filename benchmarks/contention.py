"""A busy machine: the same experiments quiet and beside busy neighbour processes, side by side.

    .venv/bin/python benchmarks/contention.py [--experiments quickstart,ch08_kv_cache] \\
        [--neighbours 0,1,2,4,2t] [--before REV] [--quiet-policies] [--out DIR] [-- OVERRIDES...]

Each level runs every experiment once as a user would (`python -m ablate +experiment=...`, a fresh
process, W&B off) while the script keeps N neighbours busy: `2` is two processes spinning in Python,
`2t` two torch processes multiplying small matrices on their own OpenMP threads (the kind that slowed
a run 47x). The script starts them, bounds them (each ends by itself after --neighbour-limit-s) and
stops them when the level ends, whatever happens. ch08_kv_cache runs at small settings
(output_len 32 and 64).

Per level, experiment and arm: the process's wall time and its ratio to the quiet run's; the arm's
speedup [95% CI] or, for a noisy arm, its time ratio; its status; how many rounds were contended;
and whether its interval overlaps the quiet run's (`vs quiet`: ok, NOISY where the arm is marked, or
SILENT WRONG: an ok arm whose interval misses the quiet one). The quiet level runs first and is the
reference; the CPU policy each run chose (threads, OpenMP waiting) is read from its environment.json.

--before REV: the quickstart on the quiet machine, this tree and ablate/ at REV (a git worktree on
PYTHONPATH; the plugins are this tree's) alternating, --before-runs each: the quiet path's cost as
the ratio of wall times and of each arm's round times, with Welch t-intervals on the logs.
--quiet-policies: the quickstart on the quiet machine with OpenMP's own waiting, passive waiting,
and threads bound to CPUs (OMP_PROC_BIND=true), twice each: each arm's round times against OpenMP's
own, what the policy keeps on a quiet machine.
Exits 1 when any arm is silently wrong or the 2-neighbour wall time exceeds 3x the quiet one.
"""
from __future__ import annotations

from ablate import process_env

process_env.apply()     # before torch and numpy load, as the CLI does (ablate/process_env.py)

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from ablate.analysis.stats import log_ratio_interval
from ablate.results import load

REPO = Path(__file__).resolve().parent.parent
EXPERIMENTS = {
    "quickstart": ["+experiment=quickstart"],
    "ch08_kv_cache": ["+experiment=ch08_kv_cache", "experiment.grid.output_len=[32,64]"],
}
COMMON = ["wandb.mode=disabled", "redo=true"]
overrides: list[str] = []     # the command line's, for every run (e.g. model=tiny for a quick check)
SPIN = "import time\nend = time.time() + {limit}\nwhile time.time() < end:\n    pass\n"
TORCH = ("import time, torch\nend = time.time() + {limit}\na = torch.randn(256, 256)\n"
         "while time.time() < end:\n    a = torch.tanh(a @ a) \n")
MAX_SLOWDOWN_AT_2 = 3.0


@contextmanager
def neighbours(level: str, limit_s: float):
    """`level` = N (spinning Python) or Nt (torch): that many busy processes for the block's length."""
    count, kind = (int(level[:-1]), TORCH) if level.endswith("t") else (int(level), SPIN)
    procs = [subprocess.Popen([sys.executable, "-c", kind.format(limit=limit_s)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(count)]
    try:
        time.sleep(1.0 if procs else 0)        # running (torch's import included) before the job's probe
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def run_job(argv: list[str], out: Path, env: dict[str, str] | None = None, timeout_s: float = 3600) -> dict:
    """One experiment in a fresh process: its wall time and run folder."""
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ablate", *argv, *COMMON, *overrides, f"results_dir={out}"],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})},
                          timeout=timeout_s)
    wall = time.perf_counter() - started
    (out / "console.log").write_text(done.stdout + done.stderr)
    folders = [p.parent for p in out.glob("*/*/done.json")]
    if done.returncode != 0 or not folders:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {(done.stderr or done.stdout)[-400:]}")
    return {"wall_s": wall, "folder": folders[0]}


def arm_rows(job: dict, experiment: str, level: str) -> list[dict]:
    res = load(job["folder"])
    policy = json.loads((job["folder"] / "environment.json").read_text()).get("cpu_policy") or {}
    rows = []
    for r in res.summary.to_dict("records"):
        noisy = r["status"] == "noisy"
        centre, low, high = ((r.get("time_ratio"), r.get("time_ratio_ci_low"), r.get("time_ratio_ci_high")) if noisy
                             else (r.get("speedup"), r.get("speedup_ci_low"), r.get("speedup_ci_high")))
        point = " ".join(f"{k}={r[k]}" for k in ("output_len",) if k in r and experiment != "quickstart")
        rows.append({"experiment": experiment, "neighbours": level, "arm": f"{r['arm']} {point}".strip(),
                     "wall_s": job["wall_s"], "status": r["status"], "ratio": centre, "ci_low": low, "ci_high": high,
                     "contended_rounds": r.get("contended_rounds", 0), "tok_s": r.get("output_throughput_tok_s"),
                     "threads": policy.get("threads"), "waiting": policy.get("wait_policy"),
                     "machine": policy.get("machine")})
    return rows


def judge(rows: pd.DataFrame) -> pd.DataFrame:
    """wall x quiet, and each arm's interval against the quiet run's."""
    quiet = rows[rows["neighbours"] == "0"].set_index(["experiment", "arm"])
    out = []
    for r in rows.to_dict("records"):
        ref = quiet.loc[(r["experiment"], r["arm"])]
        r["wall_x_quiet"] = r["wall_s"] / ref["wall_s"]
        overlaps = bool(r["ci_low"] <= ref["ci_high"] and ref["ci_low"] <= r["ci_high"])
        r["vs_quiet"] = ("NOISY (marked)" if r["status"] == "noisy" else "ok" if overlaps
                         else "SILENT WRONG" if r["status"] == "ok" else r["status"])
        out.append(r)
    return pd.DataFrame(out)


def interval_text(r: dict) -> str:
    if not np.isfinite(r["ratio"]):
        return "n/a"
    kind = " time" if r["status"] == "noisy" else ""
    return f"{r['ratio']:.2f}x{kind} [{r['ci_low']:.2f}, {r['ci_high']:.2f}]"


def arm_durations(folder: Path) -> dict[str, np.ndarray]:
    """Each arm's run time per round (runs.csv's duration_s)."""
    runs = load(folder).runs
    return {arm: frame["duration_s"].to_numpy(float) for arm, frame in runs.groupby("arm")}


def compared(rows: list[dict], key: str, reference: str) -> pd.DataFrame:
    """Per `key` value but the reference and per arm: its rounds' time / the reference's (Welch t on
    the logs of every round of every run), and the wall time likewise."""
    out = []
    for value in dict.fromkeys(r[key] for r in rows):
        if value == reference:
            continue
        here = [r for r in rows if r[key] == value]
        ref = [r for r in rows if r[key] == reference]
        line = {key: value, f"wall / {reference}": log_ratio_interval([r["wall_s"] for r in ref],
                                                                      [r["wall_s"] for r in here]).text()}
        for arm in ref[0]["durations"]:
            line[f"{arm} time / {reference}"] = log_ratio_interval(
                np.concatenate([r["durations"][arm] for r in ref]),
                np.concatenate([r["durations"][arm] for r in here])).text()
        out.append(line)
    return pd.DataFrame(out)


def before_and_after(rev: str, runs: int, work: Path) -> pd.DataFrame:
    """The quickstart quiet, this tree and `rev` alternating: wall time and each arm's round times."""
    worktree = work / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(worktree), rev], cwd=REPO, check=True,
                   capture_output=True)
    try:
        rows = []
        for i in range(runs):
            for side, env in (("this tree", {}), (rev, {"PYTHONPATH": str(worktree)})):
                job = run_job(EXPERIMENTS["quickstart"], work / f"{side.replace(' ', '_')}-{i}", env)
                rows.append({"side": side, "run": i, "wall_s": job["wall_s"], "durations": arm_durations(job["folder"])})
        return compared(rows, "side", rev)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)


def quiet_policies(work: Path) -> pd.DataFrame:
    """The quickstart on the quiet machine under each OpenMP policy, twice each, interleaved."""
    variants = {"openmp default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "bound": {"OMP_PROC_BIND": "true"}}
    rows = []
    for i in range(2):
        for name, env in variants.items():
            job = run_job(EXPERIMENTS["quickstart"], work / f"policy-{name.replace(' ', '_')}-{i}", env)
            durations = arm_durations(job["folder"])
            rows.append({"policy": name, "wall_s": job["wall_s"], "durations": durations,
                         "contended": int(load(job["folder"]).runs["contended"].sum())})
    print("contended rounds per run: " + ", ".join(f"{r['policy']} {r['contended']}" for r in rows))
    return compared(rows, "policy", "openmp default")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default="quickstart,ch08_kv_cache")
    parser.add_argument("--neighbours", default="0,1,2,4,2t", help="levels: N spinning processes, Nt torch ones")
    parser.add_argument("--neighbour-limit-s", type=float, default=1200, help="each neighbour ends by itself after this")
    parser.add_argument("--before", help="a git revision: the quiet quickstart's cost against it")
    parser.add_argument("--before-runs", type=int, default=3)
    parser.add_argument("--quiet-policies", action="store_true")
    parser.add_argument("--out", help="folder for the tables and every run (default: a temporary folder)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args()
    overrides.extend(args.overrides)
    work = Path(args.out or tempfile.mkdtemp(prefix="contention-"))
    work.mkdir(parents=True, exist_ok=True)
    levels = args.neighbours.split(",")
    if levels[0] != "0":
        raise SystemExit("--neighbours must start with 0: the quiet run is the reference")
    print(f"load before: {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs; results in {work}", flush=True)

    results = {}
    if args.quiet_policies:
        results["quiet_policies"] = policies = quiet_policies(work)
        print(policies.to_string(index=False), flush=True)
    if args.before:
        results["before_after"] = both = before_and_after(args.before, args.before_runs, work)
        print(both.to_string(index=False), flush=True)

    rows = []
    for level in levels:
        for experiment in args.experiments.split(","):
            with neighbours(level, args.neighbour_limit_s):
                load_1m = os.getloadavg()[0]
                job = run_job(EXPERIMENTS[experiment], work / f"{experiment}-{level}")
            rows += [r | {"load_1m": load_1m} for r in arm_rows(job, experiment, level)]
            print(f"{experiment} with {level} neighbours: {job['wall_s']:.0f} s", flush=True)
    table = judge(pd.DataFrame(rows))
    table.to_csv(work / "contention.csv", index=False)
    shown = table.assign(interval=[interval_text(r) for r in table.to_dict("records")])
    print(shown[["experiment", "neighbours", "arm", "wall_s", "wall_x_quiet", "threads", "waiting", "status",
                 "interval", "contended_rounds", "vs_quiet"]].to_string(index=False, float_format=lambda x: f"{x:.2f}"))

    wrong = table[table["vs_quiet"] == "SILENT WRONG"]
    at_two = table[table["neighbours"] == "2"].groupby("experiment")["wall_x_quiet"].first()
    slow = at_two[at_two > MAX_SLOWDOWN_AT_2]
    two = (", ".join(f"{e} {x:.2f}x" for e, x in at_two.items()) + f" the quiet run's (target <= {MAX_SLOWDOWN_AT_2}x)"
           if len(at_two) else "no level of 2 spinning neighbours")
    print(f"silent wrong: {len(wrong)} of {len(table)} rows; wall time with 2 neighbours: {two}")
    (work / "contention.json").write_text(json.dumps({k: v.to_dict("records") for k, v in results.items()}
                                                     | {"levels": table.to_dict("records")}, indent=2, default=str))
    return 1 if len(wrong) or len(slow) else 0


if __name__ == "__main__":
    sys.exit(main())
