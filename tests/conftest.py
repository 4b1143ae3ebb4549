"""Shared test set-up.

Tests that need the real XNNPACK carry ``@pytest.mark.xnnpack``.  Locally, without the
``xnnpack`` extra, they are skipped; under CI (``CI=true``) a missing extra is a failure,
so a broken install can never turn the oracle tests into silent skips.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

HAVE_EXECUTORCH = importlib.util.find_spec("executorch") is not None
IN_CI = os.environ.get("CI", "").lower() == "true"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_EXECUTORCH:
        return
    for item in items:
        if "xnnpack" in item.keywords:
            if IN_CI:
                raise pytest.UsageError(f"{item.nodeid} needs executorch==1.4.1, which CI must install")
            item.add_marker(pytest.mark.skip(reason="needs the xnnpack extra (executorch==1.4.1)"))
