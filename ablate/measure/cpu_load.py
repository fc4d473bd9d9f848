"""What the CPU was doing while a run was measured: how much of it others took.

Read from Linux's /proc: each thread's scheduler statistics (/proc/<pid>/task/<tid>/schedstat: the
nanoseconds it was ready to run but waited for a CPU), per-CPU jiffies of the CPUs this process may
run on (/proc/stat), and the process tree's CPU time (psutil: this process and its live workers, e.g.
an outside engine's). Over an interval of `wall` seconds, with T threads of ours on N usable CPUs:

    cpu_time_share = our CPU seconds / (wall x T)            what our threads ran (spinning counts)
    others_cores   = (busy CPU seconds of the N CPUs - our CPU seconds) / wall
    steal_share    = steal seconds of the N CPUs / (wall x N)    a hypervisor's other guests
    cpu_wait_share = min(seconds our threads waited for a CPU, others_cores x wall + 2 N tick) / (wall x T)
    cpu_left_share = max(0, 1 - cpu_wait_share - steal_share)    the share of our CPU time left to us

The waiting others caused cannot exceed the CPU time they used (read in jiffies: to a tick on each
CPU at either end of the interval): the rest is our threads waiting for
each other (an outside engine whose server and workers outnumber the cores: vLLM's API server and
engine core beside its OpenMP threads on 2 cores), which is how that arm runs, not time taken from it.

Where schedstat is missing, what others took of our cores stands in for the waiting, in jiffies:
cpu_wait_share = max(0, others_cores - (N - T)) / T. A run is *contended* when cpu_left_share <
min_left_share() (0.9). `cpu_time_share` is recorded, not the rule: a run that waits for arrivals or a
server uses little CPU on a quiet machine, and spinning OpenMP threads use all of theirs on a busy one.
Waiting for a CPU is neither: it is the time others took from us.

The threshold, from benchmarks/contention.py's rounds on a 2-core VM (results/reference/contention):
quiet, the share left read 0.93-1.00 (waiting under 0.6%, the rest the hypervisor's steal); one busy
neighbour beside a 1-thread run 0.98-1.00 (it used the CPU the run left free); two 0.58-0.67, two
torch processes 0.65-0.67, four 0.37-0.41. 0.9 lies between the quiet rounds and the slowed ones.

Where /proc cannot be read (not Linux) nothing is claimed: the figures are absent, no run is called
contended, and `available()` says why.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

PROC_STAT = Path("/proc/stat")


def min_left_share() -> float:
    """Below this share of its CPU a run is contended (module docstring: how 0.9 was chosen), or
    ABLATE_MIN_CPU_SHARE (0: no run is ever called contended; the test suite's setting, whose
    figures are checked for correctness, not speed, while other work may share the machine)."""
    text = os.environ.get("ABLATE_MIN_CPU_SHARE", "0.9")
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise ValueError(f"ABLATE_MIN_CPU_SHARE={text!r}: give the share of its CPU a run must keep to count as "
                         "uncontended, between 0 and 1 (default 0.9; 0 never marks a run contended)")
    return value



MIN_TAKEN_JIFFIES_S = 0.03    # without schedstat: CPU seconds others must take to count at all (3 jiffies)
TICK_S = 1 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity; all of them where that cannot be asked)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class CpuReading:
    """One reading of the usable CPUs and of the process tree, at `at` (time.perf_counter())."""

    at: float
    busy_s: float             # non-idle, non-steal seconds of the usable CPUs since boot
    steal_s: float
    own_cpu_s: float          # this process and its live descendants: user + system seconds
    involuntary_switches: int
    waited_s: float | None    # seconds the process tree's threads were ready but waited for a CPU (schedstat)


def _cpu_lines(cpus: list[int]) -> tuple[float, float]:
    """(busy, steal) seconds since boot over `cpus`, from /proc/stat's `cpuN` lines."""
    wanted = {f"cpu{c}" for c in cpus}
    busy = steal = 0
    for line in PROC_STAT.read_text().splitlines():
        name, *fields = line.split()
        if name not in wanted:
            continue
        # user nice system idle iowait irq softirq steal [guest guest_nice: already in user, nice]
        values = [int(f) for f in fields[:8]] + [0] * (8 - len(fields[:8]))
        user, nice, system, _idle, _iowait, irq, softirq, stolen = values
        busy += user + nice + system + irq + softirq
        steal += stolen
    return busy * TICK_S, steal * TICK_S


