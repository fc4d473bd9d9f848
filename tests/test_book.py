"""The chapter's claims table: verdict rules, unit readings, every section computed, stored runs read."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from ablate.book.claims import (DIFFERS, EXACT, MEASURED, NOT_RUN, ROUNDED, VERDICTS, Claim, claims_frame,
                                in_bytes, judge, verdict_counts)
from ablate.book.config import BookConfig
from ablate.book.evidence import Evidence
from ablate.experiment.book_job import book_tables, report_text
from ablate.book.sections import SECTIONS, section_claims
from ablate.cli import book_arguments


def test_judge_uses_the_digits_the_book_writes():
    assert judge(2_621_440, 2_621_440, 7) == EXACT
    assert judge(140, 137.4, 3) == ROUNDED            # 137 is not 140 at three digits, but within 10%
    assert judge(140, 138.4, 2) == EXACT              # at two digits it is
    assert judge(0.0004, 0.007, 1) == DIFFERS


def test_bytes_are_judged_in_both_readings():
    kib = in_bytes("7.3", "k", "c", 2.5, "MB", 2_621_440, 2, "cmd")
    assert kib.verdict == EXACT and "MiB" in kib.reason and "2.5 MiB" in kib.project and "2.6 MB" in kib.project
    dec = in_bytes("7.1", "k", "c", 140, "GB", 138e9, 3, "cmd")      # 128.5 GiB, 138 GB: decimal is closer
    assert dec.verdict == ROUNDED and "10^9" in dec.reason


def test_a_claim_refuses_an_unknown_verdict():
    with pytest.raises(ValueError, match="verdict"):
        Claim("7.1", "k", "c", "b", "p", "roughly", "r", "cmd")


@pytest.fixture(scope="module")
def analytic_claims(tmp_path_factory) -> pd.DataFrame:
    """Every section with no measurement and no stored run."""
    evidence = Evidence(tmp_path_factory.mktemp("no-runs"), measure=False)
    return claims_frame([c for s in SECTIONS for c in section_claims(s, evidence)])


def test_every_section_has_claims_with_commands(analytic_claims):
    assert set(analytic_claims["section"]) == set(SECTIONS)
    assert analytic_claims["key"].is_unique
    assert analytic_claims["command"].str.startswith("python ").all()
    assert (analytic_claims["reason"].str.len() > 0).all()


def test_the_books_exact_figures_are_reproduced(analytic_claims):
    verdict = analytic_claims.set_index("key")["verdict"]
    assert verdict["kv-per-token-gpt3"] == EXACT          # 4,718,592 bytes
    assert verdict["kv-per-token-gpt3-mb"] == EXACT       # 4.5 MiB
    assert verdict["a100-peak"] == EXACT
    assert verdict["mla-one-head"] == DIFFERS             # 576 numbers a layer: 2.25 heads' worth
    assert verdict["decode-share-of-peak"] == DIFFERS     # the book divides FLOPs by FLOP/s


def test_without_runs_the_measured_claims_say_not_run(analytic_claims):
    waiting = analytic_claims[analytic_claims["verdict"] == NOT_RUN]
    experiments = {c.split("+experiment=")[1] for c in waiting["command"] if "+experiment=" in c}
    assert {"ch08_kv_cache", "ch09_paged", "ch10_batching", "ch10_textbook", "ch11_speculative", "ch12_flash",
            "ch13_gqa_mla"} <= experiments
    assert not (analytic_claims["verdict"] == MEASURED).any()


def _stored_run(root, experiment: str, summary: pd.DataFrame, config: dict) -> None:
    folder = root / experiment / "abc123"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "environment.json").write_text("{}")
    summary.to_csv(folder / "summary.csv", index=False)
    (folder / "done.json").write_text(json.dumps({"status": "done"}))


def test_measured_claims_read_the_latest_finished_run(tmp_path):
    _stored_run(tmp_path, "ch10_textbook", pd.DataFrame({"arm": ["static", "continuous"],
                                                         "finish_order": ["2 1 0 3", "2 3 1 0"]}),
                {"model": {"name": "smollm2-135m", "dtype": "fp32", "init": "random"}})
    _stored_run(tmp_path, "ch13_gqa_mla", pd.DataFrame({
        "arm": ["mha", "gqa3", "mqa", "mla_r128", "mla_r64"], "seqs_admitted_max": [1, 5, 16, 9, 17],
        "kv_bytes_per_token": [138240, 46080, 15360, 26880, 13440],
        "ppl_ratio": [1.0, 1.0, 2114.2, 1.52, 15.1]}), {"model": {"name": "smollm2-135m"}})
    evidence = Evidence(tmp_path, measure=False)
    claims = claims_frame([*section_claims("7.4", evidence), *section_claims("7.7", evidence)]).set_index("key")
    order = claims.loc["textbook-finish-order"]
    assert order["verdict"] == MEASURED and order["holds"] == "yes" and "2 3 1 0" in order["project"]
    assert str(tmp_path / "ch10_textbook") in order["reason"]
    admitted = claims.loc["gqa-more-requests"]
    assert admitted["verdict"] == MEASURED and admitted["holds"] == "yes" and "5.0x" in admitted["project"]
    assert claims.loc["mqa-loses-quality", "holds"] == "yes"
    assert claims.loc["mla-keeps-quality", "holds"] == "no"          # converted without training: it does not


def test_a_static_order_that_does_not_hold_is_reported_so(tmp_path):
    _stored_run(tmp_path, "ch10_textbook", pd.DataFrame({"arm": ["static", "continuous"],
                                                         "finish_order": ["2 1 0 3", "2 1 0 3"]}), {})
    claims = claims_frame(section_claims("7.4", Evidence(tmp_path, measure=False))).set_index("key")
    assert claims.loc["textbook-finish-order", "holds"] == "no"


def test_tables_count_every_verdict_and_the_report_has_every_section(tmp_path):
    tables = book_tables(BookConfig(), Evidence(tmp_path, measure=False))
    verdicts = tables["verdicts"]
    assert list(verdicts.columns) == ["section", *VERDICTS]
    assert verdicts.iloc[-1][list(VERDICTS)].sum() == len(tables["claims"])
    assert verdict_counts(tables["claims"]) == {v: int(verdicts.iloc[-1][v]) for v in VERDICTS}
    report = report_text(tables)
    assert all(f"## {s}:" in report for s in SECTIONS)


def test_one_section_and_a_bad_one():
    assert BookConfig(section="7.3").sections == ["7.3"]
    assert BookConfig(section=7.3).sections == ["7.3"]      # Hydra reads 7.3 as a float
    with pytest.raises(ValueError, match=r"7\.1.*7\.7"):
        BookConfig(section="7.9")


def test_the_command_maps_bare_options_to_the_book():
    assert book_arguments(["section=7.3", "measure=false", "results_dir=/tmp/x"]) == [
        "+experiment=book", "redo=true", "book.section=7.3", "book.measure=false", "results_dir=/tmp/x"]
