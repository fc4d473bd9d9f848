"""`book:` options of `python -m ablate book` (experiment.kind=book)."""
from __future__ import annotations

from dataclasses import dataclass

from ablate.book.sections import SECTIONS

ALL = "all"


@dataclass
class BookConfig:
    section: str = ALL      # a section of the chapter ("7.3"), or all
    measure: bool = True    # quick measurements on this machine (peaks, verify cost, on-chip bandwidth)
    runs_dir: str = ""      # where the chapter experiments' finished runs are read; "" -> results_dir

    def __post_init__(self) -> None:
        self.section = str(self.section)
        if self.section != ALL and self.section not in SECTIONS:
            raise ValueError(f"book.section={self.section!r}: the chapter's sections are "
                             f"{', '.join(SECTIONS)}, or {ALL}")

    @property
    def sections(self) -> list[str]:
        return list(SECTIONS) if self.section == ALL else [self.section]
