"""The public names of the front end: functions that stay functions, no torch at import."""

from __future__ import annotations

import subprocess
import sys


def test_export_check_and_verify_are_functions_beside_their_package() -> None:
    code = (
        "import sys, types, xnnquant as xq\n"
        "import xnnquant.frontend.lowering.linear, xnnquant.graph.divergence, xnnquant.cli\n"
        "from xnnquant.frontend import lowering\n"
        "assert isinstance(xq.export, types.FunctionType) and xq.export.__module__ == 'xnnquant.frontend.api'\n"
        "assert isinstance(xq.check, types.FunctionType) and xq.check.__module__ == 'xnnquant.frontend.api'\n"
        "assert isinstance(xq.verify, types.FunctionType) and xq.verify.__module__ == 'xnnquant.frontend.divergence'\n"
        "assert lowering.__name__ == 'xnnquant.frontend.lowering'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_importing_xnnquant_and_its_front_end_does_not_import_torch() -> None:
    code = ("import sys, xnnquant, xnnquant.frontend, xnnquant.frontend.api, xnnquant.frontend.exported\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
