"""How a child process ended, in words: the signal that killed it, named, with its likely cause.

A process the kernel's out-of-memory killer ends gets SIGKILL and leaves no message of its own; a
crash in native code (a C extension, an outside engine's library) ends in SIGSEGV, SIGBUS or SIGABRT.
The parent sees only the exit code, negative for a signal (multiprocessing's convention). Both kinds
of child ablate starts say it with this: an outside engine's worker (ablate.outside.worker) and a
sweep's job process (ablate.experiment.job_process)."""
from __future__ import annotations

import signal

LIKELY_CAUSE = {
    signal.SIGKILL: "out of memory?",
    signal.SIGSEGV: "a crash in native code",
    signal.SIGBUS: "a crash in native code: a mapped file truncated, or memory gone",
    signal.SIGABRT: "native code aborted",
    signal.SIGILL: "native code built for another CPU?",
    signal.SIGFPE: "a native arithmetic fault",
}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def describe_exit(exitcode: int) -> str:
    """`killed by SIGKILL (out of memory?)` for exit code -9; `exited with status 3` for 3."""
    if exitcode < 0:
        cause = LIKELY_CAUSE.get(-exitcode)
        return f"killed by {signal_name(-exitcode)}" + (f" ({cause})" if cause else "")
    return f"exited with status {exitcode}"
