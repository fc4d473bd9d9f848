"""ablate's native kernels as they were at a git revision, built beside today's so that both run in the same
rounds of one benchmark (paged_decode_kernel.py, matvec_kernel.py: --against REV)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

from ablate.model.native import build


def library_at(revision: str, source: str, workdir: Path) -> ctypes.CDLL:
    """`source` (a file of ablate/model/native/, e.g. "steps.c") and the vectors.h it includes, as they were
    at `revision`, compiled into a library of its own with today's flags (build.FLAGS). Stops the benchmark
    with one line naming the revision and file when git cannot show them."""
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                               check=True).stdout.strip())
    for name in (source, "vectors.h"):
        path = (build.HERE / name).relative_to(root)
        text = subprocess.run(["git", "show", f"{revision}:{path}"], capture_output=True, text=True, cwd=root)
        if text.returncode != 0:
            raise SystemExit(f"--against {revision}: git cannot show {path} there: {text.stderr.strip()}")
        (workdir / name).write_text(text.stdout)
    library = workdir / f"{Path(source).stem}_at_{revision.replace('/', '_')}.so"
    compiled = subprocess.run([os.environ.get("CC", "cc"), *build.FLAGS, str(workdir / source), "-o", str(library),
                               "-lm"], capture_output=True, text=True)
    if compiled.returncode != 0:
        raise SystemExit(f"--against {revision}: {source} there does not compile: {compiled.stderr.strip()}")
    return ctypes.CDLL(str(library))


def function_at(revision: str, source: str, name: str):
    """The C function `name` of `source` at `revision`, with today's argument types (build.SIGNATURES):
    a benchmark calls it as the library's own. (Built in a folder removed once the library is loaded.)"""
    with tempfile.TemporaryDirectory() as workdir:
        function = getattr(library_at(revision, source, Path(workdir)), name)
    function.argtypes, function.restype = build.SIGNATURES[name]
    return function
