"""A battery of bad inputs and faults against the CLI, sweeps, loaders, plugins and the block manager.

    .venv/bin/python benchmarks/bad_inputs.py [--all] [--only SUBSTRING] [--jobs 2] [--out rows.json] [--work-dir DIR]

The default set (123 cases, ~8 min on 2 cores: each CLI case pays 4-8 s of imports) covers every option
and fault once, issue 26's included (cases named 26.N, and their options' values); --all adds more bad
values of the same options and more controls (184 cases, ~11 min).

Each case (CASES, at the end: a name, the command, what its error must name, a timeout) runs as a
subprocess in its own process group and is classified:
  clear error  non-zero exit, no Python traceback (unless the case sets ABLATE_DEBUG=1), and the
               message names what was wrong (the case's expected substring);
  traceback    a raw traceback, or an error that does not name what was wrong;
  hang         still running at the case's timeout (its process group is killed);
  silent       exit 0 where an error was due, or a wrong result (cases that check their result);
  ok           success where success is the right answer (a re-run continues, a valid control);
  not tested   the harness could not set the case up (a fixture failed, a run ended before its kill).
`lost` (fault cases: kills, a failure after measuring, a full disk, two runs at once): whether a
round persisted in runs.csv before the fault is missing afterwards. Exits 0 only when no case hung,
was silent, lost data, gave a traceback or was not tested.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

THIS = str(Path(__file__).resolve())
TRACEBACK = "Traceback (most recent call last)"
FAILING = ("traceback", "hang", "silent", "not tested")
WRONG_RESULT = 3                 # exit status of an in-process case whose result is wrong
MEMORY_LIMIT = 8 << 30           # address space per case: a runaway allocation fails instead of swapping
QUICK = ["model=tiny", "model.init=random", "experiment.repeats=3", "experiment.warmup=0", "workload.num_requests=2",
         "workload.prompt_len=8", "workload.output_len=4", "wandb.mode=disabled", "device=cpu", "threads=1",
         "peak_bandwidth=1e10", "peak_flops=1e11", "results_dir={w}/results"]
SLOW_REPEATS = 10                # fault cases: rounds long enough to be killed between them
SLOW = [f"experiment.repeats={SLOW_REPEATS}", "workload.num_requests=4", "workload.prompt_len=32",
        "workload.output_len=48"]


class NotTested(Exception):
    """The harness could not set a case up."""


class WrongResult(Exception):
    """An in-process case ran without error but its result is wrong."""


@dataclass
class Case:
    name: str                       # the input, in a few words
    argv: list[str]                 # after `python`; {w}: the case's folder, {name}: a fixture (FIXTURES)
    expect: str = ""                # the error must name this (case-insensitive; {w} expanded)
    timeout: float = 90
    want: str = "error"             # error | ok | either (success or a clear error)
    env: dict[str, str] = field(default_factory=dict)
    check: Callable[[Done, Path], str | None] | None = None   # a problem with the run's result, or None
    fault: Callable[[Case, Path, Fixtures], list[Row]] | None = None
    min_rounds: int = 0             # inject_then_rerun: rounds the faulty run must have kept
    extra: bool = False             # another value of an option already covered: run with --all


@dataclass
class Row:
    name: str
    outcome: str
    lost: str = "-"                 # fault cases: "no" or "YES"
    message: str = ""
    seconds: float = 0.0
    output: str = field(default="", repr=False)


@dataclass
class Done:
    rc: int | None
    out: str
    err: str
    timed_out: bool

    @property
    def text(self) -> str:
        return self.err + "\n" + self.out


# -- running and classifying -------------------------------------------------------------------------

def start(argv: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a command in its own process group, its output to files in `cwd` (no pipe to fill)."""
    environment = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "ABLATE_DEBUG")}
    environment |= {"WANDB_MODE": "disabled"} | (env or {})
    limit = ["prlimit", f"--as={MEMORY_LIMIT}", "--"] if shutil.which("prlimit") else []
    cwd.mkdir(parents=True, exist_ok=True)
    n = len(list(cwd.glob("*.out")))
    with open(cwd / f"{n}.out", "w") as out, open(cwd / f"{n}.err", "w") as err:
        proc = subprocess.Popen([*limit, *argv], cwd=cwd, env=environment, stdout=out, stderr=err,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    proc.logs = (cwd / f"{n}.out", cwd / f"{n}.err")
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> Done:
    """Wait for it; past `timeout`, kill its whole process group."""
    try:
        proc.wait(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        timed_out = True
    out, err = (log.read_text(errors="replace") for log in proc.logs)
    return Done(None if timed_out else proc.returncode, out, err, timed_out)


def run(argv: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None) -> Done:
    return finish(start(argv, cwd, env), timeout)


def first_line(done: Done) -> str:
    """What a user reads first: an `error:` line, else the exception a traceback ends with, else the
    first line that speaks of a problem, else the first (failed) or last (succeeded) line."""
    err = [line.strip() for line in re.sub(r".*Warning: .*\n(  \S.*\n)?", "", done.err + "\n").splitlines()
           if line.strip()]                      # Python warnings (and the source line each echoes) left out
    out = [line.strip() for line in done.out.splitlines() if line.strip()]
    for line in err + out:
        if re.match(r"(\[job \d+\] )?(error|WRONG RESULT):", line, re.I):
            return line
    if TRACEBACK in done.text:      # the exception line: the first unindented line after the frames
        tail = done.text[done.text.rindex(TRACEBACK) + len(TRACEBACK):].splitlines()
        raised = [line for line in tail if re.match(r"[A-Za-z_][\w.]*(: |$)", line)]
        if raised:
            return raised[0].strip()
    for line in err + (out if done.rc else []):
        if re.search(r"error|refus|cannot|can't|must|invalid|not |failed", line, re.I):
            return line
    if done.rc != 0:
        return (err or out or [""])[0]
    return (out or err or [""])[-1]


def classify(done: Done, case: Case, work: Path) -> tuple[str, str]:
    """(outcome, first message line) of one run against what the case wants."""
    message = first_line(done)[:300]
    problem = case.check(done, work) if case.check and not done.timed_out else None
    if done.timed_out:
        return "hang", f"still running after {case.timeout:.0f} s; {message}"
    if done.rc == WRONG_RESULT and "WRONG RESULT" in done.err:
        return "silent", message
    if done.rc == 0:
        if case.want == "error":
            return "silent", f"exit 0{'; ' + problem if problem else ''}: {message}"
        return ("silent", problem) if problem else ("ok", message)
    if TRACEBACK in done.text and case.env.get("ABLATE_DEBUG") != "1":
        return "traceback", message
    if case.want == "ok":
        return "silent", f"failed where success was due: {message}"
    said = re.sub(r".*(\[HYDRA\]|Error executing job with overrides).*", "", done.text)   # not Hydra's echo
    if case.expect.replace("{w}", str(work)).lower() not in said.lower():          # of the overrides
        return "traceback", f"exit {done.rc} without naming {case.expect!r}: {message}"
    return ("silent", problem) if problem else ("clear error", message)


def run_case(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
    """Run one case in its own folder; a fault case returns a row per step (the fault, the re-run)."""
    started = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    try:
        if case.fault is not None:
            rows = case.fault(case, work, fixtures)
        else:
            done = run(fixtures.expand(case.argv, work), work, case.timeout, fixtures.expand_env(case.env, work))
            outcome, message = classify(done, case, work)
            rows = [Row(case.name, outcome, "-", message, output=done.text[-4000:])]
    except NotTested as why:
        rows = [Row(case.name, "not tested", "-", str(why))]
    for row in rows:
        row.seconds = round(time.monotonic() - started, 1)
    return rows


# -- fault cases: the rounds in runs.csv before the fault, and after -----------------------------------

def rounds(results: Path) -> set[tuple[str, ...]]:
    """(run id, arm, repeat, duration) of every round in the runs.csv files below `results`; a folder
    set aside (<id>.old-<time>) keeps its rounds: nothing in it is lost."""
    found = set()
    for file in results.glob("*/*/runs.csv"):
        try:
            with file.open() as f:
                found |= {(file.parent.name.split(".old-")[0], r.get("arm", ""), r.get("repeat", ""), f"{float(r['duration_s']):.9g}")
                          for r in csv.DictReader(f)}
        except (OSError, ValueError, KeyError, csv.Error):
            pass
    return found


def wait_for_round(proc: subprocess.Popen, results: Path, timeout: float) -> set[tuple[str, ...]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kept := rounds(results):
            return kept
        if proc.poll() is not None:
            done = finish(proc, 5)
            raise NotTested(f"the run ended (exit {done.rc}) before a round was persisted: {first_line(done)}")
        time.sleep(0.02)
    finish(proc, 0.01)
    raise NotTested(f"no round persisted within {timeout:.0f} s")


def lost(before: set, after: set) -> str:
    return "YES" if before - after else "no"


def rerun_row(name: str, case: Case, argv: list[str], work: Path, before: set) -> Row:
    """The same command again: it must finish, continuing from the rounds kept."""
    done = run(argv, work, case.timeout)
    if done.timed_out or done.rc != 0:
        outcome, message = classify(done, Case(name, [], timeout=case.timeout, want="ok"), work)
    elif "continuing an unfinished run" not in done.out:
        outcome, message = "silent", "the re-run did not continue from the kept rounds"
    else:
        outcome, message = "ok", next(x for x in done.out.splitlines() if "continuing an unfinished" in x).strip()
    return Row(name, outcome, lost(before, rounds(work / "results")), message, output=done.text[-4000:])


def kill_then_rerun(sig: signal.Signals):
    def fault(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
        argv = fixtures.expand(case.argv, work)
        proc = start(argv, work)
        before = wait_for_round(proc, work / "results", case.timeout)
        os.killpg(proc.pid, sig)
        done = finish(proc, 30)                     # SIGINT and SIGTERM must stop it within 30 s
        kept = rounds(work / "results")
        if done.timed_out:
            row = Row(case.name, "hang", lost(before, kept), f"still running 30 s after {sig.name}")
        elif done.rc == 0:
            row = Row(case.name, "silent", lost(before, kept), f"{sig.name} ignored: the run went on to its end")
        elif TRACEBACK in done.text:
            row = Row(case.name, "traceback", lost(before, kept), first_line(done))
        else:
            said = done.err.strip().splitlines()[-1:]         # what it said as it stopped, if anything
            row = Row(case.name, "ok", lost(before, kept),
                      f"stopped (exit {done.rc}), {len(kept)} round(s) kept" + "".join(f"; {x}" for x in said))
        row.output = done.text[-4000:]
        return [row, rerun_row(f"re-run after {sig.name}", case, argv, work, before)]
    return fault


def plain(argv: list[str]) -> list[str]:
    """A command with a fault injected (THIS --internal PATCH ...) without the fault."""
    return [THIS, "--internal", "pinned", *argv[3:]] if argv[:2] == [THIS, "--internal"] else argv


def inject_then_rerun(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
    """The run with a fault injected, then the plain command again (which must continue)."""
    done = run(fixtures.expand(case.argv, work), work, case.timeout)
    kept = rounds(work / "results")
    outcome, message = classify(done, case, work)
    lost_rounds = "YES" if len({r[2] for r in kept}) < case.min_rounds else "no"
    return [Row(case.name, outcome, lost_rounds, message, output=done.text[-4000:]),
            rerun_row(f"re-run after: {case.name}", case, fixtures.expand(plain(case.argv), work), work, kept)]


def two_at_once(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
    """A second process on the same config while the first measures: it must wait or refuse."""
    argv = fixtures.expand(case.argv, work)
    first = start(argv, work / "a")
    wait_for_round(first, work / "results", case.timeout)
    second = finish(start(argv, work / "b"), case.timeout)
    first_done = finish(first, case.timeout)
    lost_rounds = "YES" if len({r[2] for r in rounds(work / "results")}) < SLOW_REPEATS else "no"
    if first_done.rc != 0 or second.timed_out:
        outcome, message = classify(second if second.timed_out else first_done,
                                    Case(case.name, [], timeout=case.timeout, want="ok"), work)
    elif second.rc != 0:
        outcome, message = classify(second, case, work)
    elif re.search(r"round \d+:", second.out):
        outcome, message = "silent", "both processes measured into the same run folder at once"
    else:
        outcome, message = "ok", first_line(second)
    return [Row(case.name, outcome, lost_rounds, message, output=(second.text + first_done.text)[-4000:])]


def full_tmpfs(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
    """A real full disk: results on a 4 MiB tmpfs in the run's own mount namespace, filled after round 1;
    the namespace copies what is left to {w}/results before it ends."""
    mount, keep = work / "mnt", work / "results"
    mount.mkdir(parents=True, exist_ok=True)
    argv = fixtures.expand(case.argv, work)
    script = f'mount -t tmpfs -o size=4m tmpfs {mount} || exit 97; "$@"; rc=$?; rm -f {mount}/fill; ' \
             f"mkdir -p {keep}; cp -a {mount}/. {keep}/; exit $rc"
    proc = start(["unshare", "-m", "sh", "-c", script, "sh", *argv], work)
    before = wait_for_round(proc, Path(f"/proc/{proc.pid}/root{mount}"), case.timeout)
    try:
        with open(f"/proc/{proc.pid}/root{mount}/fill", "wb") as f:
            while True:
                f.write(bytes(1 << 16))
    except OSError:
        pass                                                  # full now
    done = finish(proc, case.timeout)
    outcome, message = classify(done, case, work)
    rows = [Row(case.name, outcome, lost(before, rounds(keep)), message, output=done.text[-4000:])]
    rerun = [a.replace(f"results_dir={mount}", f"results_dir={keep}") for a in argv]
    return rows + [rerun_row("re-run after the full tmpfs", case, rerun, work, before)]


def reuse_after_change(setup: Callable[[Path, Fixtures], None], change: Callable[[Path], None] | None,
                       kill: bool = False):
    """Run (killed by SIGKILL after a round when `kill`), change what it measured (`change`; None: the
    control, nothing), run again: a change must not be reused (neither skipped as finished nor
    continued) and the re-run must say what changed; the control must be reused."""
    def fault(case: Case, work: Path, fixtures: Fixtures) -> list[Row]:
        setup(work, fixtures)
        argv, env = fixtures.expand(case.argv, work), fixtures.expand_env(case.env, work)
        if kill:
            proc = start(argv, work, env)
            before = wait_for_round(proc, work / "results", case.timeout)
            os.killpg(proc.pid, signal.SIGKILL)
            finish(proc, 30)
        else:
            first = run(argv, work, case.timeout, env)
            if first.rc != 0:
                raise NotTested(f"the first run failed (exit {first.rc}): {first_line(first)}")
        before = rounds(work / "results")
        if change is not None:
            change(work)
        done = run(argv, work, case.timeout, env)
        reused = re.search(r"already finished, skipped|continuing an unfinished run", done.out)
        if done.timed_out or done.rc != 0:
            outcome, message = classify(done, Case(case.name, [], timeout=case.timeout, want="ok"), work)
        elif change is None:
            outcome, message = ("ok", reused.group(0)) if reused else ("silent", "an unchanged run was measured again")
        elif reused:
            outcome, message = "silent", f"reused after the change: {reused.group(0)}"
        elif "not reused" not in done.out:
            outcome, message = "silent", "measured afresh without saying why the earlier rounds were not reused"
        else:
            outcome, message = "ok", next(x for x in done.out.splitlines() if "not reused" in x).strip()
        return [Row(case.name, outcome, lost(before, rounds(work / "results")), message, output=done.text[-4000:])]
    return fault


def copy_checkpoint(work: Path, fixtures: Fixtures) -> None:
    shutil.copytree(fixtures.get("hf"), work / "ckpt")


def replace_checkpoint(work: Path) -> None:
    """Other weights at the same path, same size (a fine-tuned copy put in place)."""
    scaled_weight(work / "ckpt")


def copy_site(work: Path, fixtures: Fixtures) -> None:
    shutil.copytree(fixtures.get("third_party"), work / "site")


def edit_plugin(work: Path) -> None:
    source = work / "site" / "fake_third_party" / "__init__.py"
    source.write_text(source.read_text() + "# edited: a fix to its cache\n")


def job_failed_alone(done: Done, work: Path) -> str | None:
    """A sweep where one job dies: the other job finished, and the dead one is listed as failed."""
    if not list((work / "results").glob("*/*/done.json")):
        return "no other job of the sweep finished"
    return None if re.search(r"did not finish|failed", done.text) else "the dead job is not reported as failed"


def other_arm_measured(done: Done, work: Path) -> str | None:
    """The crashing arm failed alone: the other arm has rounds in runs.csv."""
    for file in (work / "results").glob("*/*/runs.csv"):
        with file.open() as f:
            if any(r.get("arm") == "base" for r in csv.DictReader(f)):
                return None if "FAILED" in done.out or done.rc else "the crashed arm's failure is not reported"
    return "the other arm was not measured"


def names_the_package(package: str):
    def check(done: Done, work: Path) -> str | None:
        return None if package in done.text else f"nothing names {package}"
    return check


# -- fixtures: built once, on first use ({name} in a case's argv) ---------------------------------------

class Fixtures:
    def __init__(self, root: Path) -> None:
        self.root, self.lock, self.built, self.failed = root, threading.RLock(), {}, {}

    def get(self, name: str) -> str:
        with self.lock:
            if name not in self.built and name not in self.failed:
                try:
                    self.built[name] = str(FIXTURES[name](self.root, self))
                except Exception as err:
                    self.failed[name] = f"fixture {name} failed: {type(err).__name__}: {err}"[:300]
            if name in self.failed:
                raise NotTested(self.failed[name])
            return self.built[name]

    def expand(self, words: list[str], work: Path) -> list[str]:
        lazy = type("Lazy", (dict,), {"__missing__": lambda _, key: self.get(key)})(w=str(work))
        return [sys.executable, *(word.format_map(lazy) for word in words)]

    def expand_env(self, env: dict[str, str], work: Path) -> dict[str, str]:
        """A case's environment with its {fixture} names expanded, as in its argv."""
        return {k: v for k, v in zip(env, self.expand(list(env.values()), work)[1:])}

    def cleanup(self) -> None:
        if "results_ro" in self.built:
            subprocess.run(["chattr", "-i", self.built["results_ro"]], capture_output=True)


def make_hf(root: Path, _) -> Path:
    """A tiny random Llama in Hugging Face format (config.json + model.safetensors, no tokenizer.json)."""
    import torch
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=320, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    return root / "hf"


def hf_edited(edit: Callable[[Path], None]):
    def make(root: Path, fixtures: Fixtures) -> Path:
        path = root / f"hf_{len(list(root.glob('hf_*')))}"
        shutil.copytree(fixtures.get("hf"), path)
        edit(path)
        return path
    return make


def nan_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"][0, 0] = float("nan")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def scaled_weight(path: Path) -> None:
    from safetensors.torch import load_file, save_file
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.weight"] *= 0.5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def without_hidden_size(path: Path) -> None:
    config = json.loads((path / "config.json").read_text())
    del config["hidden_size"]
    (path / "config.json").write_text(json.dumps(config))


def truncate(file: Path, fraction: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:int(len(data) * fraction)])


def write(name: str, content: str | bytes):
    def make(root: Path, _) -> Path:
        root.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(content if isinstance(content, bytes) else content.encode())
        return root / name
    return make


def good_run(root: Path, _) -> Path:
    """A finished run folder of the quick config."""
    work = root / "good_root"
    done = run([sys.executable, "-m", "ablate", *[q.replace("{w}", str(work)) for q in QUICK]], work, 300)
    found = sorted((work / "results").glob("*/*/done.json"))
    if not found:
        raise NotTested(f"the good run failed (exit {done.rc}): {first_line(done)}")
    return found[0].parent


def run_copy(name: str, edit: Callable[[Path], None], give_root: bool = False):
    """A copy of the good run, edited, under {root}/{name}/default/<id>."""
    def make(root: Path, fixtures: Fixtures) -> Path:
        good = Path(fixtures.get("good"))
        path = root / name / good.parent.name / good.name
        shutil.copytree(good, path)
        edit(path)
        return root / name if give_root else path
    return make


def as_failed(path: Path) -> None:
    for name in ("done.json", "summary.csv", "report.md"):
        (path / name).unlink(missing_ok=True)
    (path / "failed.json").write_text(json.dumps({"status": "failed", "error": "RuntimeError: boom"}))


def corrupted(path: Path) -> None:
    (path / "config.json").write_text('{"model": ')
    for name in ("runs.csv", "summary.csv", "requests.csv"):
        (path / name).write_bytes(b"\x00\xff garbage\n1,2,3\n")


def read_only_dir(root: Path, _) -> Path:
    path = root / "results_ro"
    path.mkdir(parents=True)
    os.chmod(path, 0o555)
    if os.geteuid() == 0 and subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        raise NotTested("running as root and chattr +i failed: no way to make a read-only folder")
    return path


def empty_dir(name: str):
    def make(root: Path, _) -> Path:
        (root / name).mkdir(parents=True)
        return root / name
    return make


def fake_distribution(name: str, module: str, entry_points: str):
    """A folder to put on PYTHONPATH holding one installed distribution `name` (its package `name`
    with `module` as __init__.py, and a dist-info declaring `entry_points`), as pip would leave it."""
    def make(root: Path, _) -> Path:
        site = root / f"site_{name}"
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text(module)
        info = site / f"{name}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(entry_points)
        (info / "RECORD").write_text(f"{name}/__init__.py,,\n")
        return site
    return make


def cache_plugin(name: str, body: str = "") -> str:
    """A KV cache plugin module: the contiguous cache renamed `name`, `body` run in its __init__."""
    return (f"import os, signal, sys\nfrom dataclasses import dataclass\n"
            f"from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache\n\n"
            f"@dataclass\nclass Config(ContiguousConfig):\n    name: str = {name!r}\n\n"
            f"class Cache(ContiguousKVCache):\n    name = {name!r}\n    config_class = Config\n\n"
            f"    def __init__(self, *args, **kwargs):\n        {body or 'pass'}\n"
            f"        super().__init__(*args, **kwargs)\n")


SEGV_ENGINE = """import os, signal
from ablate.outside.contract import OutsideEngine


class Crashes(OutsideEngine):
    name = "segv"

    def serve(self, requests, timeline):
        os.kill(os.getpid(), signal.SIGSEGV)     # as a native engine crashing in its own code
"""


def native_cache(size: Callable[[int], int]):
    """An ABLATE_CACHE_DIR holding this machine's cached native library cut to size(len) bytes."""
    def make(root: Path, _) -> Path:
        cache = root / f"native_cache_{len(list(root.glob('native_cache_*')))}"
        cache.mkdir(parents=True)
        found = sorted((Path.home() / ".cache" / "ablate").glob("native-*.so"))
        if not found:
            raise NotTested("no cached native library in ~/.cache/ablate to damage (run once to build it)")
        for lib in found:
            data = lib.read_bytes()
            (cache / lib.name).write_bytes(data[:size(len(data))])
        return cache
    return make


def as_list_config(path: Path) -> None:
    (path / "config.json").write_text("[1, 2, 3]")


TRACE_OK = '{"arrival_time": 0.0, "prompt_len": 8, "output_len": 4}\n{"arrival_time": 0.01, "prompt_len": 8, "output_len": 4}\n'
FIXTURES: dict[str, Callable[[Path, Fixtures], Path]] = {
    "hf": make_hf,
    "hf_nan": hf_edited(nan_weight),
    "hf_no_hidden": hf_edited(without_hidden_size),
    "hf_empty_config": hf_edited(lambda p: (p / "config.json").write_text("")),
    "hf_bad_json": hf_edited(lambda p: (p / "config.json").write_text('{"model_type": "llama",')),
    "hf_truncated": hf_edited(lambda p: truncate(p / "model.safetensors")),
    "garbage_gguf": write("garbage.gguf", bytes(range(256)) * 64),
    "trace_ok": write("ok.jsonl", TRACE_OK),
    "trace_empty": write("empty.jsonl", ""),
    "trace_latin1": write("latin1.jsonl", '{"arrival_time": 0, "prompt": "caf\xe9", "output_len": 4}\n'.encode("latin-1")),
    "trace_line3": write("line3.jsonl", TRACE_OK + '{"arrival_time": 0.02, "prompt_len": 8,\n'),
    "trace_epoch": write("epoch.jsonl", "".join(f'{{"arrival_time": {1.76e9 + i}, "prompt_len": 8, "output_len": 4}}\n'
                                                 for i in range(2))),
    "trace_negative": write("negative.jsonl", '{"arrival_time": 0, "prompt_len": -8, "output_len": 4}\n'),
    "trace_huge": write("huge.jsonl", '{"arrival_time": 0, "prompt_len": 1000000000, "output_len": 4}\n'),
    "a_file": write("a_file", "not a folder\n"),
    "results_ro": read_only_dir,
    **{name: empty_dir(name) for name in ("empty_trace", "empty_collect", "empty_report")},
    "good": good_run,
    "failed_run": run_copy("failed_run", as_failed),
    "corrupt_run": run_copy("corrupt_run", corrupted),
    "truncated_summary": run_copy("truncated_summary", lambda p: truncate(p / "summary.csv", 0.4), give_root=True),
    "list_config": run_copy("list_config", as_list_config, give_root=True),
    "exits_at_import": fake_distribution("fake_exits_at_import", "import sys\nsys.exit(0)\n",
                                         "[ablate.plugins]\nkv_cache.exits_at_import = fake_exits_at_import:Cache\n"),
    "duplicate_name": fake_distribution("fake_duplicate", cache_plugin("contiguous"),
                                        "[ablate.plugins]\nkv_cache.contiguous = fake_duplicate:Cache\n"),
    "third_party": fake_distribution("fake_third_party", cache_plugin("third_party"),
                                     "[ablate.plugins]\nkv_cache.third_party = fake_third_party:Cache\n"),
    "sigkill_plugin": fake_distribution("fake_sigkill", cache_plugin("sigkill", "os.kill(os.getpid(), signal.SIGKILL)"),
                                        "[ablate.plugins]\nkv_cache.sigkill = fake_sigkill:Cache\n"),
    "segv_engine": fake_distribution("fake_segv", SEGV_ENGINE, "[ablate.engines]\nsegv = fake_segv:Crashes\n"),
    "native_empty": native_cache(lambda n: 0),
    "native_truncated": native_cache(lambda n: n // 2),
}


# -- in-process cases: `THIS --internal NAME ARGS...` ---------------------------------------------------

def bad_plugins() -> tuple[type, ...]:
    """Two KV caches, not installed: one raises in __init__, one calls sys.exit(3) there."""
    from dataclasses import make_dataclass

    from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache

    def config(name: str) -> type:
        return make_dataclass(f"{name.title().replace('_', '')}Config", [("name", str, field(default=name))],
                              bases=(ContiguousConfig,))

    class RaisesInInit(ContiguousKVCache):
        name, config_class = "raises_in_init", config("raises_in_init")

        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("raises_in_init: broken on purpose")

    class ExitsInInit(ContiguousKVCache):
        name, config_class = "exits_in_init", config("exits_in_init")

        def __init__(self, *args, **kwargs) -> None:
            sys.exit(3)

    return RaisesInInit, ExitsInInit


def with_bad_plugins() -> None:
    import ablate.cli
    from ablate.engine.registry import default_registry
    registry = default_registry().with_plugins(*bad_plugins())
    ablate.cli.default_registry = lambda: registry


def disk_full_after(writes: int) -> Callable[[], None]:
    """ablate.results.write_atomic fails with ENOSPC from its (writes + 1)-th call on."""
    def patch() -> None:
        import errno

        import ablate.results
        real, count = ablate.results.write_atomic, [0]

        def write_atomic(path, text) -> None:
            count[0] += 1
            if count[0] > writes:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            real(path, text)
        ablate.results.write_atomic = write_atomic
    return patch


def summary_fails() -> None:
    import ablate.experiment.run

    def summarise_arms(*args, **kwargs):
        raise RuntimeError("injected failure after measuring")
    ablate.experiment.run.summarise_arms = summarise_arms


def pinned() -> None:
    """One code_version for every run of a fault case: other people editing this working tree between
    a fault and its re-run would otherwise set the kept rounds aside as "measured by other code"."""
    import ablate.experiment.identity
    import ablate.experiment.job
    import ablate.results
    ablate.results.code_version = ablate.experiment.job.code_version = lambda: "bad-inputs-battery"
    repo, real = Path(ablate.results.__file__).resolve().parents[1], ablate.experiment.identity.files_digest

    def files_digest(files) -> str:     # the repository's plugin packages, which others may edit, pinned too
        inside = all(Path(f).resolve().is_relative_to(repo) for f in files)
        return "bad-inputs-battery" if files and inside else real(files)
    ablate.experiment.identity.files_digest = files_digest


PATCHES = {"plugins": with_bad_plugins, "disk_full_after_4": disk_full_after(4), "disk_full_after_0": disk_full_after(0),
           "summary_fails": summary_fails, "pinned": pinned}
SEQ = 4242      # the sequence the block-manager cases start with: 5 tokens, committed


def stale_prefix_cache(_) -> None:
    from ablate_kv_cache.block_manager import BlockManager
    m = BlockManager(4, 4, enable_prefix_caching=True)
    m.allocate(0, [1, 2, 3, 4, 5])
    m.commit(0, [1, 2, 3, 4, 5])
    m.allocate(1, [1, 2, 3, 4, 6])
    m.commit(1, [1, 2, 3, 4, 6])
    m.truncate(0, 2)
    m.free(1)
    m.append(0, 2)
    m.commit(0, [1, 2, 9, 9])
    if (cached := m.allocate(2, [1, 2, 3, 4, 7])) >= 4:
        raise WrongResult(f"a block rewritten to [1, 2, 9, 9] still serves prefix [1, 2, 3, 4]: {cached} tokens cached")


BLOCK_MANAGER: dict[str, tuple[Callable, str]] = {    # misuse -> (what it does to the manager, what the error names)
    "append(seq, -3)": (lambda m: m.append(SEQ, -3), "-3"),
    "append to an unknown sequence": (lambda m: m.append(777, 1), "777"),
    "append past the pool": (lambda m: m.append(SEQ, 1000), "append"),
    "free an unknown sequence": (lambda m: m.free(777), "777"),
    "free a sequence twice": (lambda m: (m.free(SEQ), m.free(SEQ)), str(SEQ)),
    "allocate a sequence that holds blocks": (lambda m: m.allocate(SEQ, [1, 2]), str(SEQ)),
    "allocate without room": (lambda m: m.allocate(1, list(range(100))), "allocate"),
    "allocate 3 cached tokens of 4-token blocks": (lambda m: m.allocate(1, [1, 2, 3, 4, 5, 6], num_cached=3), "3"),
    "allocate num_tokens=-5": (lambda m: m.allocate(1, [1, 2], num_tokens=-5), "-5"),
    "truncate past the end": (lambda m: m.truncate(SEQ, 99), "99"),
    "truncate to -1": (lambda m: m.truncate(SEQ, -1), "-1"),
    "fork an unknown parent": (lambda m: m.fork(777, 1), "777"),
    "fork onto a held sequence": (lambda m: m.fork(SEQ, SEQ), str(SEQ)),
    "commit an unknown sequence": (lambda m: m.commit(777, [1, 2, 3, 4]), "777"),
    "can_append of an unknown sequence": (lambda m: m.can_append(777, 1), "777"),
    "BlockManager(num_blocks=0)": (lambda m: type(m)(0, 4), "num_blocks"),
    "BlockManager(block_size=-4)": (lambda m: type(m)(4, -4), "block_size"),
}


def block_manager_case(name: str) -> None:
    """One misuse on a manager holding sequence SEQ; a refused call must leave it consistent."""
    from ablate_kv_cache.block_manager import BlockManager
    m = BlockManager(8, 4, enable_prefix_caching=True)
    m.allocate(SEQ, [1, 2, 3, 4, 5])
    m.commit(SEQ, [1, 2, 3, 4, 5])
    refused = None
    try:
        BLOCK_MANAGER[name][0](m)
    except Exception as err:
        refused = err
    try:
        m.check_invariants()
    except AssertionError as err:
        raise WrongResult(f"{name} left the bookkeeping inconsistent: {err}") from None
    if refused is not None:
        raise refused


def internal(name: str, args: list[str]) -> None:
    if all(patch in PATCHES for patch in name.split("+")):    # the CLI, in this process, patched
        for patch in name.split("+"):
            PATCHES[patch]()
        sys.argv = ["ablate", *args]
        from ablate.cli import main as cli_main
        cli_main()
        return
    try:
        stale_prefix_cache(None) if name == "stale prefix cache" else block_manager_case(name)
    except WrongResult as wrong:
        print(f"WRONG RESULT: {wrong}", file=sys.stderr)
        sys.exit(WRONG_RESULT)
    except Exception as err:
        if not (isinstance(err, (ValueError, RuntimeError)) or type(err).__module__.startswith("ablate")):
            raise                                # a bare KeyError, IndexError, ...: a traceback
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)   # its own refusal
        sys.exit(1)


# -- the cases ------------------------------------------------------------------------------------------

def quick(overrides: tuple[str, ...]) -> list[str]:
    """QUICK with the overrides' keys replaced, then the overrides."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    return [q for q in QUICK if q.split("=", 1)[0] not in keys] + list(overrides)


def cli(name: str, *overrides: str, **kw) -> Case:
    return Case(name, ["-m", "ablate", *quick(overrides)], **kw)


def sweep(name: str, *overrides: str, patch: str | None = None, **kw) -> Case:
    head = [THIS, "--internal", patch] if patch else ["-m", "ablate"]
    return Case(name, [*head, "-m", *quick(overrides)], check=kw.pop("check", other_job_done), **kw)


def patched(name: str, patch: str, *overrides: str, **kw) -> Case:
    return Case(name, [THIS, "--internal", patch, *quick(overrides)], **kw)


def tool(name: str, *words: str, **kw) -> Case:
    return Case(name, list(words), **kw)


def other_job_done(done: Done, work: Path) -> str | None:
    return None if list((work / "results").glob("*/*/done.json")) else "no other job of the sweep finished"


def arm_failed(done: Done, work: Path) -> str | None:
    """A plugin that raises (or calls sys.exit) is the arm's failure, by design: the job may end well if
    it says FAILED."""
    return "the arm's failure is not reported" if done.rc == 0 and "FAILED" not in done.out else None


def no_round(done: Done, work: Path) -> str | None:
    return "refused only after measuring (a round was printed)" if re.search(r"round \d+:", done.out) else None


def num(option: str, value: str, *extra: str, **kw) -> Case:
    """A bad value of a numeric (or choice) option; its error must name the option."""
    return cli(f"{option}={value}" + (f" ({' '.join(extra)})" if extra else ""), *extra, f"{option}={value}",
               expect=kw.pop("expect", option), **kw)


TRACE = ("workload.arrival=trace",)
CASES: list[Case] = [
    *[num("workload.rate", v, "workload.arrival=poisson", extra=v != "nan") for v in ("nan", "-1", "0")],
    num("workload.rate", "inf", "workload.arrival=poisson", want="either", extra=True),
    *[num("workload.burstiness", v, "workload.arrival=gamma", extra=v != "nan") for v in ("nan", "0")],
    *[num("workload.textbook_arrival_s", v, "workload.arrival=textbook", extra=v != "nan") for v in ("nan", "-1")],
    *[num("workload.temperature", v, extra=v != "nan") for v in ("nan", "-1")],
    *[num("workload.top_p", v, extra=v != "2") for v in ("2", "0", "nan")],
    *[num("workload.output_sigma", v, "workload.output_dist=lognormal", extra=v != "nan") for v in ("nan", "-1")],
    num("workload.prompt_spread", "-3", "workload.prompt_dist=uniform", extra=True),
    *[num("workload.seed", v, extra=v != "-1") for v in ("-1", "1e30")],
    *[num("workload.num_requests", v, extra=v != "abc") for v in ("0", "abc")],
    num("workload.prompt_len", "0"), num("workload.prompt_len", "2.5", extra=True),
    num("workload.output_len", "-4", extra=True), num("workload.output_len", "1000000", expect="output_len", timeout=60),
    *[num(f"workload.{k}", "bogus", extra=k != "arrival") for k in ("arrival", "output_dist", "source", "prompt_kind")],
    num("threads", "-5"), num("device", "tpu"), num("peak_bandwidth", "nan"), num("peak_flops", "-1", extra=True),
    num("experiment.repeats", "0"), num("experiment.warmup", "-1", extra=True),
    num("experiment.ci_target", "nan", extra=True), num("experiment.max_repeats", "2"),
    num("experiment.time_budget_s", "inf", extra=True),
    *[num("engine.max_num_seqs", v, extra=v != "0") for v in ("0", "-1")],
    *[num("engine.max_num_seqs", "100000000", f"kv_cache={k}", want="either", timeout=60)
      for k in ("paged", "contiguous")],
    num("engine.max_num_batched_tokens", "0", extra=True), num("engine.max_seq_len", "-1", extra=True),
    num("model.dtype", "fp64"), num("model.n_heads", "0"), num("model.n_heads", "3", extra=True),
    num("model.d_model", "-64", extra=True), num("model.init", "trained", extra=True),
    num("model.rope_base", "nan"), num("model.vocab_size", "0", extra=True),
    num("kv_cache.block_size", "0", "kv_cache=paged"),
    num("kv_cache.budget_bytes", "-1", "kv_cache=contiguous", extra=True),
    num("kv_cache.budget_bytes", "1", "kv_cache=contiguous"),
    *[num("kv_cache.budget_fraction", v, "kv_cache=paged", extra=v != "2") for v in ("2", "nan")],
    num("decoding.k", "0", "decoding=speculative", extra=True),
    num("decoding.drafter", "oracle", "decoding=speculative"),
    cli("model=gpt-5 (an unknown preset)", "model=gpt-5", expect="gpt-5", extra=True),
    cli("workload.bogus=1 (no +)", "workload.bogus=1", expect="bogus"),
    cli("+workload.bogus=1", "+workload.bogus=1", expect="bogus"),
    cli("bogus=1 (top level, no +)", "bogus=1", expect="bogus", extra=True),
    cli("+bogus=1 (top level)", "+bogus=1", expect="bogus"),
    cli("+kv_cache.bogus=1 kv_cache=contiguous", "kv_cache=contiguous", "+kv_cache.bogus=1", expect="bogus"),
    cli("+experiment.grid.bogus=[1,2]", "+experiment.grid.bogus=[1,2]", expect="bogus", extra=True),
    cli("kv_cache=nonesuch", "kv_cache=nonesuch", expect="nonesuch"),
    cli("attention=nonesuch", "attention=nonesuch", expect="nonesuch", extra=True),
    cli("an experiment arm with kv_cache=nonesuch", "+experiment.arms.x.kv_cache=nonesuch", expect="nonesuch"),
    cli("ABLATE_BLOCK_PLUGINS=kv_cache.paged with kv_cache=paged", "kv_cache=paged", expect="blocked",
        env={"ABLATE_BLOCK_PLUGINS": "kv_cache.paged"}),
    cli("ABLATE_BLOCK_PLUGINS=kv_cache/paged with kv_cache=paged", "kv_cache=paged", expect="paged",
        env={"ABLATE_BLOCK_PLUGINS": "kv_cache/paged"}),
    # paged attention reads MLA's explicit K/V (the kernel on a GPU, the block-table gather on a CPU): it runs
    cli("variant=mla kv_cache=paged attention=paged (supported)", "variant=mla", "kv_cache=paged",
        "attention=paged", want="ok"),
    cli("attention=paged kv_cache=contiguous", "attention=paged", "kv_cache=contiguous", expect="paged",
        check=no_round),
    cli("ABLATE_DEBUG=1 workload.top_p=2 (a traceback is allowed)", "workload.top_p=2", expect="top_p",
        env={"ABLATE_DEBUG": "1"}),
    cli("model.path=/nonexistent", "model.init=pretrained", "model.path=/nonexistent", expect="/nonexistent"),
    cli("model.path: config.json without hidden_size", "model.init=pretrained", "model.path={hf_no_hidden}",
        expect="hidden_size"),
    cli("model.path: an empty config.json", "model.init=pretrained", "model.path={hf_empty_config}", expect="config.json"),
    cli("model.path: config.json cut mid-JSON", "model.init=pretrained", "model.path={hf_bad_json}", expect="config.json",
        extra=True),
    cli("model.path: no tokenizer.json, workload.source=text", "model.init=pretrained", "model.path={hf}",
        "workload.source=text", expect="tokenizer"),
    cli("model.path: a NaN in a weight", "model.init=pretrained", "model.path={hf_nan}", expect="nan"),
    cli("model.path: model.safetensors cut in half", "model.init=pretrained", "model.path={hf_truncated}",
        expect="model.safetensors"),
    cli("model.path: a .gguf of garbage bytes", "model.init=pretrained", "model.path={garbage_gguf}",
        expect="garbage.gguf"),
    cli("model.path: a valid tiny HF folder (control)", "model.init=pretrained", "model.path={hf}", want="ok"),
    cli("trace: arrival=trace, no trace_path", *TRACE, expect="trace_path"),
    cli("trace: the file is missing", *TRACE, "workload.trace_path={w}/missing.jsonl", expect="missing.jsonl"),
    cli("trace: an empty file", *TRACE, "workload.trace_path={trace_empty}", expect="empty.jsonl"),
    cli("trace: not UTF-8", *TRACE, "workload.trace_path={trace_latin1}", expect="latin1.jsonl"),
    cli("trace: malformed JSON on line 3", *TRACE, "workload.trace_path={trace_line3}", expect="line 3"),
    cli("trace: Unix-epoch arrival times (1.76e9 s)", *TRACE, "workload.trace_path={trace_epoch}",
        expect="arrival_time", want="either", timeout=60),
    cli("trace: a negative prompt_len", *TRACE, "workload.trace_path={trace_negative}", expect="prompt_len"),
    cli("trace: prompt_len 10^9 (past max_seq_len)", *TRACE, "workload.trace_path={trace_huge}", expect="prompt_len",
        timeout=60),
    cli("trace: a folder as trace_path", *TRACE, "workload.trace_path={empty_trace}", expect="empty_trace", extra=True),
    cli("trace: a valid trace (control)", *TRACE, "workload.trace_path={trace_ok}", want="ok"),
    cli("results_dir read-only", "results_dir={results_ro}", expect="results_ro"),
    cli("results_dir is a regular file", "results_dir={a_file}", expect="a_file"),
    cli("results_dir under /dev/null", "results_dir=/dev/null/results", expect="/dev/null", extra=True),
    tool("compare: a failed run folder", "-m", "ablate", "compare", "{good}", "{failed_run}", expect="failed_run"),
    tool("compare: a corrupt run folder", "-m", "ablate", "compare", "{good}", "{corrupt_run}", expect="corrupt_run"),
    tool("compare: a nonexistent path", "-m", "ablate", "compare", "{good}", "/nonexistent/run", expect="/nonexistent/run"),
    tool("compare: one folder only", "-m", "ablate", "compare", "{good}", expect="run_b", extra=True),
    tool("compare: a run with itself (control)", "-m", "ablate", "compare", "{good}", "{good}", want="ok"),
    tool("collect: an empty folder", "-m", "ablate", "collect", "{empty_collect}", expect="empty_collect"),
    tool("collect: a nonexistent path", "-m", "ablate", "collect", "/nonexistent/sweep", expect="/nonexistent/sweep",
         extra=True),
    tool("report: a truncated summary.csv", "-m", "ablate.report", "{truncated_summary}", expect="summary.csv"),
    tool("report: a nonexistent path", "-m", "ablate.report", "/nonexistent/results", expect="/nonexistent/results",
         extra=True),
    tool("report: an empty folder", "-m", "ablate.report", "{empty_report}", expect="empty_report"),
    sweep("sweep: one job with workload.rate=nan", "workload.arrival=poisson", "workload.rate=1,nan",
          expect="workload.rate"),
    sweep("sweep: one job with kv_cache=nonesuch", "kv_cache=contiguous,nonesuch", expect="nonesuch", check=None,
          extra=True),
    sweep("sweep: a plugin calls sys.exit(3) in a job", "kv_cache=exits_in_init,contiguous", patch="plugins",
          expect="exits_in_init", want="either", check=arm_failed),
    sweep("sweep: a plugin raises in __init__ in a job", "kv_cache=raises_in_init,contiguous", patch="plugins",
          expect="raises_in_init", want="either", check=arm_failed),
    patched("a plugin raises in __init__", "plugins", "kv_cache=raises_in_init", expect="raises_in_init",
            want="either", check=arm_failed),
    patched("a plugin calls sys.exit(3)", "plugins", "kv_cache=exits_in_init", expect="exits_in_init",
            want="either", check=arm_failed),
    *[patched(f"{sig.name} midway (after round 1 was persisted)", "pinned", *SLOW, timeout=180,
              fault=kill_then_rerun(sig))
      for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL)],
    patched("a failure after measuring (the summary raises)", "summary_fails+pinned", expect="injected", min_rounds=3,
            timeout=120, fault=inject_then_rerun),
    patched("disk full at round 2 (injected ENOSPC)", "disk_full_after_4+pinned", expect="No space left", min_rounds=1,
            timeout=120, fault=inject_then_rerun),
    patched("disk full at the first write (injected ENOSPC)", "disk_full_after_0", expect="No space left"),
    patched("disk full: a real 4 MiB tmpfs filled after round 1", "pinned", *SLOW, "results_dir={w}/mnt", expect="No space left",
        timeout=180, fault=full_tmpfs),
    patched("two processes run one config at once", "pinned", *SLOW, expect="{w}/results", timeout=180, fault=two_at_once),
    *[Case(f"block manager: {name}", [THIS, "--internal", name], expect=expect, timeout=30)
      for name, (_, expect) in BLOCK_MANAGER.items()],
    Case("block manager: stale prefix cache after truncate+rewrite", [THIS, "--internal", "stale prefix cache"],
         want="ok", timeout=30),
    # -- issue 26 ------------------------------------------------------------------------------------------
    # 1. a result is reused only while what it measured is unchanged
    patched("26.1 checkpoint replaced after a finished run", "pinned", "model.init=pretrained", "model.path={w}/ckpt", timeout=120,
            fault=reuse_after_change(copy_checkpoint, replace_checkpoint)),
    patched("26.1 checkpoint replaced after SIGKILL midway", "pinned", *SLOW, "model.init=pretrained", "model.path={w}/ckpt", timeout=180,
            fault=reuse_after_change(copy_checkpoint, replace_checkpoint, kill=True)),
    patched("26.1 third-party plugin source edited after a finished run", "pinned", "kv_cache=third_party",
            env={"PYTHONPATH": "{w}/site"}, timeout=120, fault=reuse_after_change(copy_site, edit_plugin)),
    patched("26.1 third-party plugin source edited after SIGKILL midway", "pinned", *SLOW, "kv_cache=third_party",
            env={"PYTHONPATH": "{w}/site"}, timeout=180, fault=reuse_after_change(copy_site, edit_plugin, kill=True),
            extra=True),
    patched("26.1 nothing changed after a finished run (control)", "pinned", "model.init=pretrained", "model.path={w}/ckpt", timeout=120,
            fault=reuse_after_change(copy_checkpoint, None)),
    patched("26.1 nothing changed after SIGKILL midway (control)", "pinned", *SLOW, "kv_cache=third_party",
            env={"PYTHONPATH": "{w}/site"}, timeout=180, fault=reuse_after_change(copy_site, None, kill=True),
            extra=True),
    # 2. booleans are booleans
    num("redo", "no"), num("redo", "1", extra=True), num("experiment.recorder", "off", extra=True),
    cli("kv_cache.prefix_caching=no kv_cache=paged (typed: read as false)", "kv_cache=paged",
        "kv_cache.prefix_caching=no", want="either", expect="prefix_caching", extra=True),
    # 3. a grid value given twice
    cli("+experiment.grid.output_len=[4,4]", "+experiment.grid.output_len=[4,4]", expect="output_len", check=no_round),
    cli("+experiment.grid.output_len=[4,8,4.0]", "+experiment.grid.output_len=[4,8,4.0]", expect="output_len",
        extra=True),
    # 4. a plugin package that calls sys.exit(0) when imported
    tool("26.4 plugins: a package calls sys.exit(0) at import", "-m", "ablate", "plugins", want="ok",
         env={"PYTHONPATH": "{exits_at_import}"}, check=names_the_package("exits_at_import"), timeout=60),
    cli("26.4 a run with a package that calls sys.exit(0) at import", env={"PYTHONPATH": "{exits_at_import}"},
        want="ok", check=names_the_package("exits_at_import")),
    cli("26.4 kv_cache=exits_at_import (the package exits at import)", "kv_cache=exits_at_import",
        env={"PYTHONPATH": "{exits_at_import}"}, expect="exits_at_import", extra=True),
    # 5. two packages supplying one plugin name
    cli("26.5 kv_cache=contiguous supplied by two packages", "kv_cache=contiguous",
        env={"PYTHONPATH": "{duplicate_name}"}, expect="ambiguous"),
    cli("26.5 a run not choosing the twice-supplied plugin (control)", env={"PYTHONPATH": "{duplicate_name}"},
        want="ok", extra=True),
    # 6. the cached native library emptied or truncated: rebuilt, or refused with a message
    cli("26.6 cached native library emptied", "kv_cache=paged", "attention=paged",
        env={"ABLATE_CACHE_DIR": "{native_empty}"}, want="ok", timeout=180),
    cli("26.6 cached native library truncated", "kv_cache=paged", "attention=paged",
        env={"ABLATE_CACHE_DIR": "{native_truncated}"}, want="ok", timeout=180),
    # 7. a workload too large to be meant
    num("workload.num_requests", "10000000", timeout=60),
    cli("+experiment.grid.num_requests=[2,10000000]", "+experiment.grid.num_requests=[2,10000000]",
        expect="num_requests", timeout=60, extra=True),
    num("workload.num_requests", "100000", "workload.prompt_len=1000", timeout=60, extra=True),
    # 8. values of the wrong kind name their option
    num("threads", "abc"), num("threads", "true"), num("threads", "2.5", extra=True),
    num("peak_bandwidth", "abc"), num("peak_flops", "true", extra=True),
    num("experiment.repeats", "3.7", check=lambda d, w: "a run folder was made" if (w / "results").exists() else None),
    num("experiment.warmup", "abc", extra=True),
    num("results_dir", "null"), num("device", "null"), num("results_dir", "true", want="either", extra=True),
    num("engine.max_seq_len", "4", check=no_round), num("engine.max_seq_len", "8", extra=True),
    cli("results_dir=${oops}", "results_dir=${{oops}}", expect="oops"),
    cli("experiment.name=${model.nonesuch}", "experiment.name=${{model.nonesuch}}", expect="nonesuch", extra=True),
    cli("experiment.name=café (non-ASCII, unquoted)", "experiment.name=café", expect="quote"),
    cli("experiment.name='café' (quoted: control)", "experiment.name='café'", want="ok", extra=True),
    tool("collect: a run whose config.json is a list", "-m", "ablate", "collect", "{list_config}",
         expect="not a JSON object"),
    Case("sweep: -m after the overrides", ["-m", "ablate", *QUICK, "-m", "kv_cache=none,contiguous"], want="ok",
         timeout=180, check=other_job_done),
    cli("model=tiny,nonesuch (a sweep without -m)", "model=tiny,nonesuch", expect="-m"),
    sweep("sweep: model=tiny,nonesuch", "model=tiny,nonesuch", expect="nonesuch", want="either", extra=True),
    # 9. a sweep's job killed by a signal fails alone
    sweep("26.9 sweep: a job SIGKILLed (basic launcher)", "kv_cache=sigkill,contiguous", want="either",
          expect="sigkill", env={"PYTHONPATH": "{sigkill_plugin}"}, check=job_failed_alone, timeout=240),
    sweep("26.9 sweep: a job SIGKILLed (joblib launcher)", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
          "kv_cache=sigkill,contiguous", want="either", expect="sigkill", env={"PYTHONPATH": "{sigkill_plugin}"},
          check=job_failed_alone, timeout=240),
    # 10. an outside engine crashing natively fails its arm only
    cli("26.10 an outside engine segfaults (SIGSEGV in serve)", "+experiment.arms.base={{}}",
        "+experiment.arms.crash.engine.name=segv", env={"PYTHONPATH": "{segv_engine}"}, want="either",
        expect="segv", check=other_arm_measured, timeout=180),
    # 11. the static scheduler within max_num_batched_tokens; a failed baseline is a failed run
    cli("workload.prompt_len=513 workload.num_requests=8", "workload.prompt_len=513", "workload.num_requests=8",
        "workload.output_len=2", "experiment.repeats=1", want="ok", timeout=240),
    cli("workload.prompt_len=300 workload.num_requests=16 max_num_batched_tokens=1024", "workload.prompt_len=300",
        "workload.num_requests=16", "engine.max_num_batched_tokens=1024", "workload.output_len=2",
        "experiment.repeats=1", want="ok", timeout=240, extra=True),
    patched("26.11 the baseline arm fails (raises in __init__)", "plugins",
            "+experiment.arms.base.kv_cache=raises_in_init", "+experiment.arms.other={{}}", expect="raises_in_init"),
]


# -- the battery ----------------------------------------------------------------------------------------

def print_table(rows: list[Row]) -> None:
    width = min(max(len(r.name) for r in rows), 56)
    print(f"\n{'#':>3}  {'input':<{width}}  {'outcome':<11}  {'lost':<4}  message (first line)")
    for i, r in enumerate(rows, 1):
        print(f"{i:>3}  {r.name[:width]:<{width}}  {r.outcome:<11}  {r.lost:<4}  {r.message[:120]}")
    counts = {k: sum(r.outcome == k for r in rows) for k in sorted({r.outcome for r in rows})}
    print(f"\n{len(rows)} rows: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + f"; data lost in {sum(r.lost == 'YES' for r in rows)}")


def main() -> None:
    if sys.argv[1:2] == ["--internal"]:          # one in-process case (see internal)
        internal(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="run only the cases whose name contains this substring (extras included)")
    parser.add_argument("--all", action="store_true", help="also the extra cases: more values of options covered")
    parser.add_argument("--jobs", type=int, default=2, help="cases run at once")
    parser.add_argument("--out", help="write every row (with the end of its output) as JSON here")
    parser.add_argument("--work-dir", help="where cases and fixtures run (default: a new temporary folder)")
    args = parser.parse_args()
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:    # started in the background by a shell: the
        signal.signal(signal.SIGINT, signal.default_int_handler)   # cases' runs must not inherit that
    cases = [c for c in CASES if args.only.lower() in c.name.lower()] if args.only else \
        [c for c in CASES if args.all or not c.extra]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bad-inputs-")).resolve()
    fixtures = Fixtures(work / "fixtures")
    print(f"{len(cases)} cases, {args.jobs} at a time, in {work}", flush=True)
    lock, finished = threading.Lock(), []

    def one(indexed: tuple[int, Case]) -> list[Row]:
        rows = run_case(indexed[1], work / f"case{indexed[0]:03d}", fixtures)
        with lock:
            finished.extend(rows)
            for r in rows:
                print(f"[{len(finished):>3}] {r.outcome:<11} {r.seconds:>5.1f} s  {r.name}", file=sys.stderr, flush=True)
        return rows

    started = time.monotonic()
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            rows = [r for rs in pool.map(one, enumerate(cases)) for r in rs]
    finally:
        fixtures.cleanup()
    print_table(rows)
    print(f"{time.monotonic() - started:.0f} s; every case's files under {work}")
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    sys.exit(1 if any(r.outcome in FAILING or r.lost == "YES" for r in rows) else 0)


if __name__ == "__main__":
    main()
