"""The main job (make run): one xnnquant row end to end, and the table format."""

from __future__ import annotations

import pytest

from xnnquant.cli import main_job

pytest.importorskip("torch")


@pytest.mark.xnnpack
def test_one_row_end_to_end() -> None:
    (row,) = main_job.run(schemes=[main_job.Scheme("qb4w:32", "minmax")], with_executorch=False, repeats=1)
    assert row.flow == "xnnquant" and row.scheme == "qb4w:32 minmax" and row.delegates == 1
    # 10.6M int4 weights (5.31 MB) and their bf16 scales (0.66 MB), fp32 biases and norms
    assert 6.0e6 < row.pte_bytes < 6.3e6
    # the measured cosine (0.9628 mean, 0.9363 worst on Zen 2) within a CPU-independent margin
    assert 0.955 < row.cos_mean < 0.97 and 0.92 < row.cos_worst <= row.cos_mean
    assert row.latency_ms > 0 and row.cpu_ms > 0 and row.export_s > 0


def test_table_format() -> None:
    rows = [main_job.Row("xnnquant", "fp32", 42_620_000, 1.234, 5.678, 9.876, 1, 1.0, 0.99999),
            main_job.Row("ExecuTorch", "int4 g32 (torchao)", 6_180_000, 28.4, 2.24, 13.456, 24, 0.9625, 0.9327)]
    assert main_job.format_rows(rows).splitlines() == [
        "| flow | scheme | .pte size | export time | latency | CPU 1 thread | delegates | cos mean | cos worst |",
        "|---|---|---|---|---|---|---|---|---|",
        "| xnnquant | fp32 | 42.62 MB | 1.23 s | 5.68 ms | 9.88 ms | 1 | 1.0000 | 1.0000 |",
        "| ExecuTorch | int4 g32 (torchao) | 6.18 MB | 28.40 s | 2.24 ms | 13.46 ms | 24 | 0.9625 | 0.9327 |"]


def test_scheme_labels_and_file_names() -> None:
    labels = [str(s) for s in main_job.SCHEMES]
    assert labels == ["fp32", "qc8w mse", "qc8w mse, calibrated", "qb4w:32 minmax", "qb4w:32 mse"]
    assert [main_job.file_name("xnnquant", label) for label in labels[1:3]] == [
        "xnnquant-qc8w-mse.pte", "xnnquant-qc8w-mse-calibrated.pte"]
    assert main_job.file_name("ExecuTorch", "int4 g32 (torchao)") == "executorch-int4-g32-torchao.pte"
