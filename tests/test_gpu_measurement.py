"""GPU-true measurement, checked on the CPU (CUDA mocked where needed): model.dtype=auto, the run id
naming the device, each arm's own CUDA peak memory, one free-memory reading per job for the KV
budget, the CUDA probes timed by events, the GPU's provenance, and models built on their device in
their dtype from one tensor at a time."""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from ablate.api.plugin import Slot
from ablate.checkpoints import hf as hf_ckpt
from ablate.checkpoints.lazy import LazyTensors
from ablate.checkpoints.loader import load_model
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.experiment.arm_run import with_fixed_kv_budget
from ablate.experiment.config import to_run_config
from ablate.experiment.job import resolved_config, run_identity
from ablate.measure import device as dev
from ablate.measure import hardware
from ablate.measure.memory import TensorMemoryTracker, cuda_peak_since, resident_weight_bytes, start_cuda_peak
from ablate.model.config import ModelConfig
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from ablate.results import config_hash

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def fake_gpu(monkeypatch, name="NVIDIA H200", total_memory=141 << 30):
    props = SimpleNamespace(name=name, total_memory=total_memory, major=9, minor=0, multi_processor_count=132,
                            uuid="1234-abcd")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return props


# -- 1. model.dtype=auto ----------------------------------------------------------------------------

def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_the_cpu():
    auto = ModelConfig(dtype="auto")
    assert auto.for_device(CPU).dtype == "fp32" and auto.for_device(CUDA).dtype == "bf16"
    assert ModelConfig(dtype="fp16").for_device(CUDA).dtype == "fp16"        # a dtype given is kept
    with pytest.raises(ValueError, match=r"model.dtype=auto has no torch dtype until the device is known"):
        auto.torch_dtype
    with pytest.raises(ValueError, match=r"model.dtype must be one of \['auto', 'bf16', 'fp16', 'fp32'\], got 'fp8'"):
        ModelConfig(dtype="fp8")
    assert LlamaModel.random(preset("tiny", dtype="auto")).config.dtype == "fp32"


def test_the_root_config_defaults_to_auto_and_records_the_resolved_dtype(compose_config, registry, tmp_path):
    raw = compose_config(tmp_path)
    assert raw["model"]["dtype"] == "auto" and to_run_config(raw, registry).model.dtype == "auto"
    assert resolved_config(raw, CPU)["model"]["dtype"] == "fp32"
    assert resolved_config(raw, CUDA)["model"]["dtype"] == "bf16"
    chapter = compose_config(tmp_path, "+experiment=ch09_paged")     # its budget is in tokens: any dtype
    assert resolved_config(chapter, CUDA)["model"]["dtype"] == "bf16"


def test_a_budget_in_tokens_is_the_same_bytes_for_every_variant_in_any_dtype(registry):
    from ablate.api.kv import KVBudgetConfig, budget_bytes
    from ablate.engine.arm import baseline_configs, resolve_arm
    from ablate.experiment.arm_run import with_fixed_kv_budget
    for dtype, bytes_per_token in (("fp32", 46080), ("bf16", 23040)):      # smollm2-135m's K/V per token
        model = LlamaModel.empty(preset("smollm2-135m", dtype=dtype), "meta")
        for variant in ({"name": "gqa", "kv_heads": 1}, "none"):
            arm = resolve_arm("a", {"kv_cache": {"name": "contiguous", "budget_tokens": 4096}, "variant": variant},
                              baseline_configs(registry), registry)
            fixed = with_fixed_kv_budget(arm, None, lambda arm: model).plugins[Slot.KV_CACHE]
            assert (fixed.budget_bytes, fixed.budget_tokens) == (4096 * bytes_per_token, 0)
    with pytest.raises(ValueError, match="budget_bytes and kv_cache.budget_tokens are both set: give one"):
        KVBudgetConfig(budget_bytes=1, budget_tokens=1)
    with pytest.raises(ValueError, match="budget_tokens must be >= 0"):
        KVBudgetConfig(budget_tokens=-1)
    assert budget_bytes(KVBudgetConfig(budget_tokens=10), CPU, 100) == 1000   # unconverted: the cache's own
    with pytest.raises(ValueError, match="needs the K/V bytes per token"):
        budget_bytes(KVBudgetConfig(budget_tokens=10), CPU)


