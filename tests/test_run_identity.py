"""A run is reused (skipped as finished, or continued) only while what it measured is unchanged: the
weights' bytes, the code of every plugin package its arms ran and the outside engines' versions
(ablate.experiment.identity); otherwise the earlier rounds are set aside, saying what changed."""
from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest
from safetensors.torch import save_file

from ablate import results
from ablate.engine.arm import baseline_configs, resolve_arm
from ablate.engine.registry import discover
from ablate.outside.hf import hf_state_dict
from ablate.outside.hf_export import hf_config
from ablate.experiment import identity, job
from ablate.experiment.job import run_job
from ablate.model.config import ModelConfig
from ablate.model.presets import preset
from ablate.model.llama import LlamaModel
from test_rounds import Killed, counting_run_once

PLUGIN = textwrap.dedent('''\
    """A third-party KV cache, installed from outside the repository (a test's)."""
    from dataclasses import dataclass

    from ablate_kv_cache.contiguous import ContiguousConfig, ContiguousKVCache


    @dataclass
    class FakeConfig(ContiguousConfig):
        name: str = "fake_cache"


    class FakeCache(ContiguousKVCache):
        name = "fake_cache"
        config_class = FakeConfig
    ''')


def write_checkpoint(directory: Path, seed: int) -> Path:
    """The tiny preset's random weights (this seed) as a Hugging Face checkpoint folder."""
    model = LlamaModel.random(replace(preset("tiny"), seed=seed))
    directory.mkdir(parents=True, exist_ok=True)
    weights = hf_state_dict(model)
    if model.config.tied_embeddings:
        weights.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in weights.items()}, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(hf_config(model)))
    return directory


@pytest.fixture
def third_party(tmp_path, monkeypatch):
    """A plugin distribution `fake-ablate-plugin` on the path, as pip would install it: its package
    and its dist-info with the entry point; returns its source file."""
    site = tmp_path / "site"
    package = site / "fake_ablate_plugin"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(PLUGIN)
    info = site / "fake_ablate_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-ablate-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[ablate.plugins]\nkv_cache.fake_cache = fake_ablate_plugin:FakeCache\n")
    (info / "RECORD").write_text("fake_ablate_plugin/__init__.py,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ABLATE_CACHE_DIR", str(tmp_path / "cache"))
    # this test's package, not one an earlier test imported from its own folder under the same name
    monkeypatch.delitem(sys.modules, "fake_ablate_plugin", raising=False)
    return package / "__init__.py"


def test_weights_are_compared_by_content_and_the_digest_cache_never_serves_a_replaced_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ABLATE_CACHE_DIR", str(tmp_path / "cache"))
    big = tmp_path / "model.gguf"
    big.write_bytes(b"a" * (identity.CHUNK + 7))
    model = ModelConfig(path=str(big))
    first = identity.weights(model, [])
    assert json.loads(identity.cache_file().read_text())[str(big.resolve())]["sha256"] == first[str(big.resolve())]["sha256"]
    assert identity.what_changed({"weights": first}, {"weights": identity.weights(model, [])}) is None
    # other bytes at the same path, size and modification time: still a change (the cache is keyed
    # by inode and ctime too, which a replacement cannot keep)
    stat = big.stat()
    replacement = tmp_path / "other.gguf"
    replacement.write_bytes(b"b" * (identity.CHUNK + 7))
    os.replace(replacement, big)
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = identity.what_changed({"weights": first}, {"weights": identity.weights(model, [])})
    assert changed and f"the weights file {big.resolve()} changed" in changed
    # touched, same bytes: the same weights
    now = identity.weights(model, [])
    os.utime(big)
    assert identity.what_changed({"weights": now}, {"weights": identity.weights(model, [])}) is None
    # random weights read no file; a folder checkpoint is every file in it
    assert identity.weights(ModelConfig(), []) == {}
    folder = write_checkpoint(tmp_path / "ckpt", seed=0)
    assert set(identity.weights(ModelConfig(path=str(folder)), [])) == {str(folder / "config.json"),
                                                                         str(folder / "model.safetensors")}


def test_a_plugin_option_naming_a_file_is_part_of_the_weights(tmp_path, registry):
    draft = write_checkpoint(tmp_path / "draft", seed=1)
    arm = resolve_arm("spec", {"decoding": {"name": "speculative", "drafter": "draft_model",
                                            "draft_model": str(draft)}}, baseline_configs(registry), registry)
    assert str(draft / "model.safetensors") in identity.weights(ModelConfig(), [arm])


