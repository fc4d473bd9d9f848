"""A workload too large to be meant, or too long for the engine's sequences, is refused before
anything is built.

`workload.num_requests=10000000` would spend minutes making ten million requests (their prompts alone
~40 bytes a token in Python lists: gigabytes) and hours serving them, printing nothing until its first
round. The bound is on the tokens one arm's run serves, num_requests x (prompt_len + output_len) at
the grid's largest values: MAX_RUN_TOKENS (5e7) is ~40 minutes an arm at a GPU's 20k tokens/s and
~2 GB of prompts, past any benchmark's need for a stable figure; a run that truly needs more sets
ABLATE_MAX_RUN_TOKENS. A trace replays its own file and is not bounded here.
"""
from __future__ import annotations

import os
from typing import Any

MAX_RUN_TOKENS = 50_000_000
LIMIT_ENV = "ABLATE_MAX_RUN_TOKENS"


def max_run_tokens() -> int:
    raw = os.environ.get(LIMIT_ENV, "")
    try:
        return int(float(raw)) if raw else MAX_RUN_TOKENS
    except ValueError:
        raise ValueError(f"{LIMIT_ENV}={raw!r} must be a whole number of tokens (default {MAX_RUN_TOKENS})") from None


def check_run_size(workload: Any, grid: dict[str, list]) -> None:
    """A ValueError naming workload.num_requests and the limit when one arm's run serves more tokens
    than max_run_tokens()."""
    if workload.arrival == "trace":
        return
    num_requests, prompt_len, output_len = (_largest(workload, grid, k) for k in ("num_requests", "prompt_len",
                                                                                  "output_len"))
    tokens = num_requests * (prompt_len + output_len)
    limit = max_run_tokens()
    if tokens > limit:
        raise ValueError(f"workload.num_requests={num_requests:,} x (prompt_len {prompt_len:,} + output_len "
                         f"{output_len:,}) = {tokens:,} tokens per arm's run, above the limit of {limit:,} "
                         f"(hours of serving, gigabytes of prompts): lower workload.num_requests, or set "
                         f"{LIMIT_ENV} to a larger bound if this is meant")


def check_prompt_fits(workload: Any, grid: dict[str, list], max_seq_len: int) -> None:
    """A ValueError naming engine.max_seq_len when it cannot hold the longest prompt and one generated
    token (otherwise every arm fails in its scheduler, and the message names neither option)."""
    if not max_seq_len or workload.arrival == "trace":     # 0: sized from the workload itself
        return
    longest = _largest(workload, grid, "prompt_len") + (workload.prompt_spread if workload.prompt_dist == "uniform" else 0)
    if max_seq_len < longest + 1:
        raise ValueError(f"engine.max_seq_len={max_seq_len} cannot hold the longest prompt ({longest} tokens, "
                         f"workload.prompt_len) and a generated token: set engine.max_seq_len >= {longest + 1}, "
                         "or 0 to size it from the workload")


def _largest(workload: Any, grid: dict[str, list], key: str) -> int:
    """A workload field's largest value over the grid's points."""
    values = [v for v in grid.get(key, []) if isinstance(v, (int, float))] + [getattr(workload, key)]
    return int(max(values))
