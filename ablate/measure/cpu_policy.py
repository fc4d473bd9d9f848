"""How many threads a CPU run uses, and how they wait, chosen at start from a short probe of what
other work is doing on the machine; recorded in environment.json and W&B.

torch's OpenMP threads (libgomp) spin at every barrier before they sleep, and a parallel region ends
only when its slowest thread has run. Where every core is ours that is the fastest way. Where other
processes hold cores, a thread preempted mid-region keeps its siblings waiting out a scheduler slice
(a 0.7 ms product took 14 ms), and an arm with more small kernels per token is slowed far more than
one with fewer: speedups come out wrong, not just slow. So:

  quiet   (others use under QUIET_CORES of the usable CPUs): torch's own thread count (one per
          physical core) and OpenMP's own waiting;
  shared  no more threads than the CPUs others leave free (at least one), and threads that sleep
          when they wait (OMP_WAIT_POLICY=PASSIVE), so a run slows in proportion to the share it gets.

Threads are never pinned to CPUs: on a shared machine a pinned thread cannot leave a CPU a neighbour
holds (benchmarks/contention.py measured binding on the quiet path too; docs/busy-machine.md).

OpenMP reads its wait policy once, when torch loads it: `prepare()` runs before that (the CLI's first
import, ablate/cli.py); the thread count is set per job (`threads_for_job`). What the user set wins:
OMP_WAIT_POLICY / GOMP_SPINCOUNT / OMP_NUM_THREADS in the environment, `threads=N` in the config, or
ABLATE_CPU_POLICY=off (no probe, torch's defaults).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import asdict, dataclass

from ablate.measure import cpu_load

PROBE_S = 0.3           # long enough for 30 jiffies per CPU; short beside a job's imports
QUIET_CORES = 0.25      # others' use of the usable CPUs (in CPUs) below which the machine is ours
USER_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@dataclass(frozen=True)
class CpuPolicy:
    max_threads: int          # at most this many intra-op threads for jobs that do not set `threads` (0: torch's)
    wait_policy: str          # "openmp default" | "passive" | what the environment set
    machine: str              # "quiet" | "shared" | "not probed"
    reason: str               # one line: why these
    usable_cpus: int
    others_cores: float       # what the probe saw others use, in CPUs (NaN: not probed)
    steal_cores: float
    load_1m: float
    probe_s: float

    def record(self) -> dict:
        return asdict(self)


_chosen: CpuPolicy | None = None


def probe(seconds: float = PROBE_S) -> tuple[float, float] | None:
    """(others' CPUs, steal CPUs) in use over `seconds` while this process sleeps; None if unreadable."""
    cpus = cpu_load.usable_cpus()
    start = cpu_load.read(cpus)
    if start is None:
        return None
    time.sleep(seconds)
    share = cpu_load.share_between(start, cpu_load.read(cpus), 1, len(cpus))
    return share.others_cores, share.steal_share * len(cpus)


def decide(num_cpus: int, others: float, steal: float) -> tuple[int, str]:
    """(at most this many threads, 0 for torch's own count; "quiet" | "shared") for `num_cpus` usable
    CPUs of which others use `others + steal`: a CPU counts as free when others leave at least half of it."""
    taken = others + steal
    if taken < QUIET_CORES:
        return 0, "quiet"
    return max(1, min(num_cpus, math.floor(num_cpus - taken + 0.5))), "shared"


def prepare() -> CpuPolicy:
    """Probe once per process, before torch loads OpenMP where possible; later calls return the same."""
    global _chosen
    if _chosen is not None:
        return _chosen
    num_cpus = len(cpu_load.usable_cpus())
    load = cpu_load.load_1m()
    user_threads = os.environ.get("OMP_NUM_THREADS", "")
    user_threads = int(user_threads) if user_threads.isdigit() and int(user_threads) > 0 else 0
    if os.environ.get("ABLATE_CPU_POLICY", "").lower() in ("0", "off", "false", "no"):
        _chosen = CpuPolicy(user_threads, _loaded_wait_policy(), "not probed",
                            "ABLATE_CPU_POLICY=off: torch's defaults", num_cpus, math.nan, math.nan, load, 0.0)
        return _chosen
    seen = probe()
    if seen is None:
        _chosen = CpuPolicy(user_threads, _loaded_wait_policy(), "not probed",
                            f"{cpu_load.available()}: torch's defaults", num_cpus, math.nan, math.nan, load, 0.0)
        return _chosen
    others, steal = seen
    threads, machine = decide(num_cpus, others, steal)
    reasons = [f"others used {others:.2f} of {num_cpus} CPUs" + (f", steal {steal:.2f}" if steal >= 0.01 else "")]
    if user_threads:
        threads = user_threads
        reasons.append(f"OMP_NUM_THREADS={user_threads} in the environment")
    wait = "openmp default"
    if any(v in os.environ for v in USER_WAIT_VARIABLES) or "torch" in sys.modules:
        wait = _loaded_wait_policy()
        reasons.append("the wait policy " + ("set in the environment" if "torch" not in sys.modules
                                             else "fixed when torch loaded, before the probe"))
    elif machine == "shared":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        wait = "passive"
    _chosen = CpuPolicy(threads, wait, machine, "; ".join(reasons), num_cpus, others, steal, load, PROBE_S)
    return _chosen


def threads_for_job(requested: int, torch_default: int) -> int:
    """`threads=N` when set, else torch's own count capped by the policy."""
    if requested > 0:
        return requested
    cap = prepare().max_threads
    return min(cap, torch_default) if cap else torch_default


def _loaded_wait_policy() -> str:
    set_by_user = [f"{v}={os.environ[v]}" for v in USER_WAIT_VARIABLES if v in os.environ]
    return ", ".join(set_by_user) or "openmp default"
