"""Bad inputs (issue 13): each is one message that names the option or the file, what is wrong and
what would be right; none hangs, none gives a silently wrong result."""
from __future__ import annotations

import json
import logging
import math
import re
import typing

import pandas as pd
import pytest
import torch

from ablate.api.context import EngineConfig
from ablate.api.sequence import Request, SamplingParams
from ablate.checkpoints import loader
from ablate.checkpoints.hf import CheckpointError, hf_model_fields
from ablate.engine.engine import MAX_IDLE_WAIT_S
from ablate.engine.runner import NonFiniteLogits
from ablate.experiment.config import to_run_config
from ablate.experiment.quality_guard import QualityConfig
from ablate.model.config import ModelConfig
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.report.compare import RunUnreadable, compare
from ablate.report.compare import main as compare_main
from ablate.report.page import main as report_main
from ablate.results import RunFolder
from ablate.workload.requests import WorkloadConfig
from ablate.workload.trace import read_trace

NAN, INF = float("nan"), float("inf")
HF_CONFIG = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=96, vocab_size=320, max_position_embeddings=128)


# -- 1. model.path means: load it ------------------------------------------------------------------

def test_a_model_path_loads_the_checkpoint_unless_init_says_random(tmp_path, compose_config, registry):
    raw = compose_config(tmp_path, "model=tiny", f"model.path={tmp_path / 'ckpt'}")
    assert to_run_config(raw, registry).model.init == "pretrained"
    assert to_run_config(compose_config(tmp_path, "model=tiny"), registry).model.init == "random"
    # the smollm2 preset loads its package; model.init=random keeps its shape and tokenizer
    assert to_run_config(compose_config(tmp_path, "model=smollm2-135m"), registry).model.init == "pretrained"
    raw = compose_config(tmp_path, "model=smollm2-135m", "model.init=random")
    assert to_run_config(raw, registry).model.init == "random"
    raw = compose_config(tmp_path, "model=tiny", "model.init=random", f"model.path={tmp_path / 'ckpt'}")
    with pytest.raises(ValueError, match=r"model.init=random ignores the weights at model.path=.*ckpt"):
        to_run_config(raw, registry)


# -- 2. finite numbers in range --------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("workload.rate=nan", "workload.rate must be a finite number > 0 (requests per second), got nan"),
    ("workload.rate=inf", "workload.rate must be a finite number > 0 (requests per second), got inf"),
    ("workload.burstiness=nan", "workload.burstiness must be a finite number > 0"),
    ("workload.textbook_arrival_s=nan", "workload.textbook_arrival_s must be a finite number >= 0"),
    ("workload.output_sigma=nan", "workload.output_sigma must be a finite number >= 0"),
    ("workload.temperature=nan", "workload.temperature must be a finite number >= 0"),
    ("workload.top_p=nan", "workload.top_p must be a finite number > 0 and <= 1"),
    ("workload.seed=-1", "workload.seed must be >= 0, got -1"),
    ("workload.num_requests=2.5", "workload.num_requests must be a whole number >= 1, got 2.5"),
    ("engine.max_num_seqs=2.5", "engine.max_num_seqs must be a whole number >= 1, got 2.5"),
    ("engine.max_seq_len=-3", "engine.max_seq_len must be >= 0, got -3"),
    ("model.norm_eps=nan", "model.norm_eps must be a finite number > 0, got nan"),
    ("model.rope_base=inf", "model.rope_base must be a finite number > 0, got inf"),
    ("model.dtype=fp8", "model.dtype must be one of"),
    ("model.seed=-1", "model.seed must be >= 0, got -1"),
])
def test_non_finite_or_out_of_range_options_are_named(tmp_path, compose_config, registry, override, message):
    raw = compose_config(tmp_path, "model=tiny", override)
    with pytest.raises(ValueError) as err:
        to_run_config(raw, registry)
    assert message in str(err.value)


@pytest.mark.parametrize("fields, message", [
    ({"temperature": NAN}, "temperature must be a finite number >= 0 (0: greedy), got nan"),
    ({"temperature": INF}, "temperature must be a finite number >= 0 (0: greedy), got inf"),
    ({"top_p": NAN}, "top_p must be a number in (0, 1] (1: off), got nan"),
    ({"seed": -1}, "seed must be a whole number >= 0, got -1"),
])
def test_sampling_params_refuse_non_finite_values(fields, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**fields)
    assert message in str(err.value)


