"""Outside engines (ablate.outside): transformers' generate on ablate's own weights gives ablate's greedy
tokens and a consistent timeline; the one-batch-at-a-time driver keeps arrivals, batch limits and closed
loops and cuts what an engine emits by ablate's rule; options, the registry and arm specs refuse what
they cannot run, naming what is allowed."""
from __future__ import annotations

import importlib.util
import time
from dataclasses import replace

import pytest
import torch

from ablate.api.sequence import Request
from ablate.engine.arm import ArmSpec, baseline_configs
from ablate.outside.arms import resolve_arm
from ablate.outside.batches import OneBatchAtATime
from ablate.outside.contract import OutsideEngineError
from ablate.outside.hf import HFConfig, HFGenerate, hf_state_dict
from ablate.outside.discovery import load_engine
from ablate.outside.timeline import Timeline
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel

needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                              reason='engine=hf needs transformers: pip install -e ".[hf]"')

PROMPT_LENS = [5, 12, 9]      # one batch of different lengths: transformers left-pads the shorter prompts
NEW_TOKENS = 8


# -- engine=hf ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tied", [False, True])
def test_hf_state_dict_round_trips_to_identical_parameters(tied):
    model = LlamaModel.random(preset("tiny", tied_embeddings=tied))
    tensors = hf_state_dict(model)
    c = model.config
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (c.n_heads * c.head_dim, c.d_model)
    assert tensors["model.layers.1.self_attn.v_proj.weight"].shape == (c.n_kv_heads * c.head_dim, c.d_model)
    assert tensors["model.layers.1.mlp.up_proj.weight"].shape == (c.d_ff, c.d_model)
    back = LlamaModel.from_hf_state_dict(model.config, tensors)
    ours, theirs = dict(model.named_parameters()), dict(back.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert torch.equal(param, theirs[name]), name


@pytest.fixture(scope="module")
def greedy(build, make_requests) -> tuple[list[Request], dict[int, list[int]]]:
    """Three requests of different prompt lengths and ablate's own greedy tokens for them."""
    requests = make_requests(PROMPT_LENS, NEW_TOKENS)
    seqs = build({}).engine.run(requests)
    return requests, {s.seq_id: s.output_token_ids for s in seqs}


def hf_engine(model: LlamaModel, max_batch: int = 8, **options) -> HFGenerate:
    return HFGenerate(HFGenerate.resolve_options("test.engine", options), model, max_batch)


@needs_hf
@pytest.mark.parametrize("options", [{"cache": "dynamic"}, {"cache": "static"}, {"prompt_lookup": 3}],
                         ids=["dynamic", "static", "prompt_lookup"])
def test_hf_gives_ablates_greedy_tokens_with_a_consistent_timeline(options, tiny_model, greedy):
    requests, reference = greedy
    assert len({tuple(t) for t in reference.values()}) == len(requests)     # the reference is no constant
    engine = hf_engine(tiny_model, **options)
    timeline = Timeline()
    outputs = engine.serve(requests, timeline)
    assert outputs == reference
    records = [timeline.requests[r.request_id] for r in requests]
    for record in records:
        assert record.arrival <= record.first_scheduled <= record.emissions[0][0] <= record.finish
        assert [t for t, _ in record.emissions] == sorted(t for t, _ in record.emissions)
        assert sum(n for _, n in record.emissions) == NEW_TOKENS
        assert record.finish_reason == "length"
    if options.get("prompt_lookup"):        # transformers' assisted decoding: one request per generate()
        for before, after in zip(records, records[1:]):
            assert after.first_scheduled >= before.finish
    else:                                   # one static batch
        assert len({r.first_scheduled for r in records}) == 1


@needs_hf
@pytest.mark.parametrize("options", [{"cache": "dynamic"}, {"prompt_lookup": 3}], ids=["batch", "prompt_lookup"])
def test_a_stop_token_cuts_only_its_own_requests_output(options, tiny_model, build, greedy):
    requests, reference = greedy

    def first_new(tokens: list[int]) -> int:        # a token of `tokens` not seen before it, past the first two
        return next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])

    def cut(tokens: list[int], stops: tuple[int, ...]) -> list[int]:
        return next((tokens[:i + 1] for i, t in enumerate(tokens) if t in stops), tokens)

    # request 0 stops at a token request 1 emits, request 2 at one of its own; request 1 has none: it must
    # run its full length in the same batch, though it emits request 0's stop token
    stops = {0: (first_new(reference[1]),), 1: (), 2: (first_new(reference[2]),)}
    requests = [replace(r, stop_token_ids=stops[r.request_id]) for r in requests]
    expected = {i: cut(reference[i], stops[i]) for i in reference}
    assert expected[1] == reference[1] and stops[0][0] in reference[1] and len(expected[2]) < NEW_TOKENS
    timeline = Timeline()
    outputs = hf_engine(tiny_model, **options).serve(requests, timeline)
    assert outputs == expected
    assert {i: r.finish_reason for i, r in timeline.requests.items()} == {
        i: "stop" if set(expected[i]) & set(stops[i]) else "length" for i in expected}
    ours = build({}).engine.run(requests)             # ablate's engine cuts the same way
    assert {s.seq_id: s.output_token_ids for s in ours} == outputs


