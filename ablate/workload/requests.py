"""Workloads: which requests arrive when, with how long a prompt and how many tokens to generate."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ablate.api.sequence import Request, SamplingParams

if TYPE_CHECKING:
    from ablate.checkpoints.tokenizer import Tokenizer

LENGTH_DISTS = ("fixed", "uniform", "exponential", "lognormal")
ARRIVALS = ("burst", "poisson", "gamma", "trace", "textbook", "closed")
# arrival=textbook: three requests with this many tokens still to generate, and a fourth that arrives
# while they run. Static batching finishes them 3rd, 2nd, 1st, then the 4th; continuous batching lets
# the 4th take the slot the 100-token request frees, so it finishes long before the 450- and 500-token ones.
# workload.textbook_scale multiplies the three (rounded, at least 1 token): with output_len (the 4th's) and
# textbook_arrival_s scaled alike, the same case in proportionally fewer steps, with the same finish orders.
TEXTBOOK_OUTPUT_LENS = (500, 450, 100)
PROMPT_SOURCES = ("random", "text", "dataset")
TOKENIZED_SOURCES = ("text", "dataset")     # sources whose prompts are text, encoded by the model's tokenizer
PROMPT_KINDS = ("open", "quote")
MAX_SEED = 2**32 - 1
# int fields -> their minimum
INT_MINIMUMS = {"num_requests": 1, "prompt_len": 1, "prompt_spread": 0, "output_len": 1, "output_spread": 0,
                "output_len_max": 0, "seed": 0, "concurrency": 1}
# float fields -> (lowest, highest, lowest allowed?, what the number means)
FLOAT_RANGES = {
    "output_sigma": (0.0, None, True, "sigma of log(output length)"),
    "rate": (0.0, None, False, "requests per second"),
    "burstiness": (0.0, None, False, "1: Poisson, > 1 burstier"),
    "temperature": (0.0, None, True, "0: greedy"),
    "top_p": (0.0, 1.0, False, "nucleus mass, 1: off"),
    "textbook_arrival_s": (0.0, None, True, "seconds after the start"),
    "textbook_scale": (0.0, None, False, "x the textbook's 500, 450 and 100 tokens"),
    "think_time_s": (0.0, None, True, "seconds a closed-loop user waits between a reply and its next request"),
}


def whole_number(where: str, value: object, low: int) -> None:
    """A ValueError naming `where` unless value is an int >= low (bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{where} must be a whole number >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{where} must be >= {low}, got {value}")


def finite_number(where: str, value: object, low: float, high: float | None = None, *, inclusive: bool = True,
                  unit: str = "") -> None:
    """A ValueError naming `where` unless value is a finite number in [low, high] ((low, high] when
    not inclusive): `workload.rate must be a finite number > 0 (requests per second), got nan`."""
    wanted = f"{'>=' if inclusive else '>'} {low:g}" + (f" and <= {high:g}" if high is not None else "")
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
          and (value >= low if inclusive else value > low) and (high is None or value <= high))
    if not ok:
        raise ValueError(f"{where} must be a finite number {wanted}" + (f" ({unit})" if unit else "")
                         + f", got {value!r}")