def test_an_edited_third_party_plugin_and_another_engine_version_are_changes(third_party, monkeypatch):
    registry = discover()
    arms = [resolve_arm("fake", {"kv_cache": "fake_cache"}, baseline_configs(registry), registry)]
    before = identity.measured_inputs(ModelConfig(), arms, registry)
    assert before["plugin_packages"]["fake-ablate-plugin"] == {
        "version": "1.0", "sources": before["plugin_packages"]["fake-ablate-plugin"]["sources"],
        "plugins": ["kv_cache.fake_cache"]}
    assert identity.what_changed(before, identity.measured_inputs(ModelConfig(), arms, registry)) is None
    third_party.write_text(third_party.read_text() + "# edited\n")
    changed = identity.what_changed(before, identity.measured_inputs(ModelConfig(), arms, registry))
    assert changed.startswith("plugin package fake-ablate-plugin changed (sources ")
    # an outside engine's package at another version
    engine = {"engines": {"hf": {"class": "ablate.outside.hf:HFGenerate", "versions": {"transformers": "4.45.0"}}}}
    newer = {"engines": {"hf": {"class": "ablate.outside.hf:HFGenerate", "versions": {"transformers": "4.46.0"}}}}
    assert "outside engine hf changed (versions" in identity.what_changed(engine, newer)
    assert identity.what_changed(None, before) is None        # a folder of older code has no record to compare


@pytest.mark.slow    # seven short jobs end to end
def test_a_run_is_reused_only_while_its_weights_and_plugin_code_are_unchanged(third_party, compose_config, tmp_path,
                                                                             monkeypatch, capsys):
    registry = discover()
    for module in (job, results):          # one code_version: others may edit the tree meanwhile
        monkeypatch.setattr(module, "code_version", lambda: "one code")
    checkpoint = write_checkpoint(tmp_path / "ckpt", seed=0)
    raw = compose_config(tmp_path, "wandb.mode=disabled", "experiment.warmup=0", "experiment.repeats=2",
                         "workload.num_requests=2", "workload.prompt_len=8", "workload.output_len=4",
                         "model=tiny", f"model.path={checkpoint}", "+experiment.arms.baseline={}",
                         "+experiment.arms.cached.kv_cache=contiguous")
    raw["experiment"]["arms"]["fake"] = {"kv_cache": "fake_cache"}

    def measure(fail_at: int | None = None) -> tuple[str, list[str]]:
        calls = counting_run_once(monkeypatch, fail_at=fail_at)
        capsys.readouterr()
        if fail_at is None:
            run_job(raw, registry)
        else:
            with pytest.raises(Killed):
                run_job(raw, registry)
        return capsys.readouterr().out, calls

    def set_aside() -> list[Path]:
        return sorted(p for p in (tmp_path / "results" / "default").iterdir() if ".old-" in p.name)

    out, _ = measure(fail_at=4)                      # round 0 of three arms kept, round 1 dies
    out, calls = measure()
    assert "continuing an unfinished run: 1 round(s) kept" in out and len(calls) == 3     # unchanged: continued
    out, calls = measure()
    assert "already finished, skipped" in out and not calls                               # unchanged: skipped

    write_checkpoint(checkpoint, seed=1)                                                 # replaced weights
    out, calls = measure()
    assert "already finished" not in out and len(calls) == 6
    assert "not reused: what it measured changed since (the weights file" in out and len(set_aside()) == 1

    write_checkpoint(checkpoint, seed=2)
    measure(fail_at=4)                               # set aside as changed, then killed in round 1
    write_checkpoint(checkpoint, seed=3)
    out, calls = measure()
    assert "continuing" not in out and len(calls) == 6 and "(the weights file" in out
    kept = [p for p in set_aside() if not (p / "done.json").exists()]
    assert len(set_aside()) == 3 and len(kept) == 1 and len(pd.read_csv(kept[0] / "runs.csv")) == 3               # set aside, not deleted

    third_party.write_text(third_party.read_text() + "# edited\n")                        # edited plugin source
    out, calls = measure()
    assert "already finished" not in out and len(calls) == 6
    assert "plugin package fake-ablate-plugin changed" in out
    recorded = identity.recorded_inputs(next(p for p in (tmp_path / "results" / "default").iterdir()
                                             if p.is_dir() and ".old-" not in p.name))
    assert recorded["plugin_packages"]["fake-ablate-plugin"]["plugins"] == ["kv_cache.fake_cache"]
    assert set(recorded["weights"]) == {str(checkpoint / "config.json"), str(checkpoint / "model.safetensors")}