@needs_hf
def test_hf_refuses_what_it_cannot_rebuild(tiny_model):
    with pytest.raises(ValueError, match="QKV biases"):
        hf_engine(LlamaModel.random(preset("tiny", qkv_bias=True)))
    with pytest.raises(ValueError, match="prompt_lookup must be >= 0, got -1"):
        hf_engine(tiny_model, prompt_lookup=-1)
    assert HFGenerate.is_exact(HFConfig(cache="static"))
    assert hf_engine(tiny_model, prompt_lookup=2).batch_limit() == 1


@needs_hf
def test_a_model_from_a_hugging_face_directory_runs_in_hf_from_that_directory(build, make_requests, tmp_path):
    """Any architecture ablate reads (here Qwen3's q/k norms, which hf_llama cannot rebuild) is compared
    with transformers running the checkpoint itself."""
    from ablate.checkpoints import load_model
    from ablate.model.config import ModelConfig
    from ablate.testing.hf_models import build_hf, save_hf

    directory = save_hf(build_hf("qwen3"), tmp_path / "qwen3", sharded=False)
    model = load_model(ModelConfig(name="checkpoint", init="pretrained", path=str(directory)))
    requests = make_requests(PROMPT_LENS, NEW_TOKENS)
    ours = {s.seq_id: s.output_token_ids for s in build({"kv_cache": "contiguous"}, model, record=False).engine.run(requests)}
    engine = hf_engine(model)
    assert type(engine.hf).__name__ == "Qwen3ForCausalLM" and str(directory) in engine.describe()["weights"]
    assert engine.serve(requests, Timeline()) == ours


# -- the one-batch-at-a-time driver, with an engine whose tokens are scripted -------------------------

def scripted_token(request: Request, k: int) -> int:
    return request.request_id * 100 + k


class Scripted(OneBatchAtATime):
    """Emits token request_id * 100 + k for k = 0, 1, ...: `chunk` per call and request, `step_s` apart,
    `extra` more calls after every request is done; gives up after `give_up_after` calls."""
    name = "scripted"

    def __init__(self, max_batch: int, step_s: float = 0.0, chunk: int = 1, extra: int = 0,
                 give_up_after: int | None = None) -> None:
        super().__init__({}, None, max_batch)
        self.step_s, self.chunk, self.extra, self.give_up_after = step_s, chunk, extra, give_up_after
        self.batches: list[list[int]] = []

    def generate(self, batch: list[Request], emit) -> None:
        self.batches.append([r.request_id for r in batch])
        calls, extra = 0, self.extra
        while not emit.all_done or extra > 0:
            extra -= emit.all_done
            if self.give_up_after is not None and calls >= self.give_up_after:
                return
            time.sleep(self.step_s)
            for r in batch:
                emit(r.request_id, [scripted_token(r, calls * self.chunk + j) for j in range(self.chunk)])
            calls += 1


def timed(request_id: int, new_tokens: int = 3, **fields) -> Request:
    return Request(request_id, (1, 2, 3), new_tokens, **fields)


def serve(engine: Scripted, requests: list[Request]) -> tuple[dict[int, list[int]], Timeline]:
    timeline = Timeline()
    return engine.serve(requests, timeline), timeline


def test_the_batch_limit_is_respected_and_each_batch_runs_to_its_end():
    requests = [timed(i) for i in range(5)]
    engine = Scripted(max_batch=2, step_s=0.002)
    outputs, timeline = serve(engine, requests)
    assert engine.batches == [[0, 1], [2, 3], [4]]
    assert outputs == {r.request_id: [scripted_token(r, k) for k in range(3)] for r in requests}
    rec = timeline.requests
    for earlier, later in ([0, 1], [2, 3]), ([2, 3], [4]):
        assert min(rec[i].first_scheduled for i in later) >= max(rec[i].finish for i in earlier)
    assert all(sum(n for _, n in r.emissions) == 3 and r.finish_reason == "length" for r in rec.values())


