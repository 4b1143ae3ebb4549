"""Regenerate the flatbuffers code from the project's schemas with the pinned ``flatc``.

Three schemas, each with its generated module: ``schema.fbs`` (XN01, node kinds 1..37) ->
``schema_generated.py``, ``schema_141.fbs`` (ExecuTorch 1.4.1's additions on top) ->
``schema_141_generated.py``, and ExecuTorch's program format ``../pte/program.fbs``
(ET12, which includes ``scalar_type.fbs``) -> ``../pte/program_generated.py``.
``python -m xnnquant.graph.codegen`` (what ``make
flatbuffers`` runs) writes the files in place; ``python -m xnnquant.graph.codegen --check``
only reports whether the committed files are what the schemas generate.  The compiler is flatc 24.3.25 as shipped in the
``executorch`` wheel (``executorch/data/bin/flatc``, also exposed as ``.venv/bin/flatc``),
matching the pinned ``flatbuffers`` Python runtime.  Options: ``--python --gen-onefile``,
which gives one self-contained module that imports nothing but ``flatbuffers``; for a schema
that includes another, ``--gen-all`` as well, so the included declarations go into the
same module.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import MissingExtraError

FLATC_VERSION = "24.3.25"
FLATC_OPTIONS = ("--python", "--gen-onefile")
HERE = Path(__file__).resolve().parent
SCHEMA = HERE / "schema.fbs"
GENERATED = HERE / "schema_generated.py"
SCHEMA_141 = HERE / "schema_141.fbs"
GENERATED_141 = HERE / "schema_141_generated.py"
PTE_SCHEMA = HERE.parent / "pte" / "program.fbs"
PTE_GENERATED = HERE.parent / "pte" / "program_generated.py"
#: (schema, its generated module), every pair ``make flatbuffers`` keeps in step.
SCHEMAS: tuple[tuple[Path, Path], ...] = ((SCHEMA, GENERATED), (SCHEMA_141, GENERATED_141),
                                          (PTE_SCHEMA, PTE_GENERATED))


def find_flatc() -> Path:
    """Path of the pinned flatc: next to this interpreter, else inside the executorch wheel."""
    candidates = [Path(sys.executable).parent / "flatc"]
    spec = importlib.util.find_spec("executorch")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            candidates.append(Path(root) / "data" / "bin" / "flatc")
    for path in candidates:
        if path.is_file():
            return path
    raise MissingExtraError(
        "regenerating the flatbuffers code needs flatc " + FLATC_VERSION + ", which ships in the "
        "executorch wheel: install the extra with  pip install 'xnnquant[xnnpack]'"
    )


def flatc_version(flatc: Path) -> str:
    out = subprocess.run([str(flatc), "--version"], capture_output=True, text=True, check=True)
    return out.stdout.strip().rsplit(" ", 1)[-1]


def generate(out_dir: Path, flatc: Path | None = None, schema: Path = SCHEMA) -> Path:
    """Run flatc on ``schema`` into ``out_dir``; returns the generated module's path."""
    flatc = flatc or find_flatc()
    version = flatc_version(flatc)
    if version != FLATC_VERSION:
        raise MissingExtraError(f"flatc version mismatch: got {version} at {flatc}, expected {FLATC_VERSION}")
    includes = ("--gen-all",) if re.search(r'^include\s+"', schema.read_text(), re.M) else ()
    subprocess.run([str(flatc), *FLATC_OPTIONS, *includes, "-o", str(out_dir), str(schema)], check=True)
    return out_dir / f"{schema.stem}_generated.py"


def regenerated_text(schema: Path = SCHEMA) -> str:
    """What ``schema`` generates now, as text (the committed file is not touched)."""
    with tempfile.TemporaryDirectory() as tmp:
        return generate(Path(tmp), schema=schema).read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare, exit 1 on a difference")
    args = parser.parse_args(argv)
    status = 0
    for schema, generated in SCHEMAS:
        with tempfile.TemporaryDirectory() as tmp:
            fresh = generate(Path(tmp), schema=schema)
            same = generated.is_file() and fresh.read_bytes() == generated.read_bytes()
            if args.check:
                print(f"{generated.name}: {'up to date' if same else f'differs from what {schema.name} generates'}")
                status |= 0 if same else 1
                continue
            if not same:
                shutil.copyfile(fresh, generated)
            print(f"{generated.name}: {'unchanged' if same else 'regenerated'}")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
