"""A busy machine: what others took of the CPU is read per round, a round they slowed gives no
speedup, an arm resting on such rounds is noisy (its time ratio kept, never called a speedup), and
the thread count and OpenMP waiting are chosen from a probe of the machine at start."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
import pandas as pd
import pytest

from ablate.experiment import run as run_module
from ablate.experiment.summary import summarise_arms
from ablate.measure import cpu_load, cpu_policy
from ablate.measure.cpu_load import CpuReading, CpuShare, share_between
from ablate.report.console_table import console_table
from ablate.report.tables import summary_notes
from ablate.report.wandb_log import round_metrics, summary_metrics
from test_rounds import tiny_experiment


def reading(at: float, busy: float, own: float, steal: float = 0.0, switches: int = 0,
            waited: float | None = None) -> CpuReading:
    return CpuReading(at, busy, steal, own, switches, waited)


@pytest.fixture
def threshold(monkeypatch):
    """The shipped threshold (the suite runs with ABLATE_MIN_CPU_SHARE=0: nothing contended)."""
    monkeypatch.delenv("ABLATE_MIN_CPU_SHARE")
    return cpu_load.min_left_share()


@pytest.mark.parametrize("threads, waited, steal, left", [
    (2, 0.0, 0.0, 1.0),         # quiet
    (2, 2.0, 0.0, 0.5),         # our two threads waited a second each of the two: half our time
    (1, 0.5, 0.0, 0.75),
    (4, 0.0, 0.1, 0.9),         # a hypervisor's steal counts like a neighbour
    (2, 5.0, 0.0, 0.0),         # never below 0
])
def test_the_share_left_is_what_our_threads_did_not_wait(threads, waited, steal, left):
    own = 1.5 * threads          # what we ran, and what others ran, are not waiting
    start = reading(10.0, 100.0, 5.0, waited=3.0)
    end = reading(12.0, 100.0 + own + 6.0, 5.0 + own, 2 * 4 * steal, 7, waited=3.0 + waited)
    share = share_between(start, end, threads, 4)
    assert share.from_schedstat and share.others_cores == pytest.approx(3.0)
    assert share.steal_share == pytest.approx(steal)
    assert share.cpu_left_share == pytest.approx(left)
    assert share.cpu_time_share == pytest.approx(own / (2 * threads))
    assert share.involuntary_switches == 7


@pytest.mark.parametrize("others, left", [
    (0.0, 1.0 - 4 * cpu_load.TICK_S / 4),    # nobody else ran: our processes waited for each other (but a tick a CPU)
    (0.5, 0.75 - 4 * cpu_load.TICK_S / 4),   # others ran 1 core-second of the 2 s: at most that much waiting is theirs
    (4.0, 0.0),                              # others ran longer than we waited: all of it counts
])
def test_waiting_counts_only_up_to_what_others_ran(others, left):
    """An outside engine whose server and workers outnumber the cores (vLLM on 2) waits for itself: that is
    how it runs, not contention, and must not leave its arm out as contended."""
    own = 3.0                   # a descendant's CPU time is ours (the engine's worker processes)
    share = share_between(reading(10.0, 100.0, 5.0, waited=0.0),
                          reading(12.0, 100.0 + own + 2 * others, 5.0 + own, waited=4.0), 2, 2)
    assert share.others_cores == pytest.approx(others)
    assert share.cpu_left_share == pytest.approx(left)


@pytest.mark.parametrize("threads, cpus, others, left", [
    (2, 2, 0.0, 1.0), (2, 2, 1.0, 0.5),
    (1, 2, 1.0, 1.0),           # a 1-thread run: the neighbour uses the CPU we leave free
    (1, 2, 1.5, 0.5),           # more than the free CPU: the rest is ours it took
])
def test_without_schedstat_what_others_took_of_our_cores_stands_in(threads, cpus, others, left):
    own = 1.5 * threads
    share = share_between(reading(10.0, 100.0, 5.0), reading(12.0, 100.0 + 2 * others + own, 5.0 + own),
                          threads, cpus)
    assert not share.from_schedstat and share.cpu_left_share == pytest.approx(left)


def test_contended_is_below_the_threshold(threshold, monkeypatch):
    def share(left: float, wall: float = 1.0, schedstat: bool = True) -> CpuShare:
        return CpuShare(wall, 2, 2, 1.0, 0.0, 0.0, 1 - left, left, 0, 0.5, schedstat)
    assert share(threshold - 0.05).contended and not share(threshold + 0.05).contended
    assert share(0.5, wall=0.01).contended                       # schedstat counts nanoseconds
    assert not share(0.5, wall=0.01, schedstat=False).contended  # 10 ms half taken: jiffies cannot tell
    assert share(0.5).row()["contended"] is True and set(share(0.5).row()) >= {
        "cpu_time_share", "cpu_others_cores", "cpu_steal_share", "cpu_wait_share", "cpu_left_share",
        "involuntary_switches", "load_1m"}
    monkeypatch.setenv("ABLATE_MIN_CPU_SHARE", "0")
    assert not share(0.0).contended


@pytest.mark.parametrize("value", ["abc", "1.5", "-0.1", "nan"])
def test_a_bad_threshold_names_the_variable_and_its_range(monkeypatch, value):
    monkeypatch.setenv("ABLATE_MIN_CPU_SHARE", value)
    with pytest.raises(ValueError, match=r"ABLATE_MIN_CPU_SHARE=.*between 0 and 1"):
        cpu_load.min_left_share()


def test_a_meter_reads_this_process_and_the_machine():
    with cpu_load.CpuShareMeter(threads=1) as meter:
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:       # our own work is ours, not others'
            pass
    share = meter.share
    assert share is not None and share.wall_s >= 0.2 and share.from_schedstat
    # a thread that always wants the CPU either ran or waited for it, however busy the machine is
    assert share.cpu_time_share + share.cpu_wait_share == pytest.approx(1.0, abs=0.1), share
    assert 0 <= meter.row()["cpu_left_share"] <= 1


# -- the summary: contended rounds left out, an arm resting on them is noisy --------------------------

def runs_frame(durations: dict[str, list[float]], contended: dict[str, set[int]]) -> pd.DataFrame:
    return pd.DataFrame([{"arm": arm, "label": arm, "repeat": r, "duration_s": d, "status": "ok", "status_detail": "",
                          "contended": r in contended.get(arm, set())}
                         for arm, values in durations.items() for r, d in enumerate(values)])


def test_contended_rounds_are_left_out_of_the_speedup():
    runs = runs_frame({"base": [2.0, 2.0, 2.0, 2.0, 9.0], "fast": [1.0, 1.0, 1.0, 1.0, 1.0]}, {"base": {4}})
    row = summarise_arms(runs, [], "base", {}).set_index("arm").loc["fast"]
    assert row["status"] == "ok" and row["speedup"] == pytest.approx(2.0) and row["speedup_rounds"] == 4
    assert row["contended_rounds"] == 1


@pytest.mark.parametrize("contended", [{"base": {0, 1, 2}}, {"fast": {0, 1, 2}}, {"base": {0, 1}, "fast": {2}}])
def test_an_arm_with_too_few_clean_rounds_is_noisy_with_its_time_ratio_not_a_speedup(contended):
    runs = runs_frame({"base": [2.0, 3.0, 2.5, 2.0], "fast": [1.0, 1.0, 1.0, 1.0]}, contended)
    summary = summarise_arms(runs, [], "base", {}).set_index("arm")
    fast = summary.loc["fast"]
    assert fast["status"] == "noisy" and math.isnan(fast["speedup"]) and "no speedup" in fast["status_detail"]
    assert len(f"fast: NOISY: {fast['status_detail']}") <= 100       # whole on the console
    assert fast["time_ratio"] == pytest.approx(np.exp(np.log([2.0, 3.0, 2.5, 2.0]).mean()))
    assert fast["time_ratio_ci_low"] < fast["time_ratio"] < fast["time_ratio_ci_high"]
    text = console_table(summary.reset_index(), [])
    ratio = f"{fast['time_ratio']:.2f}x"
    assert f"NOISY ({ratio} time)" in text and f"{ratio} [" not in text
    assert any("fast: NOISY:" in note for note in summary_notes(summary.reset_index(), []))
    logged = summary_metrics(summary.reset_index(), [])
    assert "speedup/fast" not in logged and logged["status/fast"] == "noisy" and "time_ratio/fast" in logged
    assert "other work took the CPU in" in logged["status_detail/fast"]


def test_few_rounds_without_contention_are_not_noisy():
    runs = runs_frame({"base": [2.0, 2.0], "fast": [1.0, 1.0]}, {})
    fast = summarise_arms(runs, [], "base", {}).set_index("arm").loc["fast"]
    assert fast["status"] == "ok" and fast["speedup"] == pytest.approx(2.0) and math.isnan(fast["speedup_ci_low"])


def test_runs_without_the_column_read_as_uncontended():
    runs = runs_frame({"base": [2.0, 2.1, 1.9], "fast": [1.0, 1.0, 1.0]}, {}).drop(columns="contended")
    assert summarise_arms(runs, [], "base", {}).set_index("arm").loc["fast", "status"] == "ok"


def test_each_round_records_what_the_cpu_did(registry):
    result = tiny_experiment(registry, {"baseline": {}, "cached": {"kv_cache": "contiguous"}}, repeats=3)
    for column in ("cpu_time_share", "cpu_others_cores", "cpu_steal_share", "cpu_wait_share", "cpu_left_share",
                   "involuntary_switches", "load_1m", "contended"):
        assert column in result.runs and result.runs[column].notna().all(), column
    steps = round_metrics(result.runs, [])
    assert "cpu_left_share/cached" in steps[0] and "contended/cached" in steps[0]


@contextmanager
def contended_rounds(monkeypatch, rounds: set[int]):
    """The meter reports the arms' runs of these rounds (counted from 0 over measured runs) as contended."""
    runs = iter(range(10_000))

    class Meter(cpu_load.CpuShareMeter):
        def __exit__(self, *exc):
            index = next(runs)
            left = 0.3 if index // 2 in rounds else 1.0
            self.share = CpuShare(1.0, 1, 1, 1.0, 0.0, 0.0, 1 - left, left, 0, 0.0, True)
    monkeypatch.setattr(run_module, "CpuShareMeter", Meter)
    yield