def test_model_config_refuses_a_non_finite_rope_scaling():
    with pytest.raises(ValueError, match=r"model.rope_llama3_scaling.factor must be a finite number > 0, got nan"):
        ModelConfig(rope_llama3_scaling={"factor": NAN})


# -- 3. traces and waits ---------------------------------------------------------------------------

def write_trace(tmp_path, lines: list[str] | bytes):
    path = tmp_path / "trace.jsonl"
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        path.write_text("\n".join(lines) + "\n")
    return path


def line(arrival: float, **extra) -> str:
    return json.dumps({"arrival_time": arrival, "prompt_len": 4, "output_len": 2, **extra})


def test_trace_arrival_times_are_relative_to_the_first(tmp_path):
    path = write_trace(tmp_path, [line(1.76e9), line(1.76e9 + 0.5), line(1.76e9 + 2)])
    assert [e.arrival_time for e in read_trace(path)] == [0.0, 0.5, 2.0]


def test_a_trace_spanning_more_than_a_day_names_the_file_and_line(tmp_path):
    path = write_trace(tmp_path, [line(0), line(10), line(200_000)])
    with pytest.raises(ValueError, match=rf"^{path}, line 3, field 'arrival_time': 200000 is 200000 s after .*\(a day\)"):
        read_trace(path)


def test_a_trace_that_is_not_utf8_names_the_line_and_byte(tmp_path):
    data = (line(0) + "\n").encode() + b'{"arrival_time": 1, "prompt": "caf\xe9", "output_len": 2}\n'
    path = write_trace(tmp_path, data)
    offset = len(line(0)) + 1 + data.split(b"\n")[1].index(b"\xe9")
    with pytest.raises(ValueError, match=rf"^{path}, line 2: not UTF-8 text \(byte 0xe9 at byte offset {offset} "):
        read_trace(path)


def test_a_trace_line_cut_short_is_described_not_given_a_wrong_column(tmp_path):
    path = write_trace(tmp_path, [line(0), '{"arrival_time": 0.5, "prompt_len": 4, "output_len": 3'])
    with pytest.raises(ValueError) as err:
        read_trace(path)
    assert str(err.value).startswith(f"{path}, line 2: not valid JSON: the line ends before its JSON value does")
    assert "column 1" not in str(err.value)
    with pytest.raises(ValueError, match=rf"^{tmp_path / 'none.jsonl'}: the trace file does not exist"):
        read_trace(tmp_path / "none.jsonl")


def test_the_engine_never_idles_longer_than_its_bound(build):
    far = MAX_IDLE_WAIT_S + 1
    requests = [Request(0, (1, 2), 1, arrival_time=10.0), Request(1, (1, 2), 1, arrival_time=10.0 + far)]
    with pytest.raises(ValueError, match=r"request 1 arrives .* after the one before .*not Unix times"):
        build({}).engine.run(requests)


# -- 4. Hugging Face checkpoint files --------------------------------------------------------------

