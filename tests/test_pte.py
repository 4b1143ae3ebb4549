"""``read_pte`` on programs ExecuTorch 1.4.1 wrote, and on broken ones.

Oracles: ExecuTorch 1.4.1 (its flow wrote the programs and named data, its runtime
computed their outputs) and torchao 0.18 (the codes and scales it chose), both in the
subprocess of ``tests/oracles/et_programs.py`` (the ``et_programs`` fixture).  Our
``.pte`` files for the error cases come from ``xnnquant.graph.to_pte``.
"""

from __future__ import annotations

import contextlib
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from xnnquant import Datatype as D
from xnnquant.errors import MissingExtraError, XnnquantError
from xnnquant.graph import Graph, interpret, to_pte
from xnnquant.graph.header import XNNHeader
from xnnquant.pte import ProgramError, read_ptd, read_pte
from xnnquant.rounding import to_bf16

pytestmark = pytest.mark.xnnpack

LAYERS = ("fc1", "fc2", "fc3")
#: Hang guard of the fuzz tests, not a timing test: a read of these files takes ~10 to 30 ms,
#: but a loaded 2-core CI machine can stall a process for seconds.
MAX_SECONDS = 10.0


def filters(delegate):
    """The filter value of each fully-connected node, in node order."""
    graph = delegate.graph
    return [graph.value(n.inputs[1]) for n in graph.nodes if n.kind == "XNNFullyConnected"]


def test_torchao_program_holds_torchao_codes_and_scales(et_programs: Path) -> None:
    program = read_pte(et_programs / "torchao.pte")
    assert program.methods == ("forward",) and program.other_delegates == ()
    (delegate,) = program.delegates
    assert (delegate.method, delegate.index, delegate.location) == ("forward", 0, "segment")
    assert [n.kind for n in delegate.graph.nodes] == ["XNNConvert", "XNNFullyConnected"] * 3
    weights = filters(delegate)
    assert [w.datatype for w in weights] == [D.qbint4, D.qbint4, D.qcint8]
    assert [w.dims for w in weights] == [(64, 128), (96, 64), (16, 96)]
    assert [w.quant.group_size for w in weights[:2]] == [32, 64]
    for name, weight in zip(LAYERS, weights):
        qt = weight.quantized_tensor()
        np.testing.assert_array_equal(qt.codes, np.load(et_programs / f"torchao_{name}_qdata.npy"))
        assert not np.load(et_programs / f"torchao_{name}_zero_point.npy").any()
        scale = np.load(et_programs / f"torchao_{name}_scale.npy").astype(np.float32)
        if weight.datatype is D.qbint4:  # ExecuTorch rounds fp32 group scales to bf16 (nearest even)
            scale = to_bf16(scale).values
        np.testing.assert_array_equal(qt.scale, scale.reshape(qt.scale.shape))
    assert set(program.named_data_origin.values()) == {"program"}
    assert list(delegate.named_data) == list(dict.fromkeys(delegate.graph.load_info.named_keys))


def test_named_data_in_a_ptd_file(et_programs: Path) -> None:
    inside = read_pte(et_programs / "torchao.pte")
    ptd = et_programs / "model.ptd"
    outside = read_pte(et_programs / "torchao_ext.pte", data_files=[ptd])
    assert outside.delegates[0].graph.values == inside.delegates[0].graph.values
    assert outside.delegates[0].named_data == inside.delegates[0].named_data
    assert set(outside.named_data_origin.values()) == {str(ptd)}
    assert read_ptd(ptd) == outside.named_data
    assert (et_programs / "torchao_ext.pte").stat().st_size < 4000  # the weights left the .pte
    with pytest.raises(ProgramError, match=r"names 8 constant\(s\) that are neither in the program nor in its data files "
                                           r"\(none given; .* as data_files \(xnnquant CLI: --data\) \(beside it: model.ptd\)"):
        read_pte(et_programs / "torchao_ext.pte")


