"""Command-line overrides that Hydra would refuse with a raw message, said in one line before it runs.

Hydra's argparse takes `-m` only before the overrides (after them: a usage error), its grammar takes
non-ASCII characters only in quotes (unquoted: a lexer error naming no option), a comma outside
brackets is a sweep that needs -m (without: its "ambiguous value" block, exit 1), and `${...}`
naming no option fails while the job's config resolves (OmegaConf's traceback). Nothing here
imports Hydra: these are checks on the strings, and a message from OmegaConf's exception.
"""
from __future__ import annotations

MULTIRUN = ("-m", "--multirun")
OPENING, CLOSING = "[{(", "]})"


def multirun_first(argv: list[str]) -> list[str]:
    """`model=tiny -m kv_cache=a,b` -> `-m model=tiny kv_cache=a,b`: -m is accepted anywhere."""
    flags = [a for a in argv if a in MULTIRUN]
    return flags[:1] + [a for a in argv if a not in MULTIRUN] if flags else argv


def override_problem(argv: list[str]) -> str | None:
    """The first override Hydra would misread, as one line saying how to write it; None if none."""
    sweeping = any(a in MULTIRUN for a in argv)
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        unquoted = _outside_quotes(value)
        if any(ord(c) > 127 for c in unquoted):
            return (f"{arg}: non-ASCII characters must be quoted on Hydra's command line: write "
                    f"{key}='{value}' (in a shell: \"{key}='{value}'\")")
        if not sweeping and "," in _outside_brackets(unquoted) and not key.startswith("hydra"):
            return (f"{arg}: a comma outside brackets sweeps over values, which needs -m (python -m ablate -m "
                    f"{arg}); for a list write {key}=[{value}], for text with a comma quote it: {key}='{value}'")
    return None


def _outside_quotes(value: str) -> str:
    """The characters of `value` outside '...' and "..." quotes."""
    kept, quote = [], None
    for c in value:
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        else:
            kept.append(c)
    return "".join(kept)


def _outside_brackets(value: str) -> str:
    """The characters of `value` at bracket depth 0 ([...], {...}, choice(...) left out)."""
    kept, depth = [], 0
    for c in value:
        depth += (c in OPENING) - (c in CLOSING)
        if depth == 0 and c not in CLOSING:
            kept.append(c)
    return "".join(kept)


def interpolation_error(err: Exception) -> str:
    """OmegaConf's error resolving `${...}` as one line naming the option."""
    key = getattr(err, "full_key", None) or "the config"
    message = str(getattr(err, "msg", None) or err).strip().splitlines()[0]
    return (f"{key}: {message}: ${{...}} must name another option of the config (e.g. ${{model.name}}); "
            "a literal ${ is written \\${")
