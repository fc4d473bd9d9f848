"""A claim of the chapter, the project's figure for it, and the verdict that compares them.

Verdicts:
    exact       the project's figure, rounded to the digits the book writes (trailing zeros count: 140
                has three), is the book's
    rounded     within 10% of the book's figure (the book rounded more coarsely than its digits say)
    differs     further than that, or the statement does not hold as written; the reason says why
    measured    a figure or behaviour measured on this machine (the book's figure is for other
                hardware, or a behaviour): `holds` says whether it held here
    not run     measured by a chapter experiment that has no finished run to read yet: the command
                column runs it

Unit readings: where the chapter writes MB or GB of bytes, its arithmetic sometimes uses 2^20 and
2^30 and sometimes 10^6 and 10^9. Such a claim is judged in both readings, shows both, and takes the
better verdict, naming the reading in the reason.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

EXACT, ROUNDED, DIFFERS, MEASURED, NOT_RUN = "exact", "rounded", "differs", "measured", "not run"
VERDICTS = (EXACT, ROUNDED, DIFFERS, MEASURED, NOT_RUN)
ROUNDED_WITHIN = 0.10

# the book's unit -> (power of 2, power of 10, binary name)
UNITS = {"KB": (10, 3, "KiB"), "MB": (20, 6, "MiB"), "GB": (30, 9, "GiB"), "TB": (40, 12, "TiB")}


@dataclass(frozen=True)
class Claim:
    section: str        # "7.3"
    key: str            # short, stable id: "kv-per-token-70b"
    claim: str          # the statement, in the project's words
    book: str           # the book's figure with its unit, as the book gives it
    project: str        # the project's figure (both unit readings where they differ)
    verdict: str        # one of VERDICTS
    reason: str         # one line: why the verdict, what the figure is
    command: str        # what reproduces the project's figure
    holds: str = ""     # measured claims: "yes" / "no" on this machine; "" otherwise

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"claim {self.key}: verdict {self.verdict!r} is not one of {VERDICTS}")


def significant(x: float, digits: int) -> float:
    """x rounded to `digits` significant digits."""
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def judge(book: float, ours: float, digits: int) -> str:
    """exact / rounded / differs for a number the book gives to `digits` significant digits."""
    if significant(ours, digits) == significant(book, digits):
        return EXACT
    return ROUNDED if abs(ours - book) <= ROUNDED_WITHIN * abs(book) else DIFFERS


def number(x: float, digits: int = 3) -> str:
    """A readable figure: thousands separated, `digits` significant digits for fractions."""
    x = significant(x, digits) if abs(x) < 10 ** digits else round(x)
    return f"{int(x):,}" if x == int(x) else f"{x:,}"


def both_readings(num_bytes: float, unit: str, digits: int = 3) -> str:
    """'2.5 MiB = 2.62 MB': bytes in the book's unit read both ways (MiB = 2^20 bytes, MB = 10^6)."""
    two, ten, name = UNITS[unit]
    return f"{number(num_bytes / 2 ** two, digits)} {name} = {number(num_bytes / 10 ** ten, digits)} {unit}"


def computed(section: str, key: str, claim: str, book: float, book_text: str, ours: float, ours_text: str,
             digits: int, command: str, note: str = "") -> Claim:
    """A claim the project computes: judged against the book's figure at the book's precision."""
    verdict = judge(book, ours, digits)
    reason = {EXACT: "the same figure", ROUNDED: f"the book rounds {number(ours)} to {number(book)}",
              DIFFERS: f"{number(ours)} against the book's {number(book)}"}[verdict]
    return Claim(section, key, claim, book_text, ours_text, verdict, _join(reason, note), command)


def in_bytes(section: str, key: str, claim: str, book: float, unit: str, num_bytes: float, digits: int,
             command: str, note: str = "", book_text: str = "") -> Claim:
    """A claim of bytes in an ambiguous unit (MB, GB, ...): judged in both readings, the better kept."""
    two, ten, name = UNITS[unit]
    binary, decimal = num_bytes / 2 ** two, num_bytes / 10 ** ten
    order = {EXACT: 0, ROUNDED: 1, DIFFERS: 2}
    readings = [(order[judge(book, value, digits)], abs(value - book), label)
                for value, label in ((binary, f"{name} (2^{two} bytes)"), (decimal, f"10^{ten} bytes"))]
    rank, _, reading = min(readings)        # the better verdict; of equal ones, the closer figure
    verdict = (EXACT, ROUNDED, DIFFERS)[rank]
    reason = {EXACT: f"exact when {unit} is read as {reading}",
              ROUNDED: f"rounded, read as {reading}",
              DIFFERS: f"neither reading gives {number(book)}"}[verdict]
    return Claim(section, key, claim, book_text or f"{number(book)} {unit}", both_readings(num_bytes, unit, digits),
                 verdict, _join(reason, note), command)


def checked(section: str, key: str, claim: str, book_text: str, ours_text: str, holds: bool, note: str,
            command: str) -> Claim:
    """A statement the project's computed figures bear out (exact) or contradict (differs)."""
    reason = "the computed figures bear it out" if holds else "the computed figures contradict it"
    return Claim(section, key, claim, book_text, ours_text, EXACT if holds else DIFFERS, _join(reason, note), command)


def measured(section: str, key: str, claim: str, book_text: str, ours_text: str, holds: bool, reason: str,
             command: str) -> Claim:
    return Claim(section, key, claim, book_text, ours_text, MEASURED, reason, command, "yes" if holds else "no")


def not_run(section: str, key: str, claim: str, book_text: str, command: str, what: str) -> Claim:
    """A claim a chapter experiment measures, with no finished run of it to read."""
    return Claim(section, key, claim, book_text, "-", NOT_RUN,
                 f"no finished run to read: the command measures {what}", command)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def claims_frame(claims: list[Claim]) -> pd.DataFrame:
    return pd.DataFrame([asdict(c) for c in claims], columns=[f for f in Claim.__dataclass_fields__])


def verdict_counts(frame: pd.DataFrame) -> dict[str, int]:
    """Claims per verdict, every verdict named (0 where none)."""
    counts = frame["verdict"].value_counts()
    return {v: int(counts.get(v, 0)) for v in VERDICTS}