def test_contended_rounds_are_measured_again_where_max_repeats_allows(registry, monkeypatch, threshold):
    arms = {"baseline": {}, "cached": {"kv_cache": "contiguous"}}
    with contended_rounds(monkeypatch, {1, 2}):
        result = tiny_experiment(registry, arms, repeats=3, max_repeats=8, ci_target=10.0)
    assert result.runs["repeat"].nunique() == 5          # 3 clean rounds, whatever the 2 contended ones
    cached = result.summary.set_index("arm").loc["cached"]
    assert cached["status"] == "ok" and cached["speedup_rounds"] == 3 and cached["contended_rounds"] == 2


def test_without_room_for_more_rounds_the_arm_is_noisy(registry, monkeypatch, threshold):
    arms = {"baseline": {}, "cached": {"kv_cache": "contiguous"}}
    with contended_rounds(monkeypatch, {0, 2}):
        result = tiny_experiment(registry, arms, repeats=3)
    summary = result.summary.set_index("arm")
    assert result.runs["repeat"].nunique() == 3
    assert (summary["status"] == "noisy").all() and summary["speedup"].isna().all()


# -- a real busy machine -------------------------------------------------------------------------------

@contextmanager
def busy_neighbours(count: int):
    """`count` processes spinning on the CPU until the block ends (at most 120 s whatever happens)."""
    spin = "import time\nend = time.time() + 120\nwhile time.time() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        time.sleep(0.3)          # scheduled and spinning
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


