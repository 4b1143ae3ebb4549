"""Quantized embedding tables: ``xq.export(..., embeddings="int8" | "int4:G")``.

Oracles: golden bytes derived by hand for tiny tables, read back from the ``.pte`` by
ExecuTorch's own deserializer; ExecuTorch 1.4.1's quantized embedding kernels on its
runtime, whose rows must equal ``(code - 0) * scale`` computed in numpy from those bytes,
exactly (float32: one product per value, no sum); all-MiniLM-L6-v2 whole against the float
module.  What the kernels compute is drawn in ``xnnquant/pte/quantized.py``.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import xnnquant as xq

torch = pytest.importorskip("torch")
nn = torch.nn
pytestmark = pytest.mark.xnnpack


class Lookup(nn.Module):
    """ids -> (the rows looked up, a linear of them): the first output is the kernel's own."""

    def __init__(self, table: np.ndarray) -> None:
        super().__init__()
        self.table = nn.Embedding(*table.shape)
        self.dense = nn.Linear(table.shape[1], 4)
        with torch.no_grad():
            self.table.weight.copy_(torch.from_numpy(table))

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.table(ids)
        return rows, self.dense(rows)


def _lookup(table: np.ndarray) -> nn.Module:
    torch.manual_seed(0)
    return Lookup(np.asarray(table, np.float32)).eval()


#: (numpy dtype, bytes per element) of the ExecuTorch scalar types read here.
_SCALAR = {1: (np.int8, 1), 0: (np.uint8, 1), 6: (np.float32, 4), 15: (ml_dtypes.bfloat16, 2)}


def _kernel_tables(pte: bytes, kernel: str) -> tuple[np.ndarray, np.ndarray]:
    """(weight, scales) constants of the calls of ``kernel`` ("quantized_decomposed::embedding_byte"),
    read with ExecuTorch's deserializer."""
    from executorch.exir._serialize import _deserialize_pte_binary
    from executorch.exir.schema import KernelCall

    program = _deserialize_pte_binary(pte).program
    plan = program.execution_plan[0]
    calls = [i.instr_args for i in plan.chains[0].instructions if isinstance(i.instr_args, KernelCall)]
    found = [c for c in calls if plan.operators[c.op_index].name == kernel]
    call = found[0]
    assert plan.operators[call.op_index].overload == "dtype_out"
    assert all(c.args[:2] == call.args[:2] for c in found)  # the lookups of one table share its constants
    arrays = []
    for index in call.args[:2]:
        tensor = plan.values[index].val
        dtype, size = _SCALAR[int(tensor.scalar_type)]
        count = int(np.prod(tensor.sizes))
        data = bytes(program.constant_buffer[tensor.data_buffer_idx].storage)[: count * size]
        arrays.append(np.frombuffer(data, dtype).reshape(tuple(tensor.sizes)))
    return arrays[0], arrays[1]


