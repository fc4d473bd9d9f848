"""The cost calculator (ch07): KV bytes per token, memory left for KV, decode bounds, servers of N
devices, training against inference; and its job."""
from __future__ import annotations

import math

import pandas as pd
import pytest

from ablate.analysis.costs import DEVICES, CostsConfig, cost_tables, model_costs
from ablate.analysis.devices import ServerSpec, parse_server, server_spec
from ablate.analysis.intensity import BANDWIDTH_BOUND, COMPUTE_BOUND, decode_step, training_step
from ablate.analysis.servers import ServerCosts
from ablate.model.presets import preset

BOOK_70B = {"preset": "llama-2-70b", "n_kv_heads": 64, "weights_of": "llama-2-70b", "label": "llama-2-70b-book"}


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


@pytest.mark.slow      # the whole costs job with its report (~2.5 s); its tables: the tests above
def test_costs_experiment_runs_through_the_cli_job(compose_config, registry, tmp_path):
    from ablate.experiment.job import run_job
    from ablate.results import load
    raw = compose_config(tmp_path, "+experiment=ch07_costs", "costs.devices=[a100-80gb,4xa100-80gb,this-machine]",
                         "costs.context_lens=[1024]", "costs.decode_batches=[1,4]")
    folder = run_job(raw, registry)
    assert folder.is_done
    models = pd.read_csv(folder.path / "models.csv").set_index("model")
    assert models.loc["llama-2-70b", "kv_bytes_per_token"] == 327_680
    assert models.loc["llama-2-70b-mha", "kv_bytes_per_token"] == 8 * 327_680
    devices = pd.read_csv(folder.path / "devices.csv")
    assert set(devices["device"]) == {"a100-80gb", "4xa100-80gb", "this-machine"}
    book = devices.set_index(["model", "device"]).loc[("llama-2-70b-book", "4xa100-80gb")]
    assert book["kv_bytes_per_token_server"] == 2_621_440 and book["num_devices"] == 4
    intensity = pd.read_csv(folder.path / "training_vs_inference.csv")
    assert sorted(set(intensity["batch"])) == [1, 4, 512, 2048]
    assert set(intensity["device"]) == {"a100-80gb", "4xa100-80gb", "this-machine"}
    report = (folder.path / "report.md").read_text()
    assert report.startswith("# ch07_costs") and "## Training vs inference" in report and "train b=2048" in report
    assert load(folder.path).config["experiment"]["kind"] == "costs"


def test_chapter_12_and_13_experiments_compose(compose_config, registry, tmp_path):
    from ablate.experiment.config import to_run_config
    from ablate.experiment.plan import make_plan
    for name, arms in (("ch12_flash", ["naive", "sdpa", "flash"]),
                       ("ch13_gqa_mla", ["mha", "gqa3", "mqa", "mla_r128", "mla_r64"])):
        cfg = to_run_config(compose_config(tmp_path, f"+experiment={name}"), registry)
        assert [a.name for a in make_plan(cfg, registry).arms] == arms
    cfg = to_run_config(compose_config(tmp_path, "+experiment=ch12_flash"), registry)
    longest = max(cfg.experiment.grid["prompt_len"])            # its prompt and its one output token fit
    assert cfg.experiment.track_memory and cfg.model.max_seq_len == longest + 1


def test_the_books_four_a100_server():
    """4 x A100 80 GB, LLaMA-2-70B in fp16: 320 GB, ~140 GB of weights, ~180 GB left, 2,621,440
    KV bytes a token with 64 K/V heads (327,680 with the real 8), 100 requests of 4096 tokens ~6x
    what is left, 10 of them fit."""
    server = server_spec("4xa100-80gb")
    book = ServerCosts(model_costs(BOOK_70B, "fp16"), server)
    assert server.memory_bytes == 320e9 and server.num_devices == 4
    assert book.model.weight_bytes == 2 * 68_976_648_192 == pytest.approx(140e9, rel=0.02)
    assert book.memory_left == 320e9 - 2 * 68_976_648_192 == pytest.approx(180e9, rel=0.02)
    assert book.model.kv_bytes_per_token == book.kv_bytes_per_token == 2 * 80 * 64 * 128 * 2 == 2_621_440
    assert book.kv_bytes_per_token_per_device == 2_621_440 // 4 and book.kv_replication == 1
    hundred = 100 * book.kv_bytes_per_request(4096)
    assert hundred == 100 * 4096 * 2_621_440 == 1000 * 2**30      # the book's "1,024 GB": 100 x 4096 x 2.5 MiB
    assert 5.5 < hundred / book.memory_left < 6.5 and not book.requests_fit(100, 4096)
    assert book.requests_fit(10, 4096) and 10 * book.kv_bytes_per_request(4096) == 100 * 2**30
    assert book.max_requests(4096) == 16
    real = ServerCosts(model_costs({"preset": "llama-2-70b"}, "fp16"), server)
    assert real.kv_bytes_per_token == 327_680 and real.kv_heads_per_device == 2
    assert real.max_requests(4096) == (80e9 - real.weight_bytes_per_device) // (4096 * 327_680 // 4) == 135
    mha = model_costs({"preset": "llama-2-70b", "n_kv_heads": 64}, "fp16")   # a real 64-head model: wider K, V
    assert mha.weight_bytes > 155e9 and mha.kv_bytes_per_token == 2_621_440


