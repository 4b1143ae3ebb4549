"""XNNPACK's and ExecuTorch's numbers live in xnnquant/constants.py, and only there."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from xnnquant import constants

PACKAGE = Path(constants.__file__).parent

#: Numbers of constants.py that no other module may write as a literal.
RESTATED = {1.00389105: "RUNTIME_BF16_FACTOR", 0xFFFFFFFF: "XNN_INVALID_VALUE_ID", 4096: "MAX_NUM_EXTERNS"}


def _sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if p.name not in ("constants.py", "schema_generated.py")]


def test_no_module_restates_a_constant() -> None:
    """Code, not prose: literals and ``finfo(...).tiny`` in the syntax tree of each module."""
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(PACKAGE)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value in RESTATED:
                pytest.fail(f"{where} restates {RESTATED[node.value]} ({node.value!r})")
            if isinstance(node, ast.Attribute) and node.attr == "tiny":
                pytest.fail(f"{where} restates FLT_MIN (finfo(...).tiny)")


def test_no_module_defines_an_alignment_of_its_own() -> None:
    for path in _sources():
        found = re.findall(r"^\s*[A-Z_]*ALIGNMENT\s*=", path.read_text(), re.M)
        assert not found, f"{path.relative_to(PACKAGE)} defines {found}: use xnnquant.constants"


def test_values() -> None:
    # include/xnnpack.h and src/xnnpack/common.h at XNNPACK 1adaa7c7; <float.h>
    assert (constants.XNN_MAX_TENSOR_DIMS, constants.XNN_MIN_BLOCKSIZE) == (6, 32)
    assert constants.XNN_FLAG_TRANSPOSE_WEIGHTS == constants.XNN_FLAG_TRANSPOSE_B == 1
    assert constants.XNN_ALLOCATION_ALIGNMENT == 64 and constants.CONSTANT_TENSOR_ALIGNMENT == 16
    assert np.float32(2.0**-126) == constants.FLT_MIN and constants.FLT_MIN.dtype == np.float32
    assert constants.RUNTIME_BF16_FACTOR.dtype == np.float32


@pytest.mark.xnnpack
def test_constant_tensor_alignment_is_executorchs() -> None:
    """Read from ExecuTorch 1.4.1's own serializer source (not imported: that registers its backend)."""
    spec = importlib.util.find_spec("executorch")
    assert spec is not None and spec.submodule_search_locations
    source = Path(next(iter(spec.submodule_search_locations))) / "backends/xnnpack/serialization/xnnpack_graph_serialize.py"
    found = re.search(r"^CONSTANT_TENSOR_ALIGNMENT\s*=\s*(\d+)", source.read_text(), re.M)
    assert found and int(found.group(1)) == constants.CONSTANT_TENSOR_ALIGNMENT
