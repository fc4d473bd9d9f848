"""An outside engine runs in a worker process of its own, kept for the experiment's rounds: one whose
process dies of any fatal signal (a segfault in its native code, the out-of-memory killer's SIGKILL),
while loading or while serving, fails its own arm with the signal named, and the experiment finishes
with its other arms measured. One that refuses to start or raises while serving fails its arm as
before. A working one is built once for all rounds, and timed inside its worker: its figures are its
generation's, not its loading's nor the messages'.

The engines are third-party ones, installed the way a user's would be (a distribution on the path,
found through its `ablate.engines` entry points)."""
from __future__ import annotations

import os
import signal

import pytest

from ablate.api.context import EngineConfig
from ablate.engine.arm import baseline_configs
from ablate.experiment.config import ExperimentConfig
from ablate.exit_status import describe_exit
from ablate.outside.arms import resolve_arm
from ablate.experiment.quality_guard import QualityConfig
from ablate.experiment.run import run_experiment
from ablate.workload.requests import WorkloadConfig

ENGINES = '''
import os
import time
from dataclasses import dataclass

from ablate.outside.batches import OneBatchAtATime
from ablate.outside.contract import OutsideEngineConfig, option


@dataclass
class ScriptedConfig(OutsideEngineConfig):
    name: str = "scripted"
    step_s: float = option(0.02, "seconds per token")
    start_s: float = option(0.0, "seconds loading takes")
    log: str = option("", "a file each start and serving is logged to, with the process id")


class Scripted(OneBatchAtATime):
    """Token i of request r is (7 r + i) % 50 + 1, one every step_s seconds; loading takes start_s."""
    name = "scripted"
    config_class = ScriptedConfig

    def __init__(self, config, model, max_batch):
        super().__init__(config, model, max_batch)
        self.log("start")
        time.sleep(config.start_s)

    def log(self, event):
        if self.config.log:
            with open(self.config.log, "a") as f:
                f.write(f"{self.name} {event} {os.getpid()}\\n")

    def describe(self):
        return {"pid": str(os.getpid())}

    def generate(self, batch, emit):
        self.log("serve")
        for i in range(max(r.max_new_tokens for r in batch)):
            time.sleep(self.config.step_s)
            for r in batch:
                if not emit.done(r.request_id):
                    emit(r.request_id, [(7 * r.request_id + i) % 50 + 1])


@dataclass
class FailingConfig(ScriptedConfig):
    name: str = "failing"
    signal: int = option(11, "the signal it sends itself")
    at: str = option("serve", "when it fails: start or serve")
    error: str = option("", "raise this instead of a signal (ValueError loading, RuntimeError serving)")

    def __post_init__(self):
        if self.at not in ("start", "serve"):
            raise ValueError(f"at must be one of start, serve, got {self.at!r}")


class Failing(Scripted):
    """Sends its own process `signal` (or raises `error`) while loading or while serving."""
    name = "failing"
    config_class = FailingConfig

    def __init__(self, config, model, max_batch):
        super().__init__(config, model, max_batch)
        if config.at == "start":
            self.fail(ValueError)

    def generate(self, batch, emit):
        if self.config.at == "serve":
            self.fail(RuntimeError)
        super().generate(batch, emit)

    def fail(self, error):
        if self.config.error:
            raise error(self.config.error)
        os.kill(os.getpid(), self.config.signal)
'''


