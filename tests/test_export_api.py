"""The public names of the front end: functions that stay functions, no torch at import."""

from __future__ import annotations

import subprocess
import sys


def test_export_and_verify_stay_functions_after_importing_their_modules() -> None:
    code = (
        "import sys, types, xnnquant as xq\n"
        "import xnnquant.export.lowering, xnnquant.export.linear, xnnquant.verify, xnnquant.cli\n"
        "from xnnquant.verify import random_inputs\n"
        "from xnnquant.export import lowering\n"
        "assert isinstance(xq.export, types.FunctionType) and xq.export.__module__ == 'xnnquant.export.api'\n"
        "assert isinstance(xq.verify, types.FunctionType) and xq.verify.__module__ == 'xnnquant.export.divergence'\n"
        "assert lowering.__name__ == 'xnnquant.export.lowering'\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_importing_xnnquant_and_its_front_end_does_not_import_torch() -> None:
    code = ("import sys, xnnquant, xnnquant.export, xnnquant.export.api, xnnquant.export.exported\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