def test_a_late_request_is_not_served_before_it_arrives_and_waits_for_the_running_batch():
    engine = Scripted(max_batch=4)
    _, timeline = serve(engine, [timed(0, 1), timed(1, 1, arrival_time=0.05)])     # nothing to do meanwhile
    first, late = timeline.requests[0], timeline.requests[1]
    assert engine.batches == [[0], [1]]
    assert late.arrival - first.arrival == pytest.approx(0.05)
    assert late.first_scheduled >= late.arrival

    engine = Scripted(max_batch=4, step_s=0.02)          # the first batch runs ~0.1 s: the late one queues
    _, timeline = serve(engine, [timed(0, 5), timed(1, 5), timed(2, 2, arrival_time=0.05)])
    rec = timeline.requests
    assert engine.batches == [[0, 1], [2]]                # static batching: it never joins the running batch
    assert rec[2].arrival < rec[0].finish                 # it did arrive while the batch ran...
    assert rec[2].first_scheduled >= max(rec[0].finish, rec[1].finish)     # ...and waited for its end


def test_a_closed_loop_follower_arrives_after_its_predecessor_finishes():
    requests = [timed(0, 2), timed(1, 2, follows=0, arrival_time=0.01), timed(2, 2, follows=1),
                timed(3, 2, arrival_time=0.0)]
    engine = Scripted(max_batch=4, step_s=0.002)
    outputs, timeline = serve(engine, requests)
    rec = timeline.requests
    assert engine.batches == [[0, 3], [1], [2]]
    assert rec[1].arrival >= rec[0].finish + 0.01 - 1e-9 and rec[1].first_scheduled >= rec[1].arrival
    assert rec[2].arrival >= rec[1].finish - 1e-9 and rec[2].first_scheduled >= rec[2].arrival
    assert sorted(outputs) == [0, 1, 2, 3]


def test_an_engine_that_stops_early_is_an_error_naming_the_requests():
    engine = Scripted(max_batch=4, give_up_after=2)
    with pytest.raises(OutsideEngineError, match=r"engine=scripted ended a batch before requests \[0, 1\]"):
        serve(engine, [timed(0, 5), timed(1, 5)])


def test_tokens_past_max_new_tokens_or_a_stop_token_are_cut():
    engine = Scripted(max_batch=4, chunk=7, extra=2)      # 7 tokens per call, and more calls once done
    stop = scripted_token(timed(1), 2)
    outputs, timeline = serve(engine, [timed(0, 4), timed(1, 6, stop_token_ids=(stop,))])
    assert outputs == {0: [0, 1, 2, 3], 1: [100, 101, 102]}
    assert [n for _, n in timeline.requests[0].emissions] == [4]      # the rest of the call and later calls dropped
    assert [n for _, n in timeline.requests[1].emissions] == [3]
    assert timeline.requests[0].finish_reason == "length" and timeline.requests[1].finish_reason == "stop"


# -- options, the registry, arm specs --------------------------------------------------------------------

def test_options_take_defaults_and_refuse_unknown_names_and_bad_values():
    """An engine's options are its config_class's fields: typed, checked as a plugin's config is."""
    assert HFGenerate.resolve_options("w", {}) == HFConfig(name="hf", cache="dynamic", prompt_lookup=0)
    assert HFGenerate.resolve_options("w", {"cache": "static"}).cache == "static"
    with pytest.raises(ValueError, match=r"^arm 'x'\.engine: engine=hf has no option cach; its options: cache \(the KV "
                                         r"cache transformers keeps.*, default 'dynamic'\); prompt_lookup \(.*\)$"):
        HFGenerate.resolve_options("arm 'x'.engine", {"cach": "static"})
    with pytest.raises(ValueError, match=r"^arm 'x'\.engine\.cache must be one of dynamic, static, got 'paged'$"):
        HFGenerate.resolve_options("arm 'x'.engine", {"cache": "paged"})
    with pytest.raises(ValueError, match=r"^arm 'x'\.engine\.prompt_lookup must be >= 0, got -1$"):
        HFGenerate.resolve_options("arm 'x'.engine", {"prompt_lookup": -1})
    for bad, shown in (("3", "'3'"), (True, "true"), (2.0, "2.0")):       # ablate.field_types' message
        with pytest.raises(ValueError, match=rf"^arm 'x'\.engine\.prompt_lookup must be a whole number \(default 0\), "
                                             rf"got {shown}$"):
            HFGenerate.resolve_options("arm 'x'.engine", {"prompt_lookup": bad})