def test_tf32_settings_are_recorded():
    assert dev.tf32_settings() == {"cuda_matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                                   "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
                                   "float32_matmul_precision": torch.get_float32_matmul_precision()}
    assert dev.describe(CPU)["tf32"] == dev.tf32_settings()


# -- 4. the run id names the device -------------------------------------------------------------------

def test_the_run_identity_differs_between_the_cpu_and_a_gpu(compose_config, tmp_path, monkeypatch):
    raw = compose_config(tmp_path)
    on_cpu = run_identity(raw, CPU)
    fake_gpu(monkeypatch)
    on_gpu = run_identity(raw, CUDA)
    assert on_cpu["device_identity"] == "cpu" and on_gpu["device_identity"] == "cuda: NVIDIA H200"
    assert config_hash(on_cpu) != config_hash(on_gpu)     # a finished CPU run never skips the GPU job
    fake_gpu(monkeypatch, name="NVIDIA A100-SXM4-80GB")
    assert config_hash(run_identity(raw, CUDA)) != config_hash(on_gpu)
    assert "wandb" not in on_cpu and "results_dir" not in on_cpu      # not measured: not in the id


# -- 2. each arm's own peak memory on CUDA; one free-memory reading per job ------------------------------

def test_the_cuda_arm_peak_is_what_the_arm_added(monkeypatch):
    state = {"allocated": 5000, "peak": 9000}      # 9000: an earlier arm's peak, 5000: other arms' models
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: state.update(peak=state["allocated"]))
    before = start_cuda_peak(CUDA)
    state["peak"] = 5000 + 700                     # the arm's KV cache and activations at their most
    assert (before, cuda_peak_since(CUDA, before)) == (5000, 700)


def test_resident_weight_bytes_count_the_weights_shared_with_the_loaded_model(tiny_model):
    assert resident_weight_bytes(tiny_model, tiny_model) == tiny_model.weight_bytes()
    variant = LlamaModel.random(preset("tiny"))          # a variant that made new weights for layer 0's wqkv
    for name, param in tiny_model.named_parameters():
        if name != "layers.0.attn.wqkv.weight":
            variant.get_parameter(name).data = param.data
    new = variant.layers[0].attn.wqkv.weight
    assert resident_weight_bytes(variant, tiny_model) == tiny_model.weight_bytes() - new.numel() * new.element_size()


def test_a_budget_fraction_is_of_one_reading_at_the_jobs_start(registry, tiny_model):
    base = baseline_configs(registry)
    arm = resolve_arm("paged", {"kv_cache": {"name": "paged", "budget_fraction": 0.5}}, base, registry)
    free = tiny_model.weight_bytes() + 10_000
    fixed = with_fixed_kv_budget(arm, free, lambda a: tiny_model)
    config = fixed.plugins[Slot.KV_CACHE]
    # budget = fraction x (free at the start - the arm's weights), the same for every arm whatever ran before
    assert (config.budget_bytes, config.budget_fraction, config.block_size) == (5000, 0.0, 16)
    assert arm.plugins[Slot.KV_CACHE].budget_fraction == 0.5          # the planned arm is left as it was
    assert with_fixed_kv_budget(arm, None, lambda a: tiny_model) is arm
    in_bytes = resolve_arm("c", {"kv_cache": {"name": "contiguous", "budget_bytes": 123}}, base, registry)
    assert with_fixed_kv_budget(in_bytes, free, lambda a: pytest.fail("no model needed")) is in_bytes


# -- 3. the CUDA probes: sized for the device, timed by CUDA events ----------------------------------------

class FakeEvent:
    """torch.cuda.Event on the CPU: every timed span reads 2 ms."""
    calls = 0

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self):
        FakeEvent.calls += 1

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return 2.0


