"""The ablation: techniques -> arms, the contribution and interaction arithmetic, and one job end to end."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import pytest

from ablate.analysis.ablation_plan import ARMS_TABLE, OverrideConflict, arm_spec, parse_ablation, plan
from ablate.analysis.contributions import contributions, interacts
from ablate.api.plugin import Slot
from ablate.engine.arm import baseline_configs
from ablate.experiment import job
from ablate.experiment.ablation import arm_table, plan_arms
from ablate.experiment.config import ExperimentConfig
from ablate.experiment.job import run_job
from ablate.report.ablation import section

TECHNIQUES = {
    "kv_cache": {"overrides": {"kv_cache": "contiguous"}},
    "paged": {"overrides": {"kv_cache": {"name": "paged", "block_size": 4}}, "requires": ["kv_cache"]},
    "batching": {"overrides": {"scheduler": "continuous"}},
}


# -- techniques -> arms ----------------------------------------------------------------------------------

def test_plan_full_baseline_leave_one_out_with_dependants_add_one_in_with_requirements():
    planned = plan(parse_ablation({"techniques": TECHNIQUES}))
    by_name = {p.name: p for p in planned}
    assert planned[0].name == "baseline"              # first: the experiment's speedups are relative to it
    assert {name: set(p.techniques) for name, p in by_name.items()} == {
        "baseline": set(), "full": {"kv_cache", "paged", "batching"},
        "+kv_cache": {"kv_cache"}, "+paged": {"kv_cache", "paged"}, "+batching": {"batching"},
        "-paged": {"kv_cache", "batching"},
    }
    # one arm per distinct set: leaving out the KV cache (and paged, which requires it) is +batching;
    # leaving out batching is +paged
    assert by_name["+batching"].roles == ["add-one-in batching", "leave-one-out kv_cache"]
    assert by_name["+paged"].roles == ["add-one-in paged", "leave-one-out batching"]
    assert by_name["+kv_cache"].roles == ["add-one-in kv_cache"]     # also what +paged is divided by


def test_a_technique_may_replace_what_it_requires_but_not_what_an_unrelated_one_set():
    cfg = parse_ablation({"techniques": TECHNIQUES})
    assert arm_spec(cfg, frozenset({"kv_cache", "paged", "batching"})) == {
        "kv_cache": {"name": "paged", "block_size": 4}, "scheduler": "continuous"}
    clash = parse_ablation({"techniques": {"kv_cache": {"overrides": {"kv_cache": "contiguous"}},
                                           "dynamic": {"overrides": {"kv_cache": "dynamic"}}}})
    with pytest.raises(OverrideConflict, match="kv_cache: kv_cache sets contiguous and dynamic sets dynamic"):
        arm_spec(clash, frozenset({"kv_cache", "dynamic"}))
    same = parse_ablation({"techniques": {"a": {"overrides": {"kv_cache": "contiguous", "model": {"n_kv_heads": 1}}},
                                          "b": {"overrides": {"kv_cache": {"name": "contiguous"}}}}})
    assert arm_spec(same, frozenset({"a", "b"})) == {"kv_cache": {"name": "contiguous"}, "model": {"n_kv_heads": 1}}


def test_declared_order_is_kept_except_that_requirements_come_first():
    cfg = parse_ablation({"techniques": {"paged": TECHNIQUES["paged"], "batching": TECHNIQUES["batching"],
                                         "kv_cache": TECHNIQUES["kv_cache"]}})
    assert cfg.names == ["batching", "kv_cache", "paged"]
    assert cfg.unit("kv_cache") == {"kv_cache", "paged"} and cfg.requirements("paged") == {"kv_cache"}


def test_refused_and_conflicting_arms_are_skipped_with_the_reason(registry):
    raw = {"techniques": {
        "paged_attention": {"overrides": {"attention": "paged"}},          # needs a paged cache it does not require
        "paged": {"overrides": {"kv_cache": "paged"}},
        "dynamic": {"overrides": {"kv_cache": "dynamic"}},                 # collides with paged in kv_cache
    }}
    arms, planned = plan_arms(parse_ablation(raw), baseline_configs(registry), registry)
    table = arm_table(planned, arms).set_index("arm")
    skipped = table[table["status"] == "skipped"]
    assert "attention=paged cannot run with kv_cache=none" in skipped.loc["+paged_attention", "reason"]
    assert "kv_cache: paged sets paged and dynamic sets dynamic, and neither" in skipped.loc["full", "reason"]
    assert {a.name for a in arms} == set(table.index[table["status"] == "measured"])
    assert table.loc["-dynamic", "label"] == "kv_cache=paged attention=paged"     # the combination that runs
    assert len(table) == len(planned)                                              # nothing dropped


def test_the_composition_must_be_the_core_baselines(registry):
    plugins = baseline_configs(registry) | {Slot.ATTENTION: registry.config(Slot.ATTENTION, "sdpa")}
    with pytest.raises(ValueError, match="attention=sdpa is composed into every arm"):
        plan_arms(parse_ablation({"techniques": TECHNIQUES}), plugins, registry)


@pytest.mark.parametrize("raw, message", [
    ({"techniques": {}}, "must map technique names"),
    ({"techniques": {"a": {"overrides": {"cache": "x"}}}}, "unknown slot cache"),
    ({"techniques": {"a": {"overrides": {}}}}, "must set at least one slot"),
    ({"techniques": {"a": {"overrides": {"kv_cache": "paged"}, "requires": ["b"]}}}, "requires names b"),
    ({"techniques": {"a": {"overrides": {"kv_cache": "paged"}, "requires": ["b"]},
                     "b": {"overrides": {"scheduler": "continuous"}, "requires": ["a"]}}}, "cycle"),
    ({"techniques": TECHNIQUES, "pair": True}, "no field pair"),
    ({"techniques": TECHNIQUES, "interaction_tolerance": 1.5}, r"in \[0, 1\)"),
])
def test_malformed_ablations_are_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        parse_ablation(raw)


def test_experiment_refuses_arms_and_ablation_together():
    with pytest.raises(ValueError, match="both set"):
        ExperimentConfig(arms={"a": {}}, ablation={"techniques": TECHNIQUES})
    with pytest.raises(ValueError, match="one workload"):
        ExperimentConfig(grid={"output_len": [1, 2]}, ablation={"techniques": TECHNIQUES})


# -- the arithmetic on a synthetic runs table ------------------------------------------------------------

# per technique: its factor on throughput when added; kv_cache's on KV bytes is "from 0 to 1000"
EFFECTS = {"kv_cache": 4.0, "paged": 1.25, "batching": 2.0}
ROUND_NOISE = [1.0, 1.02, 0.98]


def synthetic_runs(cfg, arms: pd.DataFrame, synergy: dict[frozenset[str], float] | None = None) -> pd.DataFrame:
    """Throughput = 10 x the product of its techniques' effects (x a synergy for a pair), times a
    per-round factor that every arm of that round shares (the machine's drift); KV bytes 1000 with a
    cache, 800 paged, none without."""
    rows = []
    for arm in arms.itertuples():
        techniques = frozenset(t for t in arm.techniques.split("+") if t)
        value = 10 * np.prod([EFFECTS[t] for t in techniques])
        for pair, factor in (synergy or {}).items():
            value *= factor if pair <= techniques else 1.0
        kv = 0 if "kv_cache" not in techniques else 800 if "paged" in techniques else 1000
        for repeat, noise in enumerate(ROUND_NOISE):
            rows.append({"arm": arm.arm, "repeat": repeat, "output_throughput_tok_s": value * noise,
                         "ttft_p99_ms": 100 / value, "tpot_p99_ms": 10.0, "kv_reserved_peak_bytes": kv})
    return pd.DataFrame(rows)


def planned_table(raw) -> tuple:
    cfg = parse_ablation(raw)
    planned = plan(cfg)
    table = pd.DataFrame([{"arm": p.name, "techniques": "+".join(sorted(p.techniques)), "roles": "; ".join(p.roles),
                           "label": "", "status": "measured", "reason": ""} for p in planned])
    return cfg, table


def pick(table: pd.DataFrame, technique: str, metric: str, kind: str) -> pd.Series:
    (row,) = table[(table["technique"] == technique) & (table["metric"] == metric) & (table["kind"] == kind)].index
    return table.loc[row]


def test_independent_effects_give_equal_add_one_in_and_leave_one_out_and_no_interaction():
    cfg, arms = planned_table({"techniques": TECHNIQUES})
    table = contributions(synthetic_runs(cfg, arms), arms, cfg)
    for technique, effect in EFFECTS.items():
        add = pick(table, technique, "output_throughput_tok_s", "add_one_in")
        assert (add["ratio"], add["ci_low"], add["ci_high"]) == pytest.approx((effect,) * 3) and add["rounds"] == 3
        inter = pick(table, technique, "output_throughput_tok_s", "interaction")
        assert inter["ratio"] == pytest.approx(1.0) and not inter["interacts"]
    # leaving the KV cache out removes paged as well: 4 x 1.25
    loo = pick(table, "kv_cache", "output_throughput_tok_s", "leave_one_out")
    assert loo["ratio"] == pytest.approx(5.0) and loo["with_arm"] == "full" and loo["without_arm"] == "+batching"
    assert "also removes paged" in loo["note"]
    assert "over kv_cache" in pick(table, "paged", "output_throughput_tok_s", "add_one_in")["note"]
    assert pick(table, "all", "output_throughput_tok_s", "full_vs_baseline")["ratio"] == pytest.approx(10.0)
    assert pick(table, "batching", "ttft_p99_ms", "leave_one_out")["ratio"] == pytest.approx(0.5)
    # KV bytes: paged 800 / contiguous 1000; over the baseline's zero bytes there is no ratio
    assert pick(table, "paged", "kv_reserved_peak_bytes", "add_one_in")["ratio"] == pytest.approx(0.8)
    assert np.isnan(pick(table, "kv_cache", "kv_reserved_peak_bytes", "add_one_in")["ratio"])
    # pairs.false adds no arm, but the data has two squares: kv_cache, batching, both (-paged) and
    # neither; paged (with kv_cache), batching, full and the baseline
    pairs = table[(table["kind"] == "pair") & (table["metric"] == "output_throughput_tok_s")]
    assert list(pairs["technique"]) == ["kv_cache x batching", "paged x batching"]
    assert pairs["ratio"].to_numpy() == pytest.approx(1.0) and not pairs["interacts"].any()


def test_a_synergy_shows_as_interaction_and_as_the_pair_that_causes_it():
    raw = {"techniques": TECHNIQUES | {"gqa": {"overrides": {"variant": {"name": "gqa", "kv_heads": 1}}}},
           "pairs": True}
    EFFECTS["gqa"] = 1.1
    try:
        cfg, arms = planned_table(raw)
        runs = synthetic_runs(cfg, arms, synergy={frozenset({"batching", "gqa"}): 1.5})
        table = contributions(runs, arms, cfg)
    finally:
        del EFFECTS["gqa"]
    for technique in ("batching", "gqa"):
        inter = pick(table, technique, "output_throughput_tok_s", "interaction")
        assert inter["ratio"] == pytest.approx(1.5) and inter["interacts"]     # the full system amplifies it
    assert not pick(table, "paged", "output_throughput_tok_s", "interaction")["interacts"]
    pairs = table[(table["kind"] == "pair") & (table["metric"] == "output_throughput_tok_s")].set_index("technique")
    expected = {" x ".join(p) for p in itertools.combinations(cfg.names, 2)} - {"kv_cache x paged"}   # nested
    assert set(pairs.index) == expected
    assert pairs.loc["batching x gqa", "ratio"] == pytest.approx(1.5) and pairs.loc["batching x gqa", "interacts"]
    assert pairs.drop("batching x gqa")["ratio"].to_numpy() == pytest.approx(1.0)
    assert not pairs.drop("batching x gqa")["interacts"].any()


def test_a_skipped_arm_leaves_its_contributions_empty_with_the_reason():
    cfg, arms = planned_table({"techniques": TECHNIQUES})
    runs = synthetic_runs(cfg, arms)
    arms.loc[arms["arm"] == "-paged", ["status", "reason"]] = ["skipped", "plugins refuse each other"]
    table = contributions(runs[runs["arm"] != "-paged"], arms, cfg)
    loo = pick(table, "paged", "output_throughput_tok_s", "leave_one_out")
    assert np.isnan(loo["ratio"]) and loo["rounds"] == 0
    assert loo["note"] == "-paged skipped: plugins refuse each other"
    assert pick(table, "paged", "output_throughput_tok_s", "add_one_in")["ratio"] == pytest.approx(1.25)


@pytest.mark.parametrize("ratio, low, high, expected", [
    (1.5, 1.2, 1.8, True),          # CI excludes 1 by far
    (0.6, 0.5, 0.7, True),
    (1.5, 0.9, 2.0, False),         # the CI includes 1: could be noise
    (1.05, 1.02, 1.08, False),      # real but smaller than the 10% tolerance
    (float("nan"), 1.0, 1.0, False),
])
def test_interaction_rule(ratio, low, high, expected):
    assert interacts(ratio, low, high, tolerance=0.10) is expected


# -- end to end ------------------------------------------------------------------------------------------

@pytest.mark.slow    # 12 runs, the report's figures and the Hydra composition: ~10 s on 2 cores
def test_ablation_job_end_to_end_on_the_tiny_model(compose_config, registry, tmp_path, monkeypatch):
    logged = {}
    monkeypatch.setattr(job, "log_run", lambda settings, **kwargs: logged.update(kwargs))
    raw = compose_config(tmp_path, "+experiment=ablation", "model=tiny", "model.init=random", "workload.source=random",
                         "workload.num_requests=2", "workload.prompt_len=8", "workload.output_len=3",
                         "workload.output_len_max=4", "experiment.repeats=2", "experiment.warmup=0",
                         *(f"~experiment.ablation.techniques.{t}" for t in ("speculative", "flash_attention", "gqa", "graphs")))
    folder = run_job(raw, registry)
    arms = pd.read_csv(folder.path / f"{ARMS_TABLE}.csv", keep_default_na=False)
    assert list(arms["arm"]) == ["baseline", "full", "+kv_cache", "+paged", "+continuous_batching", "-paged"]
    assert (arms["status"] == "measured").all()
    runs = pd.read_csv(folder.path / "runs.csv")
    assert sorted(runs["arm"].unique()) == sorted(arms["arm"]) and len(runs) == 2 * len(arms)
    contributions_csv = pd.read_csv(folder.path / "ablation.csv")
    assert set(contributions_csv["technique"]) >= {"kv_cache", "paged", "continuous_batching", "all"}
    report = (folder.path / "report.md").read_text()
    for text in ("## Ablation", "### Interactions", "### Skipped arms", "![ablation](ablation.png)",
                 "kv_cache leave-one-out: also removes paged"):
        assert text in report
    assert (folder.path / "ablation.png").stat().st_size > 0
    assert logged["images"]["ablation"] == folder.path / "ablation.png"           # the figure goes to W&B
    assert "ablation" in logged["tables"] and ARMS_TABLE in logged["tables"]
    assert "ablation/add_one_in/kv_cache/output_throughput_tok_s" in logged["summary"]
    # the report is rebuilt from the folder alone, the same
    text, figures = section(folder.path, runs)
    assert text in report and figures == {"ablation": folder.path / "ablation.png"}