def hf_dir(tmp_path, config: dict | str | None = HF_CONFIG):
    directory = tmp_path / "ckpt"
    directory.mkdir(exist_ok=True)
    if config is not None:
        (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return directory


@pytest.mark.parametrize("config, message", [
    ({k: v for k, v in HF_CONFIG.items() if k not in ("hidden_size", "intermediate_size")},
     "config.json: missing hidden_size, intermediate_size"),
    ("", "config.json: the file is empty"),
    ('{"model_type": "llama", ', "config.json: not valid JSON"),
    ({**HF_CONFIG, "hidden_size": "64"}, "config.json: hidden_size must be a whole number > 0, got '64'"),
    ({**HF_CONFIG, "rms_norm_eps": "tiny"}, "config.json: rms_norm_eps must be a finite number > 0, got 'tiny'"),
])
def test_a_bad_config_json_names_the_file_and_the_keys(tmp_path, config, message):
    directory = hf_dir(tmp_path, config)
    with pytest.raises(CheckpointError) as err:
        hf_model_fields(directory)
    assert str(err.value).startswith(str(directory / "config.json")) and message in str(err.value)


def test_a_checkpoint_without_tokenizer_json_names_the_folder(tmp_path):
    directory = hf_dir(tmp_path)
    with pytest.raises(loader.TokenizerNotFound, match=rf"^{directory}: the Hugging Face checkpoint has no "
                                                         r"tokenizer.json"):
        loader.load_tokenizer(ModelConfig(path=str(directory)))


# -- 5. NaN weights and logits ---------------------------------------------------------------------

def test_nan_weights_in_a_safetensors_checkpoint_name_the_file_and_tensor(tmp_path):
    from safetensors.torch import save_file

    directory = hf_dir(tmp_path)
    weights = torch.ones(320, 64)
    weights[3, 5] = NAN
    save_file({"model.embed_tokens.weight": weights}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"^{directory / 'model.safetensors'}: tensor "
                                              r"'model.embed_tokens.weight' holds 1 NaN or infinite value"):
        loader.load_model(ModelConfig(path=str(directory)))


def test_non_finite_logits_in_the_first_step_name_the_model(build, make_requests):
    model = LlamaModel.random(preset("tiny"))
    with torch.no_grad():
        model.embed.weight[:] = INF
    with pytest.raises(NonFiniteLogits, match=r"model 'tiny' \(fp32\) gave non-finite logits"):
        build({}, model=model).engine.run(make_requests([4, 3], 2))
    # a sound model runs as before, and its engine checks once
    built = build({})
    assert all(s.is_finished for s in built.engine.run(make_requests([4, 3], 2)))
    assert built.engine.runner.logits_checked


# -- 6. fp16 on a CPU ------------------------------------------------------------------------------

def test_fp16_on_a_cpu_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(loader, "_warned_fp16_cpu", False)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        loader.load_model(preset("tiny", dtype="fp16"), "cpu")
        loader.load_model(preset("tiny", dtype="fp16"), "cpu")
        loader.load_model(preset("tiny", dtype="bf16"), "cpu")
    warned = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    assert len(warned) == 1 and "fp16 on the CPU" in warned[0] and "model.dtype=bf16" in warned[0]
    assert "\n" not in warned[0]


# -- 7. messages: plugins, compare, report ---------------------------------------------------------

def test_a_blocked_plugin_says_it_is_blocked_by_the_environment(tmp_path, monkeypatch, compose_config, registry):
    from ablate.engine.config_store import register_configs
    from ablate.engine.registry import discover

    monkeypatch.setenv("ABLATE_BLOCK_PLUGINS", "kv_cache.paged")
    blocked = discover()
    try:
        register_configs(blocked)
        raw = compose_config(tmp_path, "model=tiny", "kv_cache=paged")
        with pytest.raises(ValueError, match=r"unknown kv_cache plugin 'paged'.*is blocked\): the environment "
                                             r"variable ABLATE_BLOCK_PLUGINS=kv_cache.paged blocks it"):
            to_run_config(raw, blocked)
    finally:
        register_configs(registry)      # the real node back, for the other tests


def test_an_unknown_plugin_option_lists_the_valid_ones(registry):
    from ablate.api.plugin import Slot
    from ablate.engine.config_store import unknown_option

    with pytest.raises(ValueError, match=r"kv_cache=paged has no option blok_size; its options are: .*block_size"):
        registry.config(Slot.KV_CACHE, "paged", {"blok_size": 4})
    # before Hydra composes (whose own message says only "Could not override"), for the CLI
    message = unknown_option(registry, ["model=tiny", "kv_cache=paged", "kv_cache.blok_size=4"])
    assert message.startswith("kv_cache=paged has no option blok_size; its options are: ") and "block_size" in message
    assert unknown_option(registry, ["kv_cache=paged", "kv_cache.block_size=4", "workload.rate=2"]) is None
    # the plugin an experiment file picks, and each plugin of a sweep
    assert unknown_option(registry, ["+experiment=ch13_gqa_mla", "kv_cache.blok_size=4"]).startswith(
        "kv_cache=contiguous has no option blok_size")
    assert "kv_cache=contiguous has no option block_size" in unknown_option(
        registry, ["kv_cache=paged,contiguous", "kv_cache.block_size=16"])


def finished(tmp_path, name: str, *, status: str = "done", runs: pd.DataFrame | None = None) -> RunFolder:
    folder = RunFolder(tmp_path / name)
    folder.start({"experiment": {"name": "exp"}}, {"device": "cpu"})
    if runs is not None:
        folder.write_table("runs", runs)
    folder.finish(status, error="RuntimeError: out of memory" if status != "done" else None)
    return folder


def test_compare_on_a_failed_run_names_the_folder(tmp_path):
    runs = pd.DataFrame({"arm": ["a", "a", "a"], "repeat": [0, 1, 2], "duration_s": [1.0, 1.1, 0.9]})
    good, failed = finished(tmp_path, "good", runs=runs), finished(tmp_path, "failed", status="failed")
    with pytest.raises(RunUnreadable, match=rf"^{failed.path}: no runs to compare: the run failed \(failed: "
                                            r"RuntimeError: out of memory\)"):
        compare(good.path, failed.path)
    (good.path / "config.json").write_text('{"experiment": ')
    with pytest.raises(SystemExit, match=rf"error: {good.path / 'config.json'}: missing, truncated or not valid JSON"):
        compare_main([str(good.path), str(failed.path)])


def test_report_on_a_truncated_summary_says_so(tmp_path, capsys):
    runs = pd.DataFrame({"arm": ["a"], "repeat": [0], "duration_s": [1.0]})
    folder = finished(tmp_path, "run", runs=runs)
    (folder.path / "summary.csv").write_text("arm,speed")       # cut short in its header
    with pytest.raises(SystemExit, match=r"1 of 1 runs could not be reported: .*summary.csv: truncated or empty"):
        report_main([str(tmp_path)])
    assert "not an experiment run" not in capsys.readouterr().out


def test_finite_helpers_accept_numpy_numbers():
    import numpy as np

    cfg = WorkloadConfig(num_requests=np.int64(3), rate=np.float64(2.0), seed=np.int64(1))
    assert cfg.num_requests == 3 and math.isclose(cfg.rate, 2.0)
    assert EngineConfig(max_num_seqs=np.int64(2)).max_num_seqs == 2


# -- 6. a value of the wrong kind names its option (issue 26) -------------------------------------------

def bool_options(registry) -> list[str]:
    """Every bool option of the typed config, the plugins' included (found, not listed by hand)."""
    from ablate.experiment.config import SECTIONS, TOP_LEVEL, RunConfig
    hints = typing.get_type_hints(RunConfig)
    options = [k for k in TOP_LEVEL if hints[k] is bool]
    for section in SECTIONS:
        cls = next(a for a in typing.get_args(hints[section]) or (hints[section],) if a is not type(None))
        options += [f"{section}.{name}" for name, kind in typing.get_type_hints(cls).items() if kind is bool]
    options += [f"experiment.quality.{name}" for name, kind in typing.get_type_hints(QualityConfig).items()
                if kind is bool]
    for (slot, name), cls in registry.plugins.items():
        options += [f"{slot.value}={name} {slot.value}.{field}"
                    for field, kind in typing.get_type_hints(cls.config_class).items() if kind is bool]
    return options


def test_every_bool_option_refuses_a_value_that_is_not_true_or_false(tmp_path, compose_config, registry):
    options = bool_options(registry)
    assert {"redo", "experiment.recorder", "experiment.quality.enabled", "engine.graphs"} <= set(options)
    for option in options:
        *choice, key = option.split()
        raw = compose_config(tmp_path, "model=tiny", *choice)
        if key.split(".")[0] in ("costs", "book"):
            raw[key.split(".")[0]] = {}
        _set(raw, key, "no")          # as YAML leaves it (a typed node of a plugin's config converts `no` itself)
        with pytest.raises(ValueError, match=rf"^{re.escape(key)} must be true or false.*got 'no'$"):
            to_run_config(raw, registry)


def _set(raw: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        raw = raw.setdefault(part, {})
    raw[last] = value


def test_an_ablation_bool_is_a_bool(tmp_path, compose_config, registry):
    raw = compose_config(tmp_path, "model=tiny")
    raw["experiment"]["ablation"] = {"techniques": {"cache": {"overrides": {"kv_cache": "contiguous"}}}, "pairs": "no"}
    with pytest.raises(ValueError, match=r"^experiment.ablation.pairs must be true or false"):
        to_run_config(raw, registry)


@pytest.mark.parametrize("override, message", [
    ("threads=abc", "threads must be a whole number (default 0), got 'abc'"),
    ("threads=true", "threads must be a whole number (default 0), got true"),
    ("peak_bandwidth=abc", "peak_bandwidth must be a number (default 0.0), got 'abc'"),
    ("peak_flops=true", "peak_flops must be a number (default 0.0), got true"),
    ("experiment.repeats=3.7", "experiment.repeats must be a whole number (default 5), got 3.7"),
    ("experiment.warmup=abc", "experiment.warmup must be a whole number (default 1), got 'abc'"),
    ("experiment.ci_target=abc", "experiment.ci_target must be a number (default 0.05), got 'abc'"),
    ("results_dir=null", "results_dir must be a string (default 'results'), got null"),
    ("device=null", "device must be a string (default 'auto'), got null"),
    ("wandb.init_timeout=abc", "wandb.init_timeout must be a number (default 30.0), got 'abc'"),
    ("engine.max_num_seqs=true", "engine.max_num_seqs must be a whole number"),
])
def test_a_value_of_the_wrong_kind_names_its_option(tmp_path, compose_config, registry, override, message):
    raw = compose_config(tmp_path, "model=tiny", override)
    with pytest.raises(ValueError) as err:
        to_run_config(raw, registry)
    assert message in str(err.value)


def test_a_str_option_takes_a_number(tmp_path, compose_config, registry):
    """`book section=7.3` arrives as a float: a str field takes numbers, only null is refused."""
    raw = compose_config(tmp_path, "model=tiny", "experiment.chapter=8")
    assert to_run_config(raw, registry).experiment.chapter == 8


@pytest.mark.parametrize("grid", ["[4,4]", "[4,8,4.0]", "[a,b,a]"])
def test_a_grid_value_given_twice_is_refused(tmp_path, compose_config, registry, grid):
    raw = compose_config(tmp_path, "model=tiny", f"+experiment.grid.output_len={grid}")
    with pytest.raises(ValueError, match=r"experiment.grid.output_len lists .* more than once"):
        to_run_config(raw, registry)


@pytest.mark.parametrize("overrides, limit", [
    (["workload.num_requests=10000000"], None),
    (["workload.num_requests=100000", "workload.prompt_len=1000"], None),
    (["+experiment.grid.num_requests=[2,10000000]"], None),
    (["workload.num_requests=1000"], "1000"),
])
def test_a_workload_too_large_to_be_meant_is_refused_naming_the_limit(tmp_path, compose_config, registry,
                                                                      monkeypatch, overrides, limit):
    if limit:
        monkeypatch.setenv("ABLATE_MAX_RUN_TOKENS", limit)
    raw = compose_config(tmp_path, "model=tiny", *overrides)
    with pytest.raises(ValueError, match=r"workload.num_requests=.* tokens per arm's run, above the limit of "
                                         r".*ABLATE_MAX_RUN_TOKENS"):
        to_run_config(raw, registry)
    monkeypatch.setenv("ABLATE_MAX_RUN_TOKENS", "1e12")             # a large run that is meant: allowed
    assert to_run_config(raw, registry)


@pytest.mark.parametrize("overrides", [["engine.max_seq_len=4"], ["engine.max_seq_len=32", "workload.prompt_len=32"],
                                       ["engine.max_seq_len=40", "+experiment.grid.prompt_len=[8,64]"]])
def test_an_engine_max_seq_len_below_the_prompt_is_refused_naming_it(tmp_path, compose_config, registry, overrides):
    raw = compose_config(tmp_path, "model=tiny", "workload.prompt_len=8", *overrides)
    with pytest.raises(ValueError, match=r"^engine.max_seq_len=\d+ cannot hold the longest prompt"):
        to_run_config(raw, registry)