def test_the_cuda_probes_time_with_events_and_count_read_plus_write(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    calls = []
    assert hardware.cuda_median_s(lambda: calls.append(1), warmups=3, repeats=5) == pytest.approx(0.002)
    assert len(calls) == 8 and FakeEvent.calls == 10              # warm-ups untimed, one event pair per repeat
    assert hardware.cuda_flops(CPU, torch.float32, n=64, repeats=3) == pytest.approx(2 * 64**3 / 0.002)
    assert hardware.cuda_bandwidth(CPU, 1 << 20, repeats=3) == pytest.approx(2 * (1 << 20) / 0.002)


def test_the_cuda_probes_are_sized_for_the_device(monkeypatch):
    fake_gpu(monkeypatch, total_memory=141 << 30)
    assert hardware.cuda_sizes(CUDA) == (4 << 30, 8192)
    method = hardware.probe_method(CUDA)
    assert "CUDA events" in method and "8192^3" in method and "4 GiB" in method and "allow_tf32" in method
    fake_gpu(monkeypatch, total_memory=8 << 30)                   # a small GPU: probes within 1/8 of it
    copy_bytes, n = hardware.cuda_sizes(CUDA)
    assert copy_bytes == 512 << 20 and 3 * n * n * 4 <= (8 << 30) // 8
    assert hardware.probe_method(CPU) == hardware.CPU_METHOD


def test_the_probe_method_is_recorded_and_an_entry_measured_otherwise_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(hardware, "CACHE_DIR", tmp_path)
    monkeypatch.setattr(hardware, "measure_bandwidth", lambda device, num_bytes=0, repeats=3: 1e10)
    monkeypatch.setattr(hardware, "measure_flops", lambda device, dtype, n=2048, repeats=5: 1e11)
    monkeypatch.setattr(hardware, "_busy", lambda device: "")
    monkeypatch.delenv(hardware.FROZEN_ENV, raising=False)
    first = hardware.peaks(CPU, torch.float32)
    assert first.method == hardware.CPU_METHOD and first.record()["method"] == hardware.CPU_METHOD
    path = tmp_path / hardware.CACHE_FILE
    data = json.loads(path.read_text())
    [key] = data
    del data[key]["method"]                      # an entry of the wall-clock probes, before methods were recorded
    path.write_text(json.dumps(data))
    assert hardware.peaks(CPU, torch.float32).source == "cached"
    data[key]["method"] = "another probe"
    path.write_text(json.dumps(data))
    assert hardware.peaks(CPU, torch.float32).source == "measured"


# -- 4. the GPU's provenance ----------------------------------------------------------------------------------

def test_gpu_provenance_reads_nvidia_smi(monkeypatch):
    fake_gpu(monkeypatch)
    asked = []

    def smi(args, **kwargs):
        asked.append(args)
        return SimpleNamespace(stdout="580.159.03, 1980, 3201, 1980, 3201, Enabled, [N/A]\n")

    monkeypatch.setattr(subprocess, "run", smi)
    info = dev.gpu_provenance(CUDA)
    assert info | {"cuda_version": None, "cudnn_version": None} == {
        "name": "NVIDIA H200", "compute_capability": "9.0", "sm_count": 132, "total_memory_bytes": 141 << 30,
        "cuda_version": None, "cudnn_version": None, "driver_version": "580.159.03", "sm_clock_mhz": 1980,
        "memory_clock_mhz": 3201, "max_sm_clock_mhz": 1980, "max_memory_clock_mhz": 3201, "ecc_mode": "Enabled",
        "mig_mode": None}
    assert asked[0][-2:] == ["-i", "GPU-1234-abcd"]             # this GPU, by its UUID


def test_gpu_provenance_without_nvidia_smi_or_nvml_says_why_and_never_fails(monkeypatch):
    fake_gpu(monkeypatch)

    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "run", missing)
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)     # `import pynvml` fails
    info = dev.gpu_provenance(CUDA)
    assert info["name"] == "NVIDIA H200" and "driver_version" not in info
    assert "nvidia-smi: FileNotFoundError" in info["unavailable"] and "pynvml: " in info["unavailable"]


# -- 5. models built on their device, in their dtype, one tensor at a time --------------------------------------