@pytest.fixture
def engines(tmp_path, monkeypatch):
    """The two engines' distribution on sys.path (the worker gets this process's sys.path)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "ablate_test_engines.py").write_text(ENGINES)
    info = site / "ablate_test_engines-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ablate-test-engines\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ablate.engines]\nscripted = ablate_test_engines:Scripted\n"
                                           "failing = ablate_test_engines:Failing\n")
    monkeypatch.syspath_prepend(str(site))
    return tmp_path / "engines.log"


def experiment(registry, model, arms: dict):
    exp = ExperimentConfig(name="engines", arms=arms, repeats=2, warmup=0, quality=QualityConfig(enabled=False))
    plan = [resolve_arm(name, spec, baseline_configs(registry), registry) for name, spec in exp.arms.items()]
    return run_experiment(exp, plan, lambda overrides: model, WorkloadConfig(num_requests=3, prompt_len=8, output_len=6),
                          EngineConfig(max_num_seqs=2), registry, peaks=None, progress=lambda line: None)


def by_arm(result, arm: str):
    return result.runs[result.runs["arm"] == arm]


FATAL = [("serve", signal.SIGSEGV), ("serve", signal.SIGKILL), ("serve", signal.SIGBUS), ("start", signal.SIGSEGV),
         ("start", signal.SIGABRT)]


@pytest.mark.slow      # a worker process per fatal signal (~17 s); a failing worker: the test below
def test_an_engine_whose_process_dies_of_a_signal_fails_its_arm_and_the_others_are_measured(
        registry, tiny_model, engines):
    dying = {f"{at}_{sig.name}": {"engine": {"name": "failing", "signal": int(sig), "at": at, "log": str(engines)}}
             for at, sig in FATAL}
    scripted = {"engine": {"name": "scripted", "start_s": 1.0, "step_s": 0.02, "log": str(engines)}}
    result = experiment(registry, tiny_model, {"ablate": {}, **dying, "scripted": scripted,
                                                "cached": {"kv_cache": "contiguous"}})
    for (at, sig), arm in zip(FATAL, dying):
        rows = by_arm(result, arm)
        when = "while starting" if at == "start" else "while serving"
        assert list(rows["status"]) == ["failed", "failed"], arm
        assert set(rows["status_detail"]) == {f"engine=failing: its worker process ended {when}: {describe_exit(-sig)}"}
    for arm in ("ablate", "cached", "scripted"):
        assert list(by_arm(result, arm)["status"]) == ["ok", "ok"], arm
    summary = result.summary.set_index("arm")
    assert summary.loc["cached", "speedup"] > 0 and summary.loc["scripted", "speedup"] > 0
    log = engines.read_text().split("\n")
    assert sum(line.startswith("failing start") for line in log) == len(FATAL)     # none tried again in round 2

    # the working engine: built once, in a process of its own, kept for both rounds
    rows = by_arm(result, "scripted")
    assert len(set(rows["engine.pid"])) == 1 and rows["engine.pid"].iloc[0] != str(os.getpid())
    assert [line.split()[1] for line in log if line.startswith("scripted")] == ["start", "serve", "serve", "serve", "serve"]
    # timed inside the worker: 2 batches of 6 tokens a 20 ms; the second waits for the first; not the 1 s loading
    assert (rows["tpot_p50_ms"] >= 20).all() and (rows["duration_s"] >= 12 * 0.02).all()
    assert (rows["duration_s"] < 1.0).all() and (rows["wall_s"] < 1.0).all()


@pytest.mark.parametrize("at, detail", [     # a worker process each (~3 s): serving in the default run
    pytest.param("start", "engine=failing could not start: no room for this model", marks=pytest.mark.slow),
    ("serve", "engine=failing failed while serving: RuntimeError: no room for this model"),
])
def test_an_engine_that_refuses_or_raises_fails_its_arm_once_and_the_others_are_measured(
        registry, tiny_model, engines, at, detail):
    arms = {"ablate": {}, "failing": {"engine": {"name": "failing", "at": at, "error": "no room for this model",
                                                 "log": str(engines)}},
            "cached": {"kv_cache": "contiguous"}}
    result = experiment(registry, tiny_model, arms)
    rows = by_arm(result, "failing")
    assert list(rows["status"]) == ["failed", "failed"] and set(rows["status_detail"]) == {detail}
    assert engines.read_text().count("failing start") == 1        # not tried again in the second round
    assert list(by_arm(result, "cached")["status"]) == ["ok", "ok"]
    assert list(by_arm(result, "ablate")["status"]) == ["ok", "ok"]