POLICY = ("import json, os\nfrom ablate.measure import cpu_policy\np = cpu_policy.prepare()\n"
          "print(json.dumps(p.record() | {'OMP_WAIT_POLICY': os.environ.get('OMP_WAIT_POLICY')}))")


def policy_in_new_process(**env) -> dict:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                                  "OMP_NUM_THREADS", "ABLATE_CPU_POLICY")}
    out = subprocess.run([sys.executable, "-c", POLICY], env=environ | env, capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.slow     # busy processes for a few seconds
def test_the_policy_sees_busy_neighbours_and_lets_threads_sleep():
    cpus = len(cpu_load.usable_cpus())
    with busy_neighbours(cpus):
        shared = policy_in_new_process()
        kept = policy_in_new_process(OMP_WAIT_POLICY="ACTIVE")
        off = policy_in_new_process(ABLATE_CPU_POLICY="off")
    assert shared["machine"] == "shared" and shared["others_cores"] > 0.5 * cpus, shared
    assert shared["max_threads"] <= max(1, cpus // 2) and shared["OMP_WAIT_POLICY"] == "PASSIVE"
    assert kept["OMP_WAIT_POLICY"] == "ACTIVE" and "set in the environment" in kept["reason"]
    assert off["machine"] == "not probed" and off["OMP_WAIT_POLICY"] is None


@pytest.mark.parametrize("cpus, others, steal, expected", [
    (2, 0.05, 0.0, (0, "quiet")), (2, 1.0, 0.0, (1, "shared")), (2, 0.3, 0.0, (2, "shared")),
    (2, 2.5, 0.0, (1, "shared")), (16, 3.0, 1.0, (12, "shared")), (8, 0.0, 0.3, (8, "shared")), (8, 0.0, 1.6, (6, "shared")),
])
def test_threads_are_the_cpus_others_leave(cpus, others, steal, expected):
    assert cpu_policy.decide(cpus, others, steal) == expected


def test_threads_for_a_job(monkeypatch):
    monkeypatch.setattr(cpu_policy, "_chosen", cpu_policy.CpuPolicy(1, "passive", "shared", "", 2, 1.0, 0.0, 1.0, 0.3))
    assert cpu_policy.threads_for_job(4, 2) == 4           # threads=N wins
    assert cpu_policy.threads_for_job(0, 2) == 1
    monkeypatch.setattr(cpu_policy, "_chosen", cpu_policy.CpuPolicy(0, "openmp default", "quiet", "", 2, 0.0, 0.0,
                                                                    0.1, 0.3))
    assert cpu_policy.threads_for_job(0, 2) == 2           # quiet: torch's own count


@pytest.mark.slow     # a tiny experiment beside busy processes
def test_on_a_busy_machine_no_speedup_is_claimed(registry, threshold):
    arms = {"baseline": {}, "cached": {"kv_cache": "contiguous"}}
    with busy_neighbours(2 * len(cpu_load.usable_cpus())):
        result = tiny_experiment(registry, arms, repeats=3)
    assert result.runs["contended"].all(), result.runs[["arm", "repeat", "cpu_left_share"]]
    summary = result.summary.set_index("arm")
    assert (summary["status"] == "noisy").all() and summary["speedup"].isna().all()
