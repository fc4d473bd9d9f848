"""Workloads: which requests arrive when, with how long a prompt and how many tokens to generate."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ablate.request import Request, SamplingParams

LENGTH_DISTS = ("fixed", "uniform", "exponential", "lognormal")
ARRIVALS = ("burst", "poisson", "gamma")


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
    arrival: str = "burst"         # burst (all at t=0) | poisson (rate/s) | gamma (rate/s, burstiness)
    rate: float = 1.0              # requests per second for poisson and gamma
    burstiness: float = 1.0        # gamma shape = 1/burstiness: >1 burstier than Poisson
    temperature: float = 0.0       # 0: greedy
    top_p: float = 1.0
    seed: int = 0                  # seeds lengths, arrivals, prompt tokens and sampling

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"workload.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("prompt_spread", "output_spread", "output_len_max"):
            if getattr(self, name) < 0:
                raise ValueError(f"workload.{name} must be >= 0, got {getattr(self, name)}")
        if self.prompt_dist not in ("fixed", "uniform"):
            raise ValueError(f"workload.prompt_dist must be fixed or uniform, got {self.prompt_dist!r}")
        if self.output_dist not in LENGTH_DISTS:
            raise ValueError(f"workload.output_dist must be one of {LENGTH_DISTS}, got {self.output_dist!r}")
        if self.arrival not in ARRIVALS:
            raise ValueError(f"workload.arrival must be one of {ARRIVALS}, got {self.arrival!r}")
        if self.rate <= 0 or self.burstiness <= 0:
            raise ValueError("workload.rate and workload.burstiness must be > 0")
        if self.prompt_spread >= self.prompt_len and self.prompt_dist == "uniform":
            raise ValueError("workload.prompt_spread must be smaller than workload.prompt_len")
        if self.output_spread >= self.output_len and self.output_dist == "uniform":
            raise ValueError("workload.output_spread must be smaller than workload.output_len")
        if self.temperature < 0:
            raise ValueError(f"workload.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"workload.top_p must be in (0, 1], got {self.top_p}")

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
    n = cfg.num_requests
    if cfg.arrival == "burst":
        return np.zeros(n)
    if cfg.arrival == "poisson":
        gaps = rng.exponential(1.0 / cfg.rate, n)
    else:   # gamma gaps with mean 1/rate and coefficient of variation sqrt(burstiness)
        shape = 1.0 / cfg.burstiness
        gaps = rng.gamma(shape, 1.0 / (cfg.rate * shape), n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def make_requests(cfg: WorkloadConfig, vocab_size: int) -> list[Request]:
    """Seeded synthetic requests: random prompt tokens, lengths and arrivals from the config."""
    rng = np.random.default_rng(cfg.seed)
    if cfg.prompt_dist == "fixed":
        prompt_lens = np.full(cfg.num_requests, cfg.prompt_len)
    else:
        prompt_lens = rng.integers(cfg.prompt_len - cfg.prompt_spread, cfg.prompt_len + cfg.prompt_spread + 1,
                                   cfg.num_requests)
    output_lens = _output_lengths(cfg, rng)
    arrivals = _arrival_times(cfg, rng)
    requests = []
    for i in range(cfg.num_requests):
        prompt = tuple(int(t) for t in rng.integers(0, vocab_size, int(prompt_lens[i])))
        sampling = SamplingParams(cfg.temperature, cfg.top_p, seed=cfg.seed * 100_003 + i)
        requests.append(Request(i, prompt, int(output_lens[i]), sampling, arrival_time=float(arrivals[i])))
    return requests