def _decoded(weight: np.ndarray, scales: np.ndarray, dim: int) -> np.ndarray:
    """(code - 0) * scale in numpy float32, from the stored bytes (high nibble first for 4 bits)."""
    if weight.dtype == np.uint8:
        codes = np.empty((weight.shape[0], dim), np.int8)
        codes[:, 0::2] = (weight >> 4).astype(np.int8) - 8
        codes[:, 1::2] = (weight & 15).astype(np.int8) - 8
    else:
        codes = weight
    scale = scales.astype(np.float32).reshape(weight.shape[0], -1)
    return codes.astype(np.float32) * np.repeat(scale, dim // scale.shape[1], axis=1)


# ---------------------------------------------------------------- the kernels themselves


def test_the_schemas_are_executorchs() -> None:
    """The schemas the programs are written by are the installed quantized.yaml's, and the
    runtime registers their kernels once the quantized kernels are loaded."""
    from importlib import resources

    from executorch.extension.pybindings import portable_lib

    from xnnquant.pte.quantized import SCHEMAS, load_quantized_kernels

    yaml = resources.files("executorch.kernels.quantized").joinpath("quantized.yaml").read_text()
    declared = {line.removeprefix("- func: ").strip() for line in yaml.splitlines() if line.startswith("- func: ")}
    assert set(SCHEMAS.values()) <= declared
    load_quantized_kernels()
    assert {f"quantized_decomposed::{key}" for key in SCHEMAS} <= set(portable_lib._get_operator_names())


def _raw_program(overload: str, weight: np.ndarray, scales: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``quantized_decomposed::embedding_4bit.<overload>`` alone in a program, run in this process."""
    from executorch.extension.pybindings import portable_lib

    from xnnquant.pte import ProgramBuilder
    from xnnquant.pte.quantized import load_quantized_kernels

    builder = ProgramBuilder()
    m = builder.method("forward")
    index = m.input(m.tensor(np.int64, ids.shape))
    out = m.tensor(np.float32, (*ids.shape, 2 * weight.shape[1]))
    args = [m.tensor(weight.dtype, weight.shape, data=weight), m.tensor(scales.dtype, scales.shape, data=scales),
            m.null(), m.int_value(-8), m.int_value(7), index]
    m.kernel_call("quantized_decomposed::embedding_4bit", overload, [*args, *([m.null()] if overload ==
                                                                              "dtype_out" else []), out, out])
    m.output(out)
    load_quantized_kernels()
    pte = builder.to_bytes()  # the module reads its constants from these bytes: kept alive past the run
    program = portable_lib._load_for_executorch_from_buffer(pte)
    out = np.array(program.run_method("forward", [torch.from_numpy(ids)])[0].numpy())  # a copy
    del program, pte
    return out


def test_dtype_out_reads_narrow_scales() -> None:
    """``dtype_out`` reads float32, float16 and bf16 scales as they are.  ``.out`` reads the
    scales as its out tensor's dtype (float32), unchecked, so it is run here on float32
    scales only: on narrow ones it reads past their buffer, which is why the tables'
    lookups are written with ``dtype_out``.  (This test was flaky, failing with 0x12 or
    aborting after other tests, while ``_raw_program`` let the program's bytes be freed
    before the run: ExecuTorch's ``_load_for_executorch_from_buffer`` keeps a pointer into
    them, not a reference.)"""
    rng = np.random.default_rng(5)
    weight = rng.integers(0, 256, (3, 4), dtype=np.uint8)  # (V, D / 2): D = 8, groups of 4
    scales = (rng.random((3, 2)) + 0.5).astype(np.float32)
    ids = np.array([[2, 0, 1]], np.int64)
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        narrow = scales.astype(dtype)
        want = _decoded(weight, narrow, 8)[ids]
        assert np.array_equal(_raw_program("dtype_out", weight, narrow, ids), want)
    assert np.array_equal(_raw_program("out", weight, scales, ids), _decoded(weight, scales, 8)[ids])


def test_every_pair_of_int4_codes_packs_high_nibble_first() -> None:
    from xnnquant.packing import pack_int4_high_first

    first, second = np.meshgrid(np.arange(-8, 8), np.arange(-8, 8), indexing="ij")
    pairs = np.stack([first.ravel(), second.ravel()], axis=1).astype(np.int8)  # all 256 pairs, one a row
    packed = pack_int4_high_first(pairs)
    assert packed.shape == (256, 1) and packed.dtype == np.uint8
    assert packed[:, 0].tolist() == [(a + 8) << 4 | (b + 8) for a, b in pairs.tolist()]
    with pytest.raises(xq.XnnquantError) as info:
        pack_int4_high_first(np.zeros((2, 3), np.int8))
    assert str(info.value) == ("codes packed high nibble first need an even last dim (two codes a byte): got "
                               "shape (2, 3)")


# ---------------------------------------------------------------- golden bytes

# int8, minmax: scale = max|row| / 127.5, codes = rint(x / scale) clipped to [-128, 127].
#   row 0: max 1.9921875 = 127.5 / 64 -> scale 1/64; -127.5 -> -128 (ties to even), 64, 32, -1
#   row 1: all zero -> scale 1.0, codes 0
#   row 2: max 0.498046875 = 127.5 / 256 -> scale 1/256; 127.5 -> 128 -> 127, -64, 0, 1
INT8_TABLE = [[-1.9921875, 1.0, 0.5, -0.015625], [0.0, 0.0, 0.0, 0.0], [0.498046875, -0.25, 0.0, 0.00390625]]
INT8_CODES = bytes([0x80, 0x40, 0x20, 0xFF, 0, 0, 0, 0, 0x7F, 0xC0, 0x00, 0x01])
INT8_SCALES = bytes.fromhex("0000803c" "0000803f" "0000803b")  # 1/64, 1.0, 1/256: float32 little-endian

# int4 in groups of 2, minmax: scale = bf16(max|group| / 7.5), codes in [-8, 7].
#   row 0: [0.9375, -0.5] -> scale 1/8, codes 7.5 -> 8 -> 7, -4;  [-0.46875, 0.125] -> 1/16, -7.5 -> -8, 2
#   row 1: [0, 0] -> scale 1.0, codes 0, 0;                        [1.875, -0.25] -> 1/4, 7, -1
#   stored nibble = code + 8, the first code of each pair in the HIGH nibble:
#   row 0: 15, 4, 0, 10 -> 0xF4 0x0A;  row 1: 8, 8, 15, 7 -> 0x88 0xF7
INT4_TABLE = [[0.9375, -0.5, -0.46875, 0.125], [0.0, 0.0, 1.875, -0.25]]
INT4_CODES = bytes([0xF4, 0x0A, 0x88, 0xF7])
INT4_SCALES = bytes.fromhex("003e" "803d" "803f" "803e")  # bf16 1/8, 1/16, 1.0, 1/4, little-endian


@pytest.mark.parametrize(("scheme", "table", "kernel", "codes", "scales"), [
    ("int8", INT8_TABLE, "quantized_decomposed::embedding_byte", INT8_CODES, INT8_SCALES),
    ("int4:2", INT4_TABLE, "quantized_decomposed::embedding_4bit", INT4_CODES, INT4_SCALES),
])
def test_the_stored_table_is_the_golden_bytes(scheme: str, table: list, kernel: str, codes: bytes,
                                              scales: bytes) -> None:
    module = _lookup(np.array(table))
    rows = len(table)
    ids = torch.tensor([[rows - 1, 0] * 2])
    exported = xq.export(module, (ids,), weights="fp32", embeddings=scheme, method="minmax", progress=False)
    weight, scale = _kernel_tables(exported.to_pte(), kernel)
    assert weight.tobytes() == codes and scale.tobytes() == scales
    assert scale.dtype == (np.float32 if scheme == "int8" else ml_dtypes.bfloat16)
    row = exported.report[0]
    assert (row.path, row.shape, row.scheme) == ("table", (rows, 4), scheme)
    assert row.nbytes == len(codes) + len(scales)
    report = json.loads(exported.to_json())
    assert report["summary"]["embeddings"] == scheme and report["rows"][0]["scheme"] == scheme
    assert str(exported).startswith(f"xnnquant export: weights fp32, embeddings {scheme}, method minmax, ")
    assert (f"  portable: {kernel.replace('::', '.')} x1 (embeddings={scheme!r}: ExecuTorch's quantized embedding "
            "kernel (quantized_ops_lib)); modules table") in str(exported)


# ---------------------------------------------------------------- the runtime's rows


@pytest.mark.parametrize(("scheme", "kernel", "db"), [
    ("int8", "quantized_decomposed::embedding_byte", 40.0),
    ("int4:16", "quantized_decomposed::embedding_4bit", 18.0),
])
def test_the_runtime_rows_are_code_times_scale(scheme: str, kernel: str, db: float) -> None:
    table = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    module = _lookup(table)
    ids = torch.arange(64).reshape(2, 32).flip(1)  # every row, not in order
    exported = xq.export(module, (ids,), weights="fp32", embeddings=scheme, progress=False)
    weight, scales = _kernel_tables(exported.to_pte(), kernel)
    decoded = _decoded(weight, scales, 32)
    rows, _ = exported.run(ids)
    assert np.array_equal(rows, decoded[ids.numpy()])  # exact: one float32 product per value
    # the report's SQNR is the stored table's (float64 sums here, float32 pieces there)
    sqnr = 10 * np.log10(np.sum(table.astype(np.float64) ** 2) / np.sum((table - decoded).astype(np.float64) ** 2))
    assert abs(exported.report[0].sqnr_db - sqnr) < 1e-3 and sqnr > db  # Gaussian rows: int8 ~43 dB, int4 ~21 dB


class Tokens(nn.Module):
    """int32 token ids, a dynamic length, the table looked up twice."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(100, 32)
        self.dense = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.dense(self.tokens(ids) + self.tokens(ids.flip(1))))


def test_int32_ids_dynamic_lengths_and_a_shared_table() -> None:
    torch.manual_seed(0)
    module = Tokens().eval()
    ids = torch.randint(0, 100, (1, 7), dtype=torch.int32)
    exported = xq.export(module, (ids,), weights="fp32", embeddings="int4:8", progress=False,
                         dynamic_shapes=({1: torch.export.Dim("seq", max=48)},))
    assert [r.path for r in exported.report] == ["tokens", "dense"]  # one table, stored once
    assert sum(p.op == "quantized_decomposed.embedding_4bit" for p in exported.placement) == 2
    deq = torch.nn.Embedding.from_pretrained(torch.from_numpy(_decoded(
        *_kernel_tables(exported.to_pte(), "quantized_decomposed::embedding_4bit"), 32)))
    for length in (1, 9, 48):
        ids = torch.randint(0, 100, (1, length), generator=torch.Generator().manual_seed(length), dtype=torch.int32)
        (got,) = exported.run(ids)
        with torch.no_grad():
            want = torch.relu(module.dense(deq(ids.long()) + deq(ids.long().flip(1)))).numpy()
        # float work in XNNPACK: a few ulps of sums of 32 products, far below 1e-5 of the largest value
        assert got.shape == (1, length, 16) and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def _bad_id_program() -> tuple[xq.Exported, np.ndarray]:
    module = _lookup(np.random.default_rng(0).standard_normal((10, 8)))
    exported = xq.export(module, (torch.tensor([[1, 2, 3]]),), weights="fp32", embeddings="int8", progress=False)
    return exported, np.array([[1, 10, 3]], np.int64)


def test_an_id_out_of_range_is_an_error() -> None:
    """The guard (a portable lookup of the ids in a (V, 1) table before the quantized kernel)
    fails the method with an error, as the float32 program's lookup does."""
    exported, bad = _bad_id_program()
    with pytest.raises(xq.XnnquantError) as info:
        exported.run(bad)
    assert str(info.value) == ("the ExecuTorch runtime failed to run method 'forward': Failed to execute method "
                               "forward, error: 0x12")


@pytest.mark.slow
def test_without_the_guard_a_bad_id_aborts_the_runtime() -> None:
    """Why the guard is there: embedding_byte checks ids with ET_CHECK, which aborts the
    process.  Run in the runtime's worker process (a crash is a ``RuntimeCrashError`` there)."""
    from xnnquant.graph.worker import worker
    from xnnquant.pte.run import run_method

    exported, bad = _bad_id_program()
    method = exported.builder.methods[0]
    guard = next(k for k, call in enumerate(method.instructions)
                 if method.operators[call.op_index] == ("aten::embedding", "out"))
    del method.instructions[guard]
    with pytest.raises(xq.RuntimeCrashError, match="Index out of bounds for weight: index 10 must be in range"):
        worker().call(run_method, (exported.builder.to_bytes(), "forward", [bad]), 120, "running the program")


# ---------------------------------------------------------------- MiniLM whole

#: Cosine of each sentence embedding to the float module's, at least (fp32 linears, so the
#: table alone differs; measured on the 16 sample sentences: int8 >= 0.99998, int4:32 >= 0.9983).
COSINE = {"int8": 0.9999, "int4:32": 0.997}


def test_minilm_whole_with_quantized_tables() -> None:
    from xnnquant.models import minilm, minilm_torch

    module = minilm_torch.sentence_encoder()
    inputs = minilm_torch.sentence_inputs(minilm.SAMPLE_SENTENCES)
    program = torch.export.export(module, inputs, strict=False)  # traced once, exported three times
    with torch.no_grad():
        want = module(*inputs).numpy()
    sizes = {None: len(xq.export(program, weights="fp32", progress=False).to_pte())}
    table = 30522 * 384
    for scheme, stored in (("int8", table + 4 * 30522), ("int4:32", table // 2 + 2 * table // 32)):
        exported = xq.export(program, weights="fp32", embeddings=scheme, progress=False)
        row = exported.report[0]
        assert (row.path, row.shape, row.scheme, row.nbytes) == ("embeddings.word_embeddings", (30522, 384), scheme,
                                                                 stored)
        sizes[scheme] = len(exported.to_pte())
        # the float table goes, the codes, scales and the guard (one byte a row) come; the rest
        # is the flatbuffer's few new values and 16- / 128-byte paddings (measured: < 500 bytes)
        assert abs((sizes[None] - sizes[scheme]) - (4 * table - stored - 30522)) < 2048
        (got,) = exported.run(*inputs)
        cosine = np.sum(got * want, axis=1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosine.min() >= COSINE[scheme], (scheme, cosine.min())


# ---------------------------------------------------------------- refusals


def test_bad_embeddings_options_are_refused() -> None:
    module = _lookup(np.zeros((4, 6)))
    ids = torch.tensor([[0, 1]])
    forms = ("None (float32 tables), 'int8' (int8 codes, one float32 scale per row) or 'int4:G' (int4 codes, one "
             "bf16 scale per group of G values along the embedding dim, e.g. 'int4:32')")
    for bad in ("int3", "int4", "int4:0", "int4:x", 8, "qc8w"):
        with pytest.raises(xq.XnnquantError) as info:
            xq.export(module, (ids,), embeddings=bad, progress=False)
        assert str(info.value) == f"unknown embeddings scheme: got {bad!r}, expected {forms}"
    with pytest.raises(xq.XnnquantError) as info:
        xq.export(module, (ids,), weights="fp32", embeddings="int8", strict=True, progress=False)
    assert str(info.value) == (
        "embeddings='int8' stores the tables for ExecuTorch's quantized embedding kernels, which run outside XNNPACK, "
        "and strict=True keeps one pure XNNPACK graph: expected embeddings=None with strict=True, or strict=False")


def test_tables_that_cannot_take_the_scheme_are_refused_by_name() -> None:
    ids = torch.tensor([[0, 1]])
    six = torch.export.export(_lookup(np.zeros((4, 6))), (ids,), strict=False)  # traced once, checked twice
    report = xq.check(six, weights="fp32", embeddings="int4:4")
    assert not report.ok and report.refused == [
        "embedding table 'table.weight' (4x6; node embedding, module table) cannot take embeddings='int4:4': the group "
        "size must divide the embedding dim: got group size 4, embedding_dim 6 (group sizes that do: 1, 2, 3, 6)"]
    with pytest.raises(xq.UnsupportedConfigError) as info:
        xq.export(_lookup(np.zeros((4, 5))), (ids,), weights="fp32", embeddings="int4:5", progress=False)
    assert str(info.value) == (
        "export refused 1 node(s) or layer(s):\n  - embedding table 'table.weight' (4x5; node embedding, module table) "
        "cannot take embeddings='int4:5': int4 codes are packed two a byte along the embedding dim, which must be "
        "even: got embedding_dim 5")
    fine = xq.check(six, weights="fp32", embeddings="int4:3")
    assert fine.ok and [(r.path, r.scheme) for r in fine.weights] == [("table", "int4:3"), ("dense", "fp32")]


FACTORY = textwrap.dedent("""
    import torch

    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(50, 32)
            self.dense = torch.nn.Linear(32, 8)

        def forward(self, ids):
            return self.dense(self.tokens(ids))

    def tokens():
        torch.manual_seed(0)
        return Tokens().eval(), (torch.randint(0, 50, (2, 5)),)
""")


def test_the_cli_takes_embeddings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  capsys: pytest.CaptureFixture) -> None:
    from xnnquant import cli

    (tmp_path / "embedding_models.py").write_text(FACTORY)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "tokens.pte"
    assert cli.main(["export", "embedding_models:tokens", "-o", str(out), "--weights", "qc8w", "--embeddings",
                     "int8", "--json", "--no-progress"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["embeddings"] == "int8"
    assert [(r["path"], r["scheme"]) for r in report["rows"]] == [("tokens", "int8"), ("dense", "qc8w")]