@dataclass
class WorkloadConfig:
    num_requests: int = 8
    prompt_len: int = 32           # mean prompt tokens
    prompt_dist: str = "fixed"     # fixed | uniform (prompt_len +- prompt_spread)
    prompt_spread: int = 0
    output_len: int = 32           # mean output tokens
    output_dist: str = "fixed"     # fixed | uniform | exponential | lognormal
    output_spread: int = 0         # uniform: output_len +- output_spread
    output_sigma: float = 1.0      # lognormal: sigma of log(length)
    output_len_max: int = 0        # cap on sampled output lengths; 0: 4 x output_len
    arrival: str = "burst"         # burst (all at t=0) | poisson (rate/s) | gamma (rate/s, burstiness) |
                                   # trace (replay trace_path) | textbook (TEXTBOOK_OUTPUT_LENS + a late 4th) |
                                   # closed (concurrency users, each sending its next request when its last finishes)
    rate: float = 1.0              # requests per second for poisson and gamma
    burstiness: float = 1.0        # gamma shape = 1/burstiness: >1 burstier than Poisson
    temperature: float = 0.0       # 0: greedy
    top_p: float = 1.0
    seed: int = 0                  # seeds lengths, arrivals, prompt tokens and sampling
    trace_path: str = ""           # arrival=trace: JSONL, one request a line (ablate/workload/trace.py); its arrival
                                   # times and lengths replace num_requests and the distributions above
    textbook_arrival_s: float = 0.01   # arrival=textbook: when the 4th request (output_len tokens) arrives, s
    textbook_scale: float = 1.0    # arrival=textbook: the three first requests generate 500, 450, 100 x this
    concurrency: int = 1           # arrival=closed: users; request i is user (i % concurrency)'s
    think_time_s: float = 0.0      # arrival=closed: a user's pause between a reply and its next request, s
    source: str = "random"         # random: random token ids | text: real text (ablate.workload.text), tokenized |
                                   # dataset: the user's prompts and reply lengths (ablate/workload/dataset.py)
    dataset_path: str = ""         # source=dataset: ShareGPT JSON / JSONL, or JSONL of {"prompt", "output_len"}
    count_tokenizer: str = ""      # source=dataset: a tokenizer.json that counts the reference replies' tokens;
                                   # "": the model's tokenizer
    prompt_kind: str = "open"      # text prompts: open (a passage to continue) | quote (asks to repeat a passage)

    def __post_init__(self) -> None:
        for name, low in INT_MINIMUMS.items():
            whole_number(f"workload.{name}", getattr(self, name), low)
        if self.seed > MAX_SEED:
            raise ValueError(f"workload.seed must be <= {MAX_SEED}, got {self.seed}")
        for name, (low, high, inclusive, unit) in FLOAT_RANGES.items():
            finite_number(f"workload.{name}", getattr(self, name), low, high, inclusive=inclusive, unit=unit)
        if self.prompt_dist not in ("fixed", "uniform"):
            raise ValueError(f"workload.prompt_dist must be fixed or uniform, got {self.prompt_dist!r}")
        if self.output_dist not in LENGTH_DISTS:
            raise ValueError(f"workload.output_dist must be one of {LENGTH_DISTS}, got {self.output_dist!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.arrival == "trace" and not self.trace_path:
            raise ValueError("workload.arrival=trace needs workload.trace_path (a JSONL file)")
        if self.trace_path and self.arrival != "trace":
            raise ValueError(f"workload.trace_path is only read with workload.arrival=trace, not {self.arrival!r}")
        if self.prompt_spread >= self.prompt_len and self.prompt_dist == "uniform":
            raise ValueError("workload.prompt_spread must be smaller than workload.prompt_len")
        if self.output_spread >= self.output_len and self.output_dist == "uniform":
            raise ValueError("workload.output_spread must be smaller than workload.output_len")
        if self.source not in PROMPT_SOURCES:
            raise ValueError(f"workload.source must be one of {PROMPT_SOURCES}, got {self.source!r}")
        if self.source == "dataset" and not self.dataset_path:
            raise ValueError("workload.source=dataset needs workload.dataset_path (a ShareGPT JSON/JSONL file or a "
                             "JSONL file of prompts)")
        for name in ("dataset_path", "count_tokenizer"):
            if getattr(self, name) and self.source != "dataset":
                raise ValueError(f"workload.{name} is only read with workload.source=dataset, not {self.source!r}")
        if self.arrival != "closed" and (self.concurrency != 1 or self.think_time_s != 0):
            raise ValueError(f"workload.concurrency and workload.think_time_s are only read with "
                             f"workload.arrival=closed, not {self.arrival!r}")
        if self.prompt_kind not in PROMPT_KINDS:
            raise ValueError(f"workload.prompt_kind must be one of {PROMPT_KINDS}, got {self.prompt_kind!r}")

    @property
    def needs_tokenizer(self) -> bool:
        """Its prompts are text that the model's tokenizer encodes (source=text or dataset)."""
        return self.source in TOKENIZED_SOURCES

    @property
    def max_output_len(self) -> int:
        if self.output_dist == "fixed":
            return self.output_len
        if self.output_dist == "uniform":
            return self.output_len + self.output_spread
        return self.output_len_max or 4 * self.output_len

    @property
    def max_prompt_len(self) -> int:
        return self.prompt_len + (self.prompt_spread if self.prompt_dist == "uniform" else 0)


def _output_lengths(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    n, mean = cfg.num_requests, cfg.output_len
    if cfg.output_dist == "fixed":
        lengths = np.full(n, mean)
    elif cfg.output_dist == "uniform":
        lengths = rng.integers(mean - cfg.output_spread, mean + cfg.output_spread + 1, n)
    elif cfg.output_dist == "exponential":
        lengths = np.ceil(rng.exponential(mean, n))
    else:   # lognormal with the requested mean: mu = log(mean) - sigma^2 / 2
        lengths = np.ceil(rng.lognormal(np.log(mean) - cfg.output_sigma**2 / 2, cfg.output_sigma, n))
    return np.clip(lengths, 1, cfg.max_output_len).astype(int)


def _arrival_times(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Seconds after the start; arrival=closed: a user's first request at 0, and for each later one
    the think time after its previous request finishes (Request.follows)."""
    n = cfg.num_requests
    if cfg.arrival == "burst":
        return np.zeros(n)
    if cfg.arrival == "closed":
        return np.where(np.arange(n) < cfg.concurrency, 0.0, cfg.think_time_s)
    if cfg.arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.rate, n)
    else:   # gamma gaps with mean 1/rate and coefficient of variation sqrt(burstiness)
        shape = 1.0 / cfg.burstiness
        gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def _follows(cfg: WorkloadConfig, i: int) -> int | None:
    """arrival=closed: users take requests round-robin, so request i waits for i - concurrency (its
    user's previous request) to finish; None for timed arrivals."""
    return i - cfg.concurrency if cfg.arrival == "closed" and i >= cfg.concurrency else None


def make_requests(cfg: WorkloadConfig, vocab_size: int, tokenizer: Tokenizer | None = None,
                  max_seq_len: int | None = None) -> list[Request]:
    """Seeded requests: lengths and arrivals from the config; random prompt tokens, or with
    source=text prompts cut from real text by `tokenizer` (about prompt_len tokens each).
    arrival=trace replays a trace file (text prompts in it are encoded by `tokenizer`);
    arrival=textbook gives the textbook's four requests; source=dataset takes prompts and output
    lengths from workload.dataset_path (ablate.workload.dataset). A request longer than `max_seq_len`
    (the model's context) is refused before its tokens are drawn, naming the option or the trace
    line (a dataset's records that do not fit are skipped instead, as vLLM's ShareGPT sampler does)."""
    if cfg.arrival in ("trace", "textbook"):
        if cfg.source != "random":
            raise ValueError(f"workload.source={cfg.source} draws prompts for synthetic arrivals; with "
                             f"arrival={cfg.arrival} prompts are random tokens (or a trace's prompt text)")
        if cfg.arrival == "trace":
            return trace_requests(cfg, vocab_size, tokenizer, max_seq_len)
        return textbook_requests(cfg, vocab_size)
    if cfg.source == "dataset":
        from ablate.workload.dataset import dataset_prompts

        prompts = dataset_prompts(cfg, tokenizer, vocab_size, max_seq_len).requests
        arrivals = _arrival_times(cfg, np.random.default_rng(cfg.seed))
        return [_request(cfg, i, prompt, n, float(arrivals[i])) for i, (prompt, n) in enumerate(prompts)]
    rng = np.random.default_rng(cfg.seed)
    if cfg.prompt_dist == "fixed":
        prompt_lens = np.full(cfg.num_requests, cfg.prompt_len)
    else:
        prompt_lens = rng.integers(cfg.prompt_len - cfg.prompt_spread, cfg.prompt_len + cfg.prompt_spread + 1,
                                   cfg.num_requests)
    output_lens = _output_lengths(cfg, rng)
    if max_seq_len and int(prompt_lens.max() + output_lens.max()) > max_seq_len:
        raise ValueError(f"workload.prompt_len and workload.output_len ask for up to "
                         f"{int(prompt_lens.max() + output_lens.max())} tokens per sequence but model.max_seq_len is "
                         f"{max_seq_len}: shorten the workload or raise model.max_seq_len")
    arrivals = _arrival_times(cfg, rng)
    text_prompts = _text_prompts(cfg, prompt_lens, tokenizer) if cfg.source == "text" else None
    requests = []
    for i in range(cfg.num_requests):
        if text_prompts is not None:
            prompt = tuple(text_prompts[i])
        else:
            prompt = tuple(int(t) for t in rng.integers(0, vocab_size, int(prompt_lens[i])))
        requests.append(_request(cfg, i, prompt, int(output_lens[i]), float(arrivals[i])))
    return requests


def _text_prompts(cfg: WorkloadConfig, prompt_lens: np.ndarray, tokenizer: Tokenizer | None) -> list[list[int]]:
    """One text prompt of each sampled length (ablate.workload.text), seeded by the workload's seed."""
    if tokenizer is None:
        raise ValueError("workload.source=text needs the model's tokenizer (a model with a checkpoint, "
                         "model.path or model.package)")
    from ablate.workload.text import text_prompts

    return [text_prompts(tokenizer, 1, int(n), seed=cfg.seed * 100_003 + i, kind=cfg.prompt_kind)[0]
            for i, n in enumerate(prompt_lens)]


def _request(cfg: WorkloadConfig, i: int, prompt: tuple[int, ...], output_len: int, arrival: float) -> Request:
    sampling = SamplingParams(cfg.temperature, cfg.top_p, seed=cfg.seed * 100_003 + i)
    return Request(i, prompt, output_len, sampling, arrival_time=arrival, follows=_follows(cfg, i))


def trace_requests(cfg: WorkloadConfig, vocab_size: int, tokenizer: Tokenizer | None = None,
                   max_seq_len: int | None = None) -> list[Request]:
    """Replay cfg.trace_path: its arrivals and lengths; seeded random prompts of prompt_len tokens,
    or the line's prompt text encoded by `tokenizer` (anything with encode(text) -> token ids)."""
    from ablate.workload.trace import TraceError, read_trace

    rng = np.random.default_rng(cfg.seed)
    requests = []
    for i, entry in enumerate(read_trace(cfg.trace_path)):
        if max_seq_len and entry.prompt is None and entry.prompt_len + entry.output_len > max_seq_len:
            raise TraceError(cfg.trace_path, entry.line, "prompt_len", f"{entry.prompt_len} prompt + "
                             f"{entry.output_len} output tokens exceed model.max_seq_len {max_seq_len}")
        if entry.prompt is None:
            prompt = tuple(int(t) for t in rng.integers(0, vocab_size, entry.prompt_len))
        else:
            if tokenizer is None:
                raise TraceError(cfg.trace_path, entry.line, "prompt",
                                 "prompt text needs the model's tokenizer, and none was given (a model with "
                                 "a checkpoint), or give prompt_len instead")
            prompt = tuple(tokenizer.encode(entry.prompt))
            if not prompt or max(prompt) >= vocab_size:
                raise TraceError(cfg.trace_path, entry.line, "prompt",
                                 f"encodes to {len(prompt)} tokens, not all below the vocabulary size {vocab_size}")
        requests.append(_request(cfg, i, prompt, entry.output_len, entry.arrival_time))
    return requests


def textbook_requests(cfg: WorkloadConfig, vocab_size: int,
                      output_lens: tuple[int, ...] = TEXTBOOK_OUTPUT_LENS) -> list[Request]:
    """The textbook case: requests 0, 1, 2 at t=0 with `output_lens` x cfg.textbook_scale tokens to
    generate, and request 3 (cfg.output_len tokens) at cfg.textbook_arrival_s, while they run; prompts
    of cfg.prompt_len.

    Run it with engine.max_num_seqs=3: the batch is full when the 4th arrives, so it waits either
    for the whole batch (static) or for the first free slot (continuous)."""
    rng = np.random.default_rng(cfg.seed)
    lengths = textbook_lengths(output_lens, cfg.textbook_scale) + [cfg.output_len]
    arrivals = [0.0] * len(output_lens) + [cfg.textbook_arrival_s]
    return [_request(cfg, i, tuple(int(t) for t in rng.integers(0, vocab_size, cfg.prompt_len)), n, t)
            for i, (n, t) in enumerate(zip(lengths, arrivals))]


def textbook_lengths(output_lens: tuple[int, ...], scale: float) -> list[int]:
    """Each length x scale, rounded to the nearest token, at least 1: (500, 450, 100) x 0.2 = [100, 90, 20]."""
    return [max(1, round(n * scale)) for n in output_lens]
