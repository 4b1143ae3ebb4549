"""The main job's table: sizes derived by hand, every scheme present."""

import numpy as np
import pytest

from xnnquant import cli
from xnnquant.cli.weights_report import default_schemes, format_table, measure


def test_sizes_and_rows_on_a_small_weight():
    rng = np.random.default_rng(1)
    weights = {"a": rng.standard_normal((4, 64)).astype(np.float32)}
    rows = measure(weights, default_schemes(group_sizes=(32,)))
    by = {(r.scheme.label, r.scheme.method): r for r in rows}
    # qcint8: 256 one-byte codes + 4 fp32 scales = 272 bytes
    assert by[("qcint8 per-channel", "minmax")].nbytes == 272
    # qcint4: 4 rows x 32 bytes + 4 fp32 scales = 144 bytes
    assert by[("qcint4 per-channel", "mse")].nbytes == 144
    # qbint4 g=32: 128 bytes of nibbles + 8 bf16 scales = 144 bytes, 4.5 bits per weight
    assert by[("qbint4 group 32", "minmax")].nbytes == 144
    assert by[("qbint4 group 32", "minmax")].bits_per_weight == 4.5
    # the searched scales never lose to min-max on the same grid
    assert by[("qbint4 group 32", "mse")].sqnr_all >= by[("qbint4 group 32", "minmax")].sqnr_all
    assert "qint8 per-tensor" in format_table(rows, 256)


def test_cli_reports_bad_group_size_as_an_error(capsys, monkeypatch):
    import xnnquant.models.weights as weights

    monkeypatch.setattr(weights, "minilm_linears", lambda: {"w": np.ones((2, 96), np.float32)})
    assert cli.main(["report", "--group-sizes", "40"]) == 2
    assert "group_size" in capsys.readouterr().err


def test_cli_needs_a_command():
    with pytest.raises(SystemExit):
        cli.main([])