@pytest.mark.parametrize("options, says", [
    ({"weights": "q8"}, "arm 'l'.engine.weights must be one of shipped, f32, f16, bf16, got 'q8'"),
    ({"batching": "continuous"}, "arm 'l'.engine.batching must be one of sequences, one, got 'continuous'"),
    ({"n_batch": 0}, "arm 'l'.engine.n_batch must be >= 1, got 0"),
    ({"threads": "4"}, "arm 'l'.engine.threads must be a whole number (default 0), got '4'"),
])
def test_llamacpps_options_are_checked_without_llama_cpp(options, says):
    from ablate.outside.llamacpp import LlamaCpp, LlamaCppConfig

    assert LlamaCpp.resolve_options("arm 'l'.engine", {"weights": "shipped"}) == LlamaCppConfig(weights="shipped")
    with pytest.raises(ValueError) as err:
        LlamaCpp.resolve_options("arm 'l'.engine", options)
    assert str(err.value) == says


def test_an_unknown_engine_lists_the_installed_ones(registry):
    with pytest.raises(ValueError, match=r"unknown engine 'sglang'; engines are ablate \(this one\) and hf, llamacpp, "
                                         r"openai, vllm"):
        load_engine("arm 'v'", "sglang")
    with pytest.raises(ValueError, match=r"arm 'v': unknown engine 'sglang'"):
        resolve_arm("v", {"engine": {"name": "sglang"}}, baseline_configs(registry), registry)
    assert load_engine("arm 'h'", "hf") is HFGenerate


def test_an_outside_arm_sets_no_slot_or_model_field():
    with pytest.raises(ValueError, match=r"runs engine=hf, which sets no ablate slot or model field \(got kv_cache\)"):
        ArmSpec.parse("arm 'h'", {"engine": "hf", "kv_cache": "contiguous"})
    with pytest.raises(ValueError, match=r"runs engine=hf, .*\(got model\)"):
        ArmSpec.parse("arm 'h'", {"engine": {"name": "hf"}, "model": {"n_kv_heads": 1}})
    assert ArmSpec.parse("a", {"engine": "hf"}).outside == {"name": "hf"}
    own = ArmSpec.parse("a", {"engine": {"name": "ablate", "graphs": True}, "kv_cache": "contiguous"})
    assert own.outside is None and own.engine == {"graphs": True}


def test_an_outside_arms_label_shows_the_engine_and_its_changed_options(registry):
    def label(spec):
        return resolve_arm("h", spec, baseline_configs(registry), registry).label()

    assert label({"engine": {"name": "hf", "cache": "static"}}) == "engine=hf cache=static"
    assert label({"engine": {"name": "hf", "cache": "dynamic", "prompt_lookup": 3}}) == "engine=hf prompt_lookup=3"
    assert label({"engine": "hf"}) == "engine=hf"


def test_ablate_plugins_lists_each_outside_engine_ready_or_what_it_needs(monkeypatch, capsys):
    from ablate import cli

    monkeypatch.setattr(HFGenerate, "requires", ("no_such_module_xyz",))
    engines = cli.outside_engines()
    assert {"hf", "llamacpp", "openai", "vllm"} <= set(engines) and engines["openai"] == "ready"
    assert engines["hf"] == 'engine=hf needs no_such_module_xyz, which is not installed (pip install -e ".[hf]")'
    cli.list_plugins()          # and each one's options: its config_class's fields, as an arm writes them
    listing = capsys.readouterr().out.splitlines()
    hf = listing.index(f"  hf        {engines['hf']}")
    assert listing[hf + 1].startswith('              cache: str = "dynamic"  the KV cache transformers keeps')
    assert listing[hf + 2].startswith('              prompt_lookup: int = 0  draft tokens per pass')
    assert "              prefix_caching: bool = false  vLLM's automatic prefix caching" in listing


def test_a_float_option_takes_a_whole_number_as_yaml_writes_it():
    from ablate.outside.openai import OpenAICompatible

    assert OpenAICompatible.resolve_options("arm 'o'", {"timeout_s": 30}).timeout_s == 30
    with pytest.raises(ValueError, match=r"^arm 'o'\.timeout_s must be a number \(default 600\.0\), got true$"):
        OpenAICompatible.resolve_options("arm 'o'", {"timeout_s": True})
