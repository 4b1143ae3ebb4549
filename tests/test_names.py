"""One name, one meaning: the renamed modules and the deprecated aliases of public names."""

from __future__ import annotations

import importlib
import types

import pytest

import xnnquant as xq
from xnnquant.graph import layout


def test_graph_validate_is_the_function_and_rules_the_module() -> None:
    rules = importlib.import_module("xnnquant.graph.rules")
    assert isinstance(rules, types.ModuleType)
    assert xq.graph.validate is rules.validate  # importing the module did not shadow the function
    assert callable(xq.graph.validate)


@pytest.mark.parametrize("old", ["xnnquant.graph.verify", "xnnquant.graph.validate", "xnnquant.graph.runtime",
                                 "xnnquant.graph.constants", "xnnquant.graph.examples", "xnnquant.xnnpack.runtime",
                                 "xnnquant.describe"])
def test_old_module_names_are_gone(old: str) -> None:
    if old == "xnnquant.graph.validate":  # the attribute is the function, never a module
        assert not isinstance(xq.graph.validate, types.ModuleType)
        return
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_xnnpack_quantize_per_token_is_a_deprecated_alias() -> None:
    import xnnquant.xnnpack as xx

    with pytest.warns(DeprecationWarning, match="use xnnquant.xnnpack.convert_f32_qd8"):
        old = xx.quantize_per_token
    assert old is xx.convert_f32_qd8
    assert "quantize_per_token" not in xx.__all__
    with pytest.raises(AttributeError):
        xx.no_such_name  # noqa: B018


def test_seed_node_kinds_is_a_deprecated_alias() -> None:
    with pytest.warns(DeprecationWarning, match="use XN01_NODE_KINDS"):
        old = layout.SEED_NODE_KINDS
    assert old == layout.XN01_NODE_KINDS
    assert len(layout.XN01_NODE_KINDS) == 37 and len(layout.ET141_NODE_KINDS) == 10
    assert not set(layout.XN01_NODE_KINDS) & set(layout.ET141_NODE_KINDS)
    assert all(layout.NODE_KINDS[k].xn01 for k in layout.XN01_NODE_KINDS)
    assert not any(layout.NODE_KINDS[k].xn01 for k in layout.ET141_NODE_KINDS)


def test_graph_reader_fields_moved_to_load_info() -> None:
    from xnnquant.graph import Graph, load

    built = Graph()
    x = built.input((1, 4))
    built.output(built.abs(x))
    assert built.load_info is None
    back = load(built.to_bytes())
    assert back.load_info is not None and back.load_info.num_externs == 2
    for old, built_value, loaded_value in [("declared_num_externs", None, 2), ("identifier", "XN01", "XN01"),
                                           ("legacy_inline_constants", False, False), ("named_keys", [], []),
                                           ("missing_named_keys", [], []), ("version", "0", "0")]:
        for graph, want in ((built, built_value), (back, loaded_value)):
            with pytest.warns(DeprecationWarning, match=f"Graph.{old} is deprecated: use Graph.load_info"):
                assert getattr(graph, old) == want
    with pytest.raises(AttributeError):
        built.no_such_attribute  # noqa: B018
    assert not hasattr(built, "summary")  # describe() in xnnquant.cli.summary does its job
