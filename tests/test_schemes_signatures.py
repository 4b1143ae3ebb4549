"""Every scheme exposes the same verbs, and caller-given parameters are keyword-only."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.schemes import bias, blockwise, per_channel, per_tensor, per_token

SCHEMES = [per_tensor, per_channel, blockwise, bias, per_token]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_same_verbs(scheme) -> None:
    for verb in ("choose_qparams", "quantize", "dequantize"):
        assert callable(getattr(scheme, verb)), verb
    assert list(inspect.signature(scheme.dequantize).parameters) == ["qt"]


@pytest.mark.parametrize("scheme, given", [(per_tensor, ("scale", "zero_point", "symmetric")),
                                           (per_channel, ("scale",)), (blockwise, ("scale",))],
                         ids=["per_tensor", "per_channel", "blockwise"])
def test_given_parameters_are_keyword_only(scheme, given: tuple[str, ...]) -> None:
    parameters = inspect.signature(scheme.quantize).parameters
    for name in given:
        assert parameters[name].kind is inspect.Parameter.KEYWORD_ONLY, name


def test_per_tensor_positional_use_still_works_with_a_warning() -> None:
    x = np.array([1.0, -1.0, 0.25], np.float32)
    want = xq.quantize_per_tensor(x, xq.Datatype.qint8, scale=0.5, zero_point=3)
    with pytest.warns(DeprecationWarning, match=r"pass scale, zero_point by keyword \(scale=...\)"):
        got = xq.quantize_per_tensor(x, xq.Datatype.qint8, 0.5, 3)
    assert np.array_equal(got.codes, want.codes) and got.zero_point == want.zero_point == 3
    with pytest.warns(DeprecationWarning), pytest.raises(xq.XnnquantError, match="both by position and by keyword"):
        xq.quantize_per_tensor(x, xq.Datatype.qint8, 0.5, scale=0.5, zero_point=3)
    with pytest.warns(DeprecationWarning, match="pass scale, zero_point, symmetric by keyword"):
        sym = xq.quantize_per_tensor(x, xq.Datatype.qint8, None, None, True)
    assert sym.zero_point == xq.quantize_per_tensor(x, symmetric=True).zero_point == 0
