"""The notebooks are committed executed, with their question, plots and conclusion.

``make test`` re-executes them with nbmake (the heaviest three on fewer configurations,
``XNNQUANT_QUICK_NOTEBOOKS=1``; ``make notebooks`` runs them whole); this file checks the
committed copies (whole runs), so a notebook saved without outputs, with a failed
cell, or without its conclusion is caught even where nbmake is not run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
EXPECTED = ("scheme_accuracy", "bf16_scales", "activations", "outliers", "activation_aware", "executorch_flow",
            "static_int8", "llm_schemes", "llm_bytes")


def _cells(name: str) -> list[dict]:
    return json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8"))["cells"]


def _text(cell: dict) -> str:
    source = cell["source"]
    return source if isinstance(source, str) else "".join(source)


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_opens_with_its_question_and_ends_with_a_conclusion(name: str) -> None:
    cells = _cells(name)
    assert cells[0]["cell_type"] == "markdown" and "**Question.**" in _text(cells[0])
    assert cells[-1]["cell_type"] == "markdown" and _text(cells[-1]).startswith("## Conclusion")
    assert any(ch.isdigit() for ch in _text(cells[-1])), "the conclusion states measured numbers"


@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_is_committed_executed_with_plots(name: str) -> None:
    code = [c for c in _cells(name) if c["cell_type"] == "code"]
    assert code and all(c["execution_count"] is not None for c in code), "every code cell was executed"
    outputs = [o for c in code for o in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] == "error"], "no cell failed"
    assert any("image/png" in o.get("data", {}) for o in outputs), "plots are saved in the outputs"


def test_readme_links_every_notebook() -> None:
    readme = (NOTEBOOKS / "README.md").read_text(encoding="utf-8")
    for name in EXPECTED:
        assert f"]({name}.ipynb)" in readme, name