def _waited_seconds(pids: list[int]) -> float | None:
    """Run-queue delay of every thread of `pids` (the second field of schedstat, in ns); None without
    schedstat. A thread that ended between readings takes its delay with it: the process tree's
    threads here live for the whole run (torch's pool, an engine worker's)."""
    total = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                if pid == os.getpid() and tid == str(pid):
                    return None          # not even our own main thread: no schedstat on this kernel
    return total / 1e9


def own_cpu_seconds(process: psutil.Process, children: list[psutil.Process]) -> float:
    """User + system seconds of this process, its reaped children and its live descendants."""
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in children:
        try:
            child_times = child.cpu_times()
            total += child_times.user + child_times.system
        except psutil.Error:        # it ended between the listing and the reading
            pass
    return total


def available() -> str | None:
    """None where the CPU's load can be read, else why not."""
    try:
        PROC_STAT.read_text()
    except OSError as err:
        return f"{PROC_STAT} cannot be read ({err.strerror or err}): the CPU's load is not recorded"
    return None


def read(cpus: list[int]) -> CpuReading | None:
    if available() is not None:
        return None
    busy, steal = _cpu_lines(cpus)
    process = psutil.Process()
    children = process.children(recursive=True)
    return CpuReading(time.perf_counter(), busy, steal, own_cpu_seconds(process, children),
                      process.num_ctx_switches().involuntary, _waited_seconds([process.pid, *(c.pid for c in children)]))


@dataclass(frozen=True)
class CpuShare:
    """What others took of the CPU over one interval (module docstring for the formulas)."""

    wall_s: float
    threads: int
    num_cpus: int
    cpu_time_share: float
    others_cores: float
    steal_share: float
    cpu_wait_share: float
    cpu_left_share: float
    involuntary_switches: int
    load_1m: float
    from_schedstat: bool      # the waiting read per thread (else estimated from /proc/stat's jiffies)

    @property
    def contended(self) -> bool:
        taken_s = (1 - self.cpu_left_share) * self.threads * self.wall_s
        return self.cpu_left_share < min_left_share() and (self.from_schedstat or taken_s >= MIN_TAKEN_JIFFIES_S)

    def row(self) -> dict[str, float | int | bool]:
        """The columns a measured run records (runs.csv, W&B)."""
        return {"cpu_time_share": self.cpu_time_share, "cpu_others_cores": self.others_cores,
                "cpu_steal_share": self.steal_share, "cpu_wait_share": self.cpu_wait_share,
                "cpu_left_share": self.cpu_left_share, "involuntary_switches": self.involuntary_switches,
                "load_1m": self.load_1m, "contended": self.contended}


def share_between(start: CpuReading, end: CpuReading, threads: int, num_cpus: int) -> CpuShare:
    wall = max(end.at - start.at, 1e-9)
    own = max(end.own_cpu_s - start.own_cpu_s, 0.0)
    others = max(end.busy_s - start.busy_s - own, 0.0) / wall
    steal = max(end.steal_s - start.steal_s, 0.0) / (wall * num_cpus)
    from_schedstat = start.waited_s is not None and end.waited_s is not None
    if from_schedstat:     # at most what others ran (to a tick on each CPU at either end): the rest, our
        # own threads waited for each other
        ran_by_others = others * wall + 2 * num_cpus * TICK_S
        waited = min(max(end.waited_s - start.waited_s, 0.0), ran_by_others) / (wall * threads)
    else:
        waited = max(0.0, others - (num_cpus - threads)) / threads
    return CpuShare(wall, threads, num_cpus, own / (wall * threads), others, steal, waited,
                    max(0.0, 1 - waited - steal), end.involuntary_switches - start.involuntary_switches,
                    load_1m(), from_schedstat)


def load_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


class CpuShareMeter:
    """`with CpuShareMeter(threads) as meter: ...` then `meter.share` (None where nothing can be read)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(int(threads), 1)
        self.cpus = usable_cpus()
        self.share: CpuShare | None = None
        self._start: CpuReading | None = None

    def __enter__(self) -> CpuShareMeter:
        self._start = read(self.cpus)
        return self

    def __exit__(self, *exc) -> None:
        end = read(self.cpus)
        if self._start is not None and end is not None:
            self.share = share_between(self._start, end, self.threads, len(self.cpus))

    def row(self) -> dict[str, float | int | bool]:
        return self.share.row() if self.share is not None else {}
