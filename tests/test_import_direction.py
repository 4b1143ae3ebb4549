"""The folders are the architecture: data flows schemes -> packing -> graph, and the front end
places weights through packing and the Graph builder, never through bytes; its walker and
passes know no op family (families register themselves).

Checked on the source's import statements (absolute and relative, at any depth, including
the ones inside functions), so a lazy import cannot slip past.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import xnnquant
from xnnquant.frontend.lowering import FAMILIES as LOWERING_FAMILIES

PACKAGE = Path(xnnquant.__file__).parent

#: package -> modules it must never import (dotted names below ``xnnquant``).
FAMILIES = tuple(f"frontend.lowering.{f}" for f in LOWERING_FAMILIES)
FORBIDDEN = {
    "schemes": ("packing", "graph", "xnnpack", "frontend", "pte", "cli"),
    "packing": ("graph", "frontend", "pte", "cli"),
    "graph": ("frontend", "cli"),
    "pte": ("frontend", "cli"),
    "frontend": ("graph.writer", "graph.schema_generated", "graph.schema_141_generated", "graph.segment",
                 "graph.header", "graph.bounds", "cli"),
    # the walker, the context and the passes know no op family: families register themselves
    "frontend/lowering/walk.py": FAMILIES,
    "frontend/lowering/context.py": FAMILIES,
    "frontend/passes": FAMILIES,
}


def imported_modules(path: Path) -> set[str]:
    """Every ``xnnquant`` module ``path`` imports, as dotted names below ``xnnquant``."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        found.update(n[len("xnnquant."):] for n in names if n.startswith("xnnquant."))
    return found


def _violations(package: str) -> list[str]:
    out = []
    where = PACKAGE / package
    for path in sorted(where.rglob("*.py") if where.is_dir() else [where]):
        for module in sorted(imported_modules(path)):
            for banned in FORBIDDEN[package]:
                if module == banned or module.startswith(banned + "."):
                    out.append(f"{path.relative_to(PACKAGE)} imports xnnquant.{module}")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_import_direction(package: str) -> None:
    assert (PACKAGE / package).exists(), f"xnnquant/{package} is gone: update FORBIDDEN"
    assert _violations(package) == []


def test_the_check_sees_relative_and_lazy_imports() -> None:
    """The checker itself: a relative import inside a function is found."""
    sample = PACKAGE / "schemes" / "per_tensor.py"
    assert "tensor" in imported_modules(sample) and "schemes.kernels" in imported_modules(sample)
    assert "graph.writer" in imported_modules(PACKAGE / "graph" / "builder.py")  # `from .writer import` in a method