@pytest.mark.parametrize("name", ["torchao", "torchao_ext"])
def test_interpreter_on_the_delegate_matches_the_program_run(et_programs: Path, name: str) -> None:
    program = read_pte(et_programs / f"{name}.pte", data_files=[et_programs / "model.ptd"] if "ext" in name else [])
    x = np.load(et_programs / f"input_{name}.npy")
    want = np.load(et_programs / f"output_{name}.npy")
    got = interpret(program.delegates[0].graph, [x])[0]
    # float sums in another order, amplified by per-token quantization of near-tie values
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_methods_and_delegates_of_a_three_method_program(et_programs: Path) -> None:
    program = read_pte(et_programs / "xnnquant.pte")
    assert program.methods == ("forward", "head", "weight_only")
    assert [d.name for d in program.delegates] == ["forward/0", "forward/1", "head/0", "weight_only/0"]
    assert [d.name for d in program.method_delegates("head")] == ["head/0"]
    with pytest.raises(XnnquantError, match="no method 'tail' in the program: it has forward, head, weight_only"):
        program.method_delegates("tail")


def test_unused_delegate_arguments(et_programs: Path) -> None:
    """ExecuTorch 1.4.1 passes a weight-only linear's delegate its scale and zero point,
    which the payload does not use: externals 0 and 1 of 4 are no value's."""
    from xnnquant.graph import run
    from xnnquant.pte.run import delegate_io

    (delegate,) = read_pte(et_programs / "xnnquant.pte").method_delegates("weight_only")
    graph = delegate.graph
    assert graph.load_info.num_externs == 4
    assert [graph.value(i).external_id for i in graph.inputs + graph.outputs] == [2, 3]
    x = np.load(et_programs / "input_weight_only.npy")
    inputs, outputs = delegate_io(et_programs / "xnnquant.pte", delegate.name, [x])
    np.testing.assert_array_equal(inputs[0], x)
    np.testing.assert_array_equal(outputs[0], np.load(et_programs / "output_weight_only.npy"))
    assert np.abs(interpret(graph, inputs)[0] - outputs[0]).max() <= 1e-5 * np.abs(outputs[0]).max()
    with pytest.raises(XnnquantError, match=r"leaves delegate arguments unused \(external ids \[2, 3\]"):
        run(delegate.payload, inputs, named_data=delegate.named_data)


# ----------------------------------------------------------------------------- our own .pte files


SMALL_CONSTANT = np.random.default_rng(0).standard_normal(8).astype(np.float32)


@pytest.fixture(scope="module")
def small_payload() -> bytes:
    """A payload built here: ``x + c``, the constant in its own segment."""
    g = Graph()
    x = g.input((2, 8))
    g.output(g.add(x, g.constant(SMALL_CONSTANT)))
    return g.to_bytes()


@pytest.fixture(scope="module")
def small_pte(small_payload: bytes) -> bytes:
    return to_pte(small_payload)


def test_our_constants_come_back_as_named_data(small_pte: bytes) -> None:
    """``to_pte`` moves the payload's constants to named data (ExecuTorch frees a delegate's bytes
    after init; a constant XNNPACK does not pack must outlive them)."""
    program = read_pte(small_pte)
    (delegate,) = program.delegates
    assert delegate.graph.load_info.named_keys == ("xnnquant.constant.1",)
    assert delegate.named_data == {"xnnquant.constant.1": SMALL_CONSTANT.tobytes()}
    assert small_pte.find(delegate.payload) > 0 and delegate.payload[4:8] == b"XH00"
    assert XNNHeader.from_bytes(delegate.payload).constant_data_size == 0


def test_inline_constants_come_back_byte_for_byte(small_payload: bytes) -> None:
    (delegate,) = read_pte(to_pte(small_payload, constants="inline")).delegates
    assert delegate.named_data == {} and delegate.graph.load_info.named_keys == ()
    assert delegate.payload == small_payload


def test_a_program_loaded_from_its_file_runs(small_pte: bytes, tmp_path: Path) -> None:
    """Loaded from a file, the runtime frees the delegate's bytes after init: the constant of
    the add (not packed by XNNPACK) must live in named data (inline, this read freed memory)."""
    torch = pytest.importorskip("torch")
    from executorch.runtime import Runtime

    path = tmp_path / "small.pte"
    path.write_bytes(small_pte)
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    (got,) = Runtime.get().load_program(str(path)).load_method("forward").execute([torch.from_numpy(x)])
    np.testing.assert_array_equal(got.numpy(), x + SMALL_CONSTANT)


def test_not_a_program(small_pte: bytes, tmp_path: Path) -> None:
    payload = read_pte(small_pte).delegates[0].payload
    with pytest.raises(ProgramError, match=r"is not an ExecuTorch program: got identifier b'XH00' \(an XNNGraph "
                                           r"payload: read it with xnnquant.graph.load\)"):
        read_pte(payload)
    with pytest.raises(ProgramError, match=r"cannot read \.pte file"):
        read_pte(tmp_path / "missing.pte")
    with pytest.raises(XnnquantError, match=r"^a \.pte must be given as bytes or a path: got 3$"):
        read_pte(3)


