"""Result files are readable by others: written atomically, yet with an ordinary file's mode."""
from __future__ import annotations

import os
import stat

import pytest

from ablate.results import write_atomic


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_write_atomic_gives_0666_less_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "sub" / "summary.csv", "a,b\n1,2\n")
    finally:
        os.umask(old)
    path = tmp_path / "sub" / "summary.csv"
    assert path.read_text() == "a,b\n1,2\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask
    assert os.umask(old) == old            # the umask is left as it was
    assert [p.name for p in path.parent.iterdir()] == ["summary.csv"]    # no temporary file left


def test_write_atomic_replaces_and_leaves_no_temporary_file_on_failure(tmp_path):
    path = tmp_path / "report.md"
    write_atomic(path, "old\n")
    with pytest.raises(TypeError):
        write_atomic(path, None)     # type: ignore[arg-type]
    assert path.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["report.md"]
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n"
