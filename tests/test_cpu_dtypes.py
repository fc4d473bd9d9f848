"""A CPU run in a dtype its matrix units lack is refused before anything is measured: bf16 without
AMX or AVX512-BF16, and fp16 on any CPU, would time the emulation of the products, not the model."""
from __future__ import annotations

import pytest
import torch

from ablate.experiment.job import run_job
from ablate.measure import device as dev

CPU = torch.device("cpu")


@pytest.mark.parametrize("units", [["amx-bf16"], ["avx512-bf16"], ["amx-bf16", "avx512-bf16"]])
def test_bf16_runs_where_the_cpu_has_a_bf16_unit(units, monkeypatch):
    monkeypatch.setattr(dev, "cpu_matrix_units", lambda: units)
    dev.refuse_emulated_dtype("bf16", CPU)
    dev.refuse_emulated_dtype("fp32", CPU)


def test_bf16_without_a_bf16_unit_is_refused_naming_the_units_and_the_way_out(monkeypatch):
    monkeypatch.setattr(dev, "cpu_matrix_units", lambda: [])
    with pytest.raises(ValueError, match=r"model.dtype=bf16 on this CPU .*neither AMX nor AVX512-BF16.*model.dtype=fp32"):
        dev.refuse_emulated_dtype("bf16", CPU)
    dev.refuse_emulated_dtype("fp32", CPU)


def test_fp16_on_a_cpu_is_refused_and_no_dtype_is_refused_on_a_gpu(monkeypatch):
    with pytest.raises(ValueError, match=r"model.dtype=fp16 on a CPU.*use model.dtype=fp32"):
        dev.refuse_emulated_dtype("fp16", CPU)
    monkeypatch.setattr(dev, "cpu_matrix_units", lambda: [])
    for dtype in ("fp16", "bf16", "fp32"):
        dev.refuse_emulated_dtype(dtype, torch.device("cuda"))


def test_the_units_are_what_torch_reports():
    expected = ({"amx-bf16"} if torch.cpu._is_amx_tile_supported() else set()) | (
        {"avx512-bf16"} if torch.cpu._is_avx512_bf16_supported() else set())
    assert set(dev.cpu_matrix_units()) == expected
    assert dev.describe(CPU)["cpu_matrix_units"] == dev.cpu_matrix_units()


def test_a_job_is_refused_before_its_run_folder_is_made(compose_config, registry, monkeypatch, tmp_path):
    monkeypatch.setattr(dev, "cpu_matrix_units", lambda: [])
    raw = compose_config(tmp_path, "device=cpu", "model.dtype=bf16", "experiment.repeats=1")
    with pytest.raises(ValueError, match="neither AMX nor AVX512-BF16"):
        run_job(raw, registry)
    assert not (tmp_path / "results").exists()