def test_no_xnnpack_delegate(small_pte: bytes) -> None:
    other = small_pte.replace(b"XnnpackBackend", b"OtherNNBackend")
    with pytest.raises(ProgramError, match=r"has no XNNPACK delegate \(forward: 1 other delegate\(s\)\): expected "
                                           "at least one delegate with backend id 'XnnpackBackend'"):
        read_pte(other)


def test_malformed_delegate(small_pte: bytes) -> None:
    payload = read_pte(small_pte).delegates[0].payload
    broken = small_pte.replace(payload, payload[:36] + b"XX99" + payload[40:])
    with pytest.raises(ProgramError, match="method 'forward' delegate 0: malformed XNNPACK payload: not an XNNGraph "
                                           "payload: got identifier b'XX99'"):
        read_pte(broken)


def test_a_missing_executorch_names_the_extra(et_programs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .pte is read with xnnquant's own generated code; a .ptd still needs executorch."""
    # a None entry makes the import fail even though an earlier test imported the module
    for name in ("executorch", "executorch.exir", "executorch.extension.flat_tensor.serialize.serialize"):
        monkeypatch.setitem(sys.modules, name, None)
    assert read_pte(et_programs / "xnnquant.pte").delegates
    with pytest.raises(MissingExtraError, match=r"reading ExecuTorch data files \(\.ptd\) needs the 'executorch' "
                                                r"package, which is not installed: .*xnnquant\[xnnpack\]"):
        read_ptd(et_programs / "model.ptd")


def read_or_error(data: bytes) -> None:
    start = time.perf_counter()
    with contextlib.suppress(XnnquantError):
        read_pte(data)
    assert time.perf_counter() - start < MAX_SECONDS


def truncations_read_the_same_or_fail(data: bytes, lengths: range) -> None:
    """A truncated file is a ``ProgramError``, unless only trailing padding was cut."""
    want = [d.payload for d in read_pte(data).delegates]
    for length in lengths:
        try:
            program = read_pte(data[:length])
        except ProgramError:
            continue
        assert [d.payload for d in program.delegates] == want, length


def test_truncations(small_pte: bytes, et_programs: Path) -> None:
    truncations_read_the_same_or_fail(small_pte, range(len(small_pte)))  # delegate inline, no segments
    data = (et_programs / "xnnquant.pte").read_bytes()  # segments, named data
    truncations_read_the_same_or_fail(data, range(0, len(data), 3))


@pytest.mark.parametrize("name", ["torchao.pte", "xnnquant.pte"])
def test_byte_flips_give_a_program_or_an_error(et_programs: Path, name: str) -> None:
    """Mutations of the Program flatbuffer and the first payload: any outcome but a crash,
    another exception or a hang."""
    data = (et_programs / name).read_bytes()
    program_size = struct.unpack_from("<Q", data, 16)[0]
    rng = np.random.default_rng(0)
    for _ in range(400):
        mutant = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            at = int(rng.integers(0, program_size + 2400))
            if rng.random() < 0.5:
                mutant[at] ^= 1 << int(rng.integers(0, 8))
            else:  # a whole little-endian word: offsets, lengths, indices
                at &= ~3
                word = int(rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, int(rng.integers(0, 1 << 32))]))
                mutant[at:at + 4] = struct.pack("<I", word)
        read_or_error(bytes(mutant))


def test_broken_ptd_files(et_programs: Path) -> None:
    ptd = (et_programs / "model.ptd").read_bytes()
    for length in (0, 7, 47, 200, len(ptd) - 1):
        with pytest.raises(ProgramError):
            read_ptd(ptd[:length])
    with pytest.raises(ProgramError, match="is not an ExecuTorch data file: got identifier b'ET12'"):
        read_ptd((et_programs / "torchao.pte").read_bytes())
    rng = np.random.default_rng(1)
    for _ in range(20):  # each decode runs ExecuTorch's flatc in a subprocess: a few only
        mutant = bytearray(ptd)
        mutant[int(rng.integers(8, 400))] ^= 1 << int(rng.integers(0, 8))
        with contextlib.suppress(ProgramError):
            read_ptd(bytes(mutant))