def test_server_names_parse_and_bad_ones_say_the_syntax():
    assert parse_server("4xa100-80gb") == (4, "a100-80gb")
    assert parse_server("8xh200") == (8, "h200") and parse_server("h100-sxm") == (1, "h100-sxm")
    assert parse_server("this-machine") == (1, "this-machine")
    assert server_spec("8xh100-sxm") == ServerSpec(DEVICES["h100-sxm"], 8)
    for bad in ("4xa100", "0xh200", "xh200", "4x", "2xthis-machine", "a100", "-1xh200", "4 x h200"):
        with pytest.raises(ValueError, match=r"<N>x<device>.*'a100-80gb', 'h100-sxm', 'h200'"):
            parse_server(bad)
    with pytest.raises(ValueError, match=r"costs.devices: unknown \['4xa999'\]; write <N>x<device>"):
        CostsConfig(devices=["h200", "4xa999"])
    with pytest.raises(ValueError, match="costs.decode_batches must be a non-empty list of positive integers"):
        CostsConfig(decode_batches=[0])


def test_tensor_parallel_splits_weights_and_replicates_kv_when_heads_are_few():
    tiny = model_costs({"preset": "tiny"}, "bf16")                    # 2 K/V heads
    on8 = ServerCosts(tiny, server_spec("8xh100-sxm"))
    assert on8.kv_heads_per_device == 1 and on8.kv_replication == 4
    assert on8.kv_bytes_per_token_per_device == tiny.kv_bytes_per_token // 2
    assert on8.kv_bytes_per_token == 4 * tiny.kv_bytes_per_token
    assert on8.weight_bytes_per_device == tiny.weight_bytes / 8
    smol = ServerCosts(model_costs({"preset": "smollm2-135m"}, "bf16"), server_spec("4xa100-80gb"))
    assert smol.kv_heads_per_device == 1 and smol.kv_replication == pytest.approx(4 / 3)   # 3 heads on 4
    mla = ServerCosts(model_costs({"preset": "deepseek-v2"}, "bf16"), server_spec("8xh200"))
    assert mla.kv_replication == 8                                      # one latent row, on every device
    real = ServerCosts(model_costs({"preset": "llama-2-70b"}, "bf16"), server_spec("8xh200"))
    assert real.kv_heads_per_device == 1 and real.kv_replication == 1
    c = 4096            # decode lower bound: each device reads its share at its own bandwidth
    per_device = real.model.active_weight_bytes / 8 + c * 327_680 / 8
    assert real.decode_seconds(c) == pytest.approx(per_device / 4.8e12)
    config = CostsConfig(models=[{"preset": "llama-3-8b"}], devices=["h100-sxm", "1xh100-sxm"], context_lens=[4096])
    rows = cost_tables(config, {k: server_spec(k) for k in config.devices})["devices"].drop(columns="device")
    pd.testing.assert_series_equal(rows.iloc[0], rows.iloc[1], check_names=False)   # N = 1 is the device


def test_intensity_flips_from_decode_to_training_on_an_a100():
    costs = ServerCosts(model_costs({"preset": "llama-2-70b"}, "bf16"), server_spec("a100-80gb"))
    ridge = 312e12 / 2.039e12
    m, c = costs.model, 4096
    for b in (1, 8, 32):
        step = decode_step(costs, b, c)
        assert step.regime == BANDWIDTH_BOUND and step.ridge == pytest.approx(ridge)
        assert step.weight_matmul_intensity == b                          # 2 b / e, e = 2
        flops = b * (2 * m.params_active + 4 * 80 * 64 * 128 * c)
        assert step.intensity == pytest.approx(flops / (m.active_weight_bytes + b * c * 327_680))
        assert step.mfu_ceiling == pytest.approx(step.intensity / ridge) and step.mfu_ceiling < 0.2
    assert decode_step(costs, 1, c).mfu_ceiling < 0.01                  # 1 FLOP/byte against 153
    for b in (512, 2048):
        step = training_step(costs, b)
        assert step.intensity == pytest.approx(6 * m.params_active * b / (3 * m.active_weight_bytes)) == b
        assert step.regime == COMPUTE_BOUND and step.mfu_ceiling == 1
    config = CostsConfig(models=[{"preset": "llama-2-70b"}], devices=["a100-80gb"], context_lens=[c])
    table = cost_tables(config, {"a100-80gb": DEVICES["a100-80gb"]})["training_vs_inference"]
    assert list(table["regime"]) == [BANDWIDTH_BOUND] * 3 + [COMPUTE_BOUND] * 2
    assert list(table["phase"]) == ["decode"] * 3 + ["training"] * 2
    assert math.isnan(table["context"].iloc[-1]) and not table["decode_kv_fits"].iloc[0]   # 138 GB > 80 GB


def test_a_7b_model_reads_about_ten_times_fewer_bytes_than_70b():
    assert preset("llama-2-7b").num_params() == 6_738_415_616           # Llama-2-7B's published count
    small, large = model_costs({"preset": "llama-2-7b"}, "fp16"), model_costs({"preset": "llama-2-70b"}, "fp16")
    assert 10 < large.decode_bytes_per_token(1) / small.decode_bytes_per_token(1) < 11
    assert small.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