def test_random_weights_are_drawn_in_fp32_then_cast_one_parameter_at_a_time():
    fp32 = LlamaModel.random(preset("tiny", max_seq_len=64))     # short RoPE tables: the weights dominate
    with TensorMemoryTracker() as tracker:
        bf16 = LlamaModel.random(preset("tiny", max_seq_len=64, dtype="bf16"))
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    assert bf16.rope.cos.dtype == torch.float32 and bf16.rope.sin.dtype == torch.float32
    # host memory: the bf16 model plus one fp32 parameter at a time (and the RoPE tables, built in fp64),
    # never an fp32 model
    largest = max(p.numel() for p in fp32.parameters()) * 4
    rope = bf16.rope.cos.nbytes + bf16.rope.sin.nbytes
    assert tracker.peak_bytes <= bf16.weight_bytes() + largest + 4 * rope < fp32.weight_bytes()


def test_tied_embeddings_stay_tied():
    model = LlamaModel.random(preset("tiny", tied_embeddings=True, dtype="bf16"))
    assert model.lm_head.weight is model.embed.weight and model.embed.weight.dtype == torch.bfloat16


def hf_checkpoint(model: LlamaModel, directory):
    """`model` saved as a Hugging Face Llama directory (config.json + one safetensors file)."""
    from safetensors.torch import save_file

    c = model.config
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    tensors = {"model.embed_tokens.weight": model.embed.weight, "model.norm.weight": model.norm.weight,
               "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        for name, t in zip(("q", "k", "v"), layer.attn.wqkv.weight.split([q, kv, kv])):
            tensors[f"{pre}self_attn.{name}_proj.weight"] = t
        gate, up = layer.mlp.w_gate_up.weight.split(c.d_ff)
        tensors |= {f"{pre}self_attn.o_proj.weight": layer.attn.wo.weight, f"{pre}mlp.gate_proj.weight": gate,
                    f"{pre}mlp.up_proj.weight": up, f"{pre}mlp.down_proj.weight": layer.mlp.w_down.weight,
                    f"{pre}input_layernorm.weight": layer.attn_norm.weight,
                    f"{pre}post_attention_layernorm.weight": layer.mlp_norm.weight}
    directory.mkdir()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": c.d_model, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "num_hidden_layers": c.n_layers, "intermediate_size": c.d_ff,
        "vocab_size": c.vocab_size, "max_position_embeddings": c.max_seq_len, "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": False}))
    return directory


def test_a_checkpoint_is_read_one_tensor_at_a_time_into_the_models_dtype(tiny_model, tmp_path):
    directory = hf_checkpoint(tiny_model, tmp_path / "ckpt")
    weights, origin = hf_ckpt.hf_state_dict(directory)
    assert isinstance(weights, LazyTensors) and set(weights) == set(origin)
    looked_up = []
    counted = LazyTensors(lambda name: looked_up.append(name) or weights[name], list(weights))
    model = LlamaModel.from_hf_state_dict(replace(tiny_model.config, dtype="bf16"), counted)
    assert sorted(looked_up) == sorted(weights)                  # each tensor read once, none kept
    for (name, a), (_, b) in zip(tiny_model.named_parameters(), model.named_parameters()):
        assert b.dtype == torch.bfloat16 and torch.equal(a.to(torch.bfloat16), b), name
    loaded = load_model(ModelConfig(name="ckpt", path=str(directory), dtype="auto"))     # auto: fp32 on the CPU
    assert all(torch.equal(a, b) for a, b in zip(tiny_model.parameters(), loaded.parameters()))


def test_lazy_tensors_read_ahead_a_bounded_window():
    read = []
    lazy = LazyTensors(lambda name: read.append(name) or torch.zeros(1), [f"t{i}" for i in range(10)], workers=2)
    lazy["t0"]
    assert set(lazy._ahead) == {"t1", "t2"}                      # the next `workers` tensors, no more
    lazy["t1"]
    assert set(lazy._ahead) == {"t2", "t3"}
    lazy.close()
    assert lazy["t9"].shape == (1,) and not lazy._ahead          # after close: read in this thread
    with pytest.raises(KeyError):
        lazy["nope"]
