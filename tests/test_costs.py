"""The cost calculator (ch07): KV bytes per token, memory left for KV, decode bounds; and its job."""
from __future__ import annotations

import pandas as pd
import pytest

from ablate.analysis.costs import DEVICES, CostsConfig, cost_tables, model_costs
from ablate.model.config import preset


def test_llama_2_70b_kv_bytes_per_token():
    assert preset("llama-2-70b").kv_bytes_per_token(2) == 2 * 80 * 8 * 128 * 2 == 327_680
    assert model_costs({"preset": "llama-2-70b", "n_kv_heads": 64}, "fp16").kv_bytes_per_token == 8 * 327_680
    assert preset("deepseek-v2").kv_bytes_per_token(2) == 60 * (512 + 64) * 2       # MLA: latent + rotary key


def test_tables_follow_the_formulas():
    config = CostsConfig(models=[{"preset": "llama-3-8b"}, {"preset": "deepseek-v2"}], devices=["h100-sxm"],
                         dtype="bf16", context_lens=[4096], concurrent_requests=[1, 200])
    tables = cost_tables(config, {"h100-sxm": DEVICES["h100-sxm"]})
    row = tables["devices"].set_index("model").loc["llama-3-8b"]
    m = model_costs({"preset": "llama-3-8b"}, "bf16")
    assert m.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    left = 80e9 - m.weight_bytes
    assert row["memory_left_for_kv"] == pytest.approx(left)
    assert row["max_requests_at_4096"] == left // (4096 * m.kv_bytes_per_token)
    t = (m.active_weight_bytes + 4096 * m.kv_bytes_per_token) / 3.35e12          # bandwidth-bound at batch 1
    assert row["decode_ms_per_token_at_4096"] == pytest.approx(1e3 * t)
    flops = 2 * m.params_active + 4 * 32 * 32 * 128 * 4096
    assert row["mfu_ceiling_batch1_at_4096"] == pytest.approx(flops / t / 989e12)
    requests = tables["requests"].set_index(["model", "requests"])
    assert bool(requests.loc[("llama-3-8b", 1), "fits"]) and not bool(requests.loc[("llama-3-8b", 200), "fits"])
    assert not tables["devices"].set_index("model").loc["deepseek-v2", "weights_fit"]     # 472 GB of experts


def test_costs_experiment_runs_through_the_cli_job(compose_config, registry, tmp_path):
    from ablate.experiment.job import run_job
    from ablate.results import load
    raw = compose_config(tmp_path, "+experiment=ch07_costs", "costs.devices=[a100-80gb,this-machine]",
                         "costs.context_lens=[1024]")
    folder = run_job(raw, registry)
    assert folder.is_done
    models = pd.read_csv(folder.path / "models.csv").set_index("model")
    assert models.loc["llama-2-70b", "kv_bytes_per_token"] == 327_680
    assert models.loc["llama-2-70b-mha", "kv_bytes_per_token"] == 8 * 327_680
    devices = pd.read_csv(folder.path / "devices.csv")
    assert set(devices["device"]) == {"a100-80gb", "this-machine"}
    assert (folder.path / "report.md").read_text().startswith("# ch07_costs")
    assert load(folder.path).config["experiment"]["kind"] == "costs"


def test_chapter_12_and_13_experiments_compose(compose_config, registry, tmp_path):
    from ablate.experiment.config import to_run_config
    from ablate.experiment.plan import make_plan
    for name, arms in (("ch12_flash", ["naive", "sdpa", "flash"]),
                       ("ch13_gqa_mla", ["mha", "gqa3", "mqa", "mla_r128", "mla_r64"])):
        cfg = to_run_config(compose_config(tmp_path, f"+experiment={name}"), registry)
        assert [a.name for a in make_plan(cfg, registry).arms] == arms
    cfg = to_run_config(compose_config(tmp_path, "+experiment=ch12_flash"), registry)
    assert cfg.experiment.track_memory and cfg.model.max_seq_len > 8192
