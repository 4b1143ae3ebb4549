"""xnnquant.pte's program writer against ExecuTorch 1.4.1: its serializer, deserializer, runtime.

Oracles:
* ExecuTorch's own serializer: a one-delegate program (what ``to_pte`` writes) is byte for
  byte the ``.pte`` ExecuTorch writes for the same delegate (``et_lowered.lowered_pte``:
  ``LoweredBackendModule.buffer``), for every kind of input and output; and any program
  (every value kind, constants, several methods, shared and named data) read by
  ExecuTorch's deserializer and serialized again by ExecuTorch gives our bytes back.
* ExecuTorch's deserializer (``_deserialize_pte_binary``): the structure read back is the
  one expected, spelled with ExecuTorch's own schema dataclasses.
* ExecuTorch's memory planner (``exir.memory_planning.greedy``) on the same sizes and
  lifetimes; torch's own pytree serialization for the container metadata.
* The real runtime loads and runs what is written.
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from et_lowered import lowered_pte
from executorch.exir import schema as et
from executorch.exir._serialize import _deserialize_pte_binary, _PTEFile, _serialize_pte_binary
from executorch.exir._serialize._flatbuffer_program import _flatbuffer_to_program
from executorch.exir._serialize._program import _get_extended_header
from executorch.runtime import Runtime
from hypothesis import given, settings
from hypothesis import strategies as st

from xnnquant.errors import XnnquantError
from xnnquant.graph import Graph, pte_chunks, to_pte
from xnnquant.graph.program import TensorSpec, _program
from xnnquant.pte import header, pytree
from xnnquant.pte.builder import Chunked, ProgramBuilder
from xnnquant.pte.memory import greedy

pytestmark = pytest.mark.xnnpack

F32, F16, I8, I64 = (np.dtype(t) for t in (np.float32, np.float16, np.int8, np.int64))
CHANNELS_LAST = (0, 2, 3, 1)


def _add_payload() -> bytes:
    g = Graph()
    a, b = g.input((2, 3)), g.input((2, 3))
    g.output(g.add(a, b))
    return g.to_bytes()


# (inputs, outputs, named data, dynamic): what to_pte may be asked for, including sizes that
# are not multiples of 16 bytes, an empty tensor and duplicated named blobs
ONE_DELEGATE = {
    "two_inputs": ([TensorSpec((2, 3), F32)] * 2, [TensorSpec((2, 3), F32)], None, False),
    "dtypes": ([TensorSpec((2, 3), F32), TensorSpec((4, 1, 5), F16)],
               [TensorSpec((2, 3), F32), TensorSpec((7,), I8), TensorSpec((3, 3), I64)], None, False),
    "channels_last": ([TensorSpec((1, 3, 4, 5), F32, CHANNELS_LAST)],
                      [TensorSpec((1, 6, 2, 2), F32, CHANNELS_LAST), TensorSpec((2, 2), F32)], None, False),
    "dynamic": ([TensorSpec((1, 16, 32), F32), TensorSpec((1, 1, 32), F32)], [TensorSpec((1, 16, 32), F32)],
                None, True),
    "named_data": ([TensorSpec((2, 3), F32)], [TensorSpec((2, 3), F32)],
                   {"b": b"\x01" * 100, "a": b"\x02" * 33, "c": b"\x01" * 100}, False),
    "odd_sizes": ([TensorSpec((3, 5), F16), TensorSpec((1,), I8)], [TensorSpec((0, 4), F32), TensorSpec((9,), F16)],
                  {"k": b"xyz"}, True),
}


@pytest.mark.parametrize("case", sorted(ONE_DELEGATE))
def test_one_delegate_program_is_executorchs_bytes(case: str) -> None:
    ins, outs, named, dynamic = ONE_DELEGATE[case]
    payload = _add_payload()
    ours = _program(payload, ins, outs, named, dynamic).to_bytes()
    assert ours == lowered_pte(payload, ins, outs, named, dynamic)


def test_to_pte_and_its_stream_are_executorchs_bytes() -> None:
    """``to_pte`` with the payload's own specs and its constants inline: ExecuTorch's bytes for
    the whole payload; ``pte_chunks`` of a graph whose constants are made one at a time:
    ``to_pte``'s bytes (constants as named data)."""
    rng = np.random.default_rng(0)
    g = Graph(target="1.4.1", scales_in_segment=True)
    x = g.input((4, 64))
    import xnnquant as xq

    w = xq.quantize_blockwise(rng.standard_normal((16, 64)).astype(np.float32), 32)
    g.output(g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(w)))
    payload = g.to_bytes()
    expected = lowered_pte(payload, [TensorSpec((4, 64), F32)], [TensorSpec((4, 16), F32)])
    assert to_pte(payload, constants="inline") == expected
    pieces = list(pte_chunks(g))
    assert len(pieces) > 3 and b"".join(pieces) == to_pte(payload)  # one named blob at a time, the same bytes
    from executorch.runtime import Runtime

    x = torch.from_numpy(rng.standard_normal((4, 64)).astype(np.float32))
    outputs = [Runtime.get().load_program(pte).load_method("forward").execute([x])[0].numpy()
               for pte in (b"".join(pieces), to_pte(payload), expected)]
    np.testing.assert_array_equal(outputs[0], outputs[2])
    np.testing.assert_array_equal(outputs[1], outputs[2])


# ---------------------------------------------------------------------- any program


def _every_kind() -> ProgramBuilder:
    """Two methods, every value kind, two constants, a payload used twice, named data."""
    p = ProgramBuilder()
    p.add_named_data("w2", b"\x05" * 40)
    p.add_named_data("w1", b"\x07" * 17)
    p.add_named_data("same_as_w2", b"\x05" * 40)
    m = p.method("forward")
    v = {}
    v["x"] = m.input(m.tensor(np.float32, (2, 3)))
    v["c"] = m.tensor(np.float32, (2, 3), data=np.arange(6, dtype=np.float32).reshape(2, 3))
    v["cl"] = m.tensor(np.int8, (1, 2, 2, 2), dim_order=CHANNELS_LAST, data=np.arange(8, dtype=np.int8).reshape(1, 2, 2, 2))
    v["alpha"] = m.int_value(2)
    v["out"] = m.output(m.tensor(np.float32, (2, 3)))
    m.kernel_call("aten::add", "out", [v["x"], v["c"], v["alpha"], v["out"], v["out"]])
    v["null"] = m.null()
    v["true"] = m.bool_value(True)
    v["pi"] = m.double(3.25)
    v["s"] = m.string("hello")
    v["ints"] = m.int_list([4, -1])
    v["doubles"] = m.double_list([0.5, -2.0])
    v["bools"] = m.bool_list([True, False, True])
    v["tensors"] = m.tensor_list([v["x"], v["c"]])
    v["optional"] = m.optional_tensor_list([v["x"], None])
    v["scratch"] = m.tensor(np.int64, (5,), dynamic=True)
    v["unplanned"] = m.tensor(np.uint8, (3,), planned=False)
    other = p.method("second")
    a = other.input(other.tensor(np.float32, (2, 3)))
    b = other.output(other.tensor(np.float32, (2, 3)))
    payload = _add_payload()
    other.delegate_call(other.delegate("XnnpackBackend", payload, [("key", b"\x01\x02")]), [a, a], [b])
    other.delegate_call(other.delegate("XnnpackBackend", bytearray(payload)), [b, a], [b])
    return p


def test_executorch_reads_every_value_kind_as_built() -> None:
    p = _every_kind()
    pte = p.to_bytes()
    read = _deserialize_pte_binary(pte)
    plan = read.program.execution_plan[0]

    def tensor(st: et.ScalarType, sizes: list[int], order: list[int], buffer: int = 0, offset: int | None = None,
               dynamism: et.TensorShapeDynamism = et.TensorShapeDynamism.STATIC) -> et.EValue:
        info = None if offset is None else et.AllocationDetails(memory_id=1, memory_offset_low=offset,
                                                                memory_offset_high=0)
        return et.EValue(et.Tensor(scalar_type=st, storage_offset=0, sizes=sizes, dim_order=order,
                                   requires_grad=False, layout=0, data_buffer_idx=buffer, allocation_info=info,
                                   shape_dynamism=dynamism))

    float_, int8, long_, byte = et.ScalarType.FLOAT, et.ScalarType.CHAR, et.ScalarType.LONG, et.ScalarType.BYTE
    # planning: x, out (24 -> 32 bytes) and scratch (40 -> 48) overlap in time (scratch,
    # named by no instruction, lives throughout); the largest first, equal sizes the later first
    assert plan.values == [
        tensor(float_, [2, 3], [0, 1], offset=80),
        tensor(float_, [2, 3], [0, 1], buffer=1),
        tensor(int8, [1, 2, 2, 2], [0, 2, 3, 1], buffer=2),
        et.EValue(et.Int(2)),
        tensor(float_, [2, 3], [0, 1], offset=48),
        et.EValue(et.Null()),
        et.EValue(et.Bool(True)),
        et.EValue(et.Double(3.25)),
        et.EValue(et.String("hello")),
        et.EValue(et.Int(4)), et.EValue(et.Int(-1)), et.EValue(et.IntList([9, 10])),
        et.EValue(et.DoubleList([0.5, -2.0])),
        et.EValue(et.BoolList([True, False, True])),
        et.EValue(et.TensorList([0, 1])),
        et.EValue(et.OptionalTensorList([0, -1])),
        tensor(long_, [5], [0], offset=0, dynamism=et.TensorShapeDynamism.DYNAMIC_BOUND),
        tensor(byte, [3], [0]),
    ]
    assert (plan.name, plan.inputs, plan.outputs, plan.non_const_buffer_sizes) == ("forward", [0], [4], [0, 112])
    assert plan.operators == [et.Operator(name="aten::add", overload="out")]
    assert plan.chains == [et.Chain(inputs=[], outputs=[], instructions=[
        et.Instruction(et.KernelCall(op_index=0, args=[0, 1, 3, 4, 4]))], stacktrace=None)]
    assert plan.container_meta_type == et.ContainerMetadata(pytree.input_spec(1), pytree.output_spec(1))
    second = read.program.execution_plan[1]
    assert second.non_const_buffer_sizes == [0, 64 + 64]  # two 32-byte tensors + XNNPACK's 64
    assert [d.id for d in second.delegates] == ["XnnpackBackend"] * 2
    assert second.delegates[0].compile_specs == [et.CompileSpec(key="key", value=b"\x01\x02")]
    assert [i.instr_args for i in second.chains[0].instructions] == [
        et.DelegateCall(delegate_index=0, args=[0, 0, 1]), et.DelegateCall(delegate_index=1, args=[1, 0, 1])]
    assert [d.data for d in read.program.backend_delegate_data] == [_add_payload()] * 2
    # the segments as written (ExecuTorch's flatbuffer reader, before it moves them inline):
    # constants, one copy of the payload both delegates use, the two distinct named blobs
    raw = _flatbuffer_to_program(pte[:_get_extended_header(pte).program_size])
    assert [(s.offset, s.size) for s in raw.segments] == [(0, 24 + 8 + 8), (128, len(_add_payload())),
                                                          (128 + 512, 40), (128 + 512 + 128, 17)]
    assert [d.processed for d in raw.execution_plan[1].delegates] == [
        et.BackendDelegateDataReference(location=et.DataLocation.SEGMENT, index=1)] * 2
    assert [(n.key, n.segment_index) for n in raw.named_data] == [("w2", 2), ("w1", 3), ("same_as_w2", 2)]
    assert raw.constant_segment == et.SubsegmentOffsets(segment_index=0, offsets=[0, 0, 32])
    assert [b.storage for b in read.program.constant_buffer] == [
        b"", np.arange(6, dtype=np.float32).tobytes() + bytes(8), np.array([0, 4, 1, 5, 2, 6, 3, 7], np.int8).tobytes()]
    store = read.named_data
    assert {k: store.buffers[e.buffer_index] for k, e in store.pte_data.items()} == {
        "w2": b"\x05" * 40, "w1": b"\x07" * 17, "same_as_w2": b"\x05" * 40}
    assert len(store.buffers) == 2  # identical blobs share a segment


def test_executorch_reserializes_our_bytes() -> None:
    """Read by ExecuTorch's deserializer and written again by its serializer: our bytes."""
    p = _every_kind()
    for program in (p, _program(_add_payload(), *ONE_DELEGATE["odd_sizes"])):
        ours = program.to_bytes()
        read = _deserialize_pte_binary(ours)
        if not program.named_data:
            read.program.named_data = None  # the deserializer leaves [] where a fresh program has none
        again = bytes(_serialize_pte_binary(_PTEFile(read.program, named_data=read.named_data),
                                            extract_delegate_segments=True))
        assert again == ours


def test_every_value_kind_loads_and_runs() -> None:
    p = _every_kind()
    program = Runtime.get().load_program(p.to_bytes())
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    (out,) = program.load_method("forward").execute([x])
    assert torch.equal(out, x + 2 * torch.arange(6, dtype=torch.float32).reshape(2, 3))
    (twice,) = program.load_method("second").execute([x])
    assert torch.equal(twice, 3 * x)  # (x + x) + x


# ---------------------------------------------------------------------- layout details


def test_extended_header_golden_bytes() -> None:
    h = header.ExtendedHeader(program_size=0x1234, segment_base_offset=0x1280, segment_data_size=5)
    assert h.to_bytes() == (b"eh00" + struct.pack("<I", 32) + struct.pack("<Q", 0x1234) + struct.pack("<Q", 0x1280)
                            + struct.pack("<Q", 5))
    flatbuffer = struct.pack("<I", 12) + b"ET12" + b"\xaa" * 8
    assert header.insert(flatbuffer, h) == struct.pack("<I", 44) + b"ET12" + h.to_bytes() + b"\xaa" * 8
    assert header.ExtendedHeader.read(flatbuffer) is None
    pte = to_pte(_add_payload())
    found, theirs = header.ExtendedHeader.read(pte), _get_extended_header(pte)
    assert (found.program_size, found.segment_base_offset, found.segment_data_size) == (
        theirs.program_size, theirs.segment_base_offset, theirs.segment_data_size)
    assert found.segment_base_offset % 128 == 0 and found.segment_base_offset + found.segment_data_size == len(pte)


def test_a_program_without_segment_data_is_the_bare_flatbuffer() -> None:
    """Nothing for the segments (no constants, delegates or named data): no header, as
    ExecuTorch writes it."""
    p = ProgramBuilder()
    m = p.method()
    x = m.input(m.tensor(np.float32, (4,)))
    y = m.output(m.tensor(np.float32, (4,)))
    m.kernel_call("aten::relu", "out", [x, y, y])
    pte = p.to_bytes()
    assert header.ExtendedHeader.read(pte) is None and _get_extended_header(pte) is None
    read = _deserialize_pte_binary(pte)
    assert bytes(_serialize_pte_binary(_PTEFile(read.program))) == pte
    (out,) = Runtime.get().load_program(pte).load_method("forward").execute([torch.tensor([-1.0, 2, -3, 4])])
    assert out.tolist() == [0, 2, 0, 4]


def test_container_metadata_is_torch_exports_pytree_spec() -> None:
    from torch.utils._pytree import tree_structure, treespec_dumps

    x = torch.zeros(1)
    assert pytree.input_spec(3) == treespec_dumps(tree_structure(((x, x, x), {})))
    assert pytree.output_spec(2) == treespec_dumps(tree_structure((x, x)))
    assert pytree.input_spec(0) == treespec_dumps(tree_structure(((), {})))


def test_the_runtime_does_not_read_the_container_metadata() -> None:
    """ExecuTorch 1.4.1's Method and Module API never read the pytree specs: garbage
    there changes nothing (only a deprecated C++ accessor returns them)."""
    from executorch.extension.pybindings import portable_lib

    ins, outs, named, dynamic = ONE_DELEGATE["two_inputs"]
    program = _program(_add_payload(), ins, outs, named, dynamic)
    program.methods[0].container = ("not a spec", "")
    pte = program.to_bytes()
    x = torch.ones(2, 3)
    assert torch.equal(Runtime.get().load_program(pte).load_method("forward").execute([x, x])[0], 2 * x)
    module = portable_lib._load_for_executorch_from_buffer(pte)
    for result in (module.forward([x, x]), module([x, x]), module.run_method("forward", [x, x])):
        assert torch.equal(result[0], 2 * x)


# ---------------------------------------------------------------------- memory planning


def _executorch_greedy(sizes: list[int], spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    from executorch.exir.memory_planning import greedy as et_greedy
    from executorch.exir.tensor import TensorSpec as ExirSpec

    specs = []
    for size, span in zip(sizes, spans):
        spec = ExirSpec(torch.uint8, torch.Size([size]))
        spec.lifetime = list(span)
        specs.append(spec)
    result = et_greedy(16, specs, SimpleNamespace(), None, 0)
    return [result.spec_dict[s].mem_offset for s in specs], result.bufsizes[1]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 200), st.integers(0, 12), st.integers(0, 6)), min_size=1, max_size=14))
def test_planner_is_executorchs_greedy(tensors: list[tuple[int, int, int]]) -> None:
    sizes = [n for n, _, _ in tensors]
    spans = [(start, start + length) for _, start, length in tensors]
    offsets, total = greedy(sizes, spans)
    assert (offsets, total) == _executorch_greedy(sizes, spans)
    for i in range(len(sizes)):  # what the plan promises, checked on its own
        assert offsets[i] % 16 == 0 and offsets[i] + sizes[i] <= total
        for j in range(i):
            if not (spans[i][1] < spans[j][0] or spans[i][0] > spans[j][1]):
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[j] + sizes[j] <= offsets[i]


# ---------------------------------------------------------------------- imports and errors


def test_writing_and_reading_a_pte_import_neither_exir_nor_torch() -> None:
    code = textwrap.dedent("""
        import sys
        import numpy as np
        import xnnquant
        from xnnquant.pte import read_pte
        g = xnnquant.graph.Graph()
        x = g.input((2, 8))
        g.output(g.fully_connected(x, g.constant(np.ones((4, 8), np.float32))))
        pte = xnnquant.graph.to_pte(g.to_bytes(), dynamic=True)
        assert read_pte(pte).delegates[0].graph.nodes[0].kind == "XNNFullyConnected"
        print(sorted(m for m in ("torch", "executorch", "executorch.exir") if m in sys.modules))
        import torch, executorch.runtime
        print("executorch.exir" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # the last line pins a fact of ExecuTorch 1.4.1: running a program (executorch.runtime,
    # whose pybindings module imports executorch.exir._warnings) imports executorch.exir
    assert out.stdout.split("\n")[:2] == ["[]", "True"]


def test_builder_refusals() -> None:
    p = ProgramBuilder()
    m = p.method()
    x = m.tensor(np.float32, (2,))
    cases = [
        (lambda: p.method("forward"), "the program already has a method 'forward'"),
        (lambda: m.tensor(np.complex64, (2,)), "no ExecuTorch scalar type for dtype <class 'numpy.complex64'>: "
                                               "expected one of uint8, int8, int16, int32, int64, float16, float32, "
                                               "float64, bool, bfloat16, uint16, uint32, uint64"),
        (lambda: m.tensor(np.float32, (2, -1)), r"tensor sizes must be ints in [0, 2**31): got (2, -1)"),
        (lambda: m.tensor(np.float32, (2, 3), dim_order=(0, 0)),
         "dim_order must be a permutation of the 2 dims: got (0, 0)"),
        (lambda: m.tensor(np.int8, (2,), data=np.array([1.5, 2])),
         "constant data of dtype float64 does not cast exactly to CHAR"),
        (lambda: m.tensor(np.int8, (3,), data=np.zeros(2)), "constant data has shape (2,), expected the tensor's sizes (3,)"),
        (lambda: m.input(7), "an input must be a value index in [0, 1): got 7"),
        (lambda: m.tensor_list([x, 5]), "TensorList item must be a value index in [0, 1): got 5"),
        (lambda: m.int_value(2**63), "an Int value must be an int in the int64 range: got 9223372036854775808"),
        (lambda: m.delegate_call(0, [x], [x]), "delegate_call names delegate 0: the method has 0"),
        (lambda: m.delegate("XnnpackBackend", "payload"), "a delegate payload must be bytes or Chunked: got str"),
        (lambda: p.add_named_data("k", 3), "named data must map str keys to bytes: got str -> int"),
        (lambda: m.kernel_call("aten::relu", "out", [x, 3]), "argument 1 of aten::relu.out must be a value index in "
                                                              "[0, 1): got 3"),
        (lambda: ProgramBuilder().to_bytes(), "a program needs at least one method: add one with ProgramBuilder.method()"),
    ]
    for call, message in cases:
        with pytest.raises(XnnquantError) as info:
            call()
        assert str(info.value) == message
    p.add_named_data("k", b"a")
    with pytest.raises(XnnquantError, match=r"^named data 'k' was added twice with different bytes$"):
        p.add_named_data("k", b"b")


def test_a_chunked_payload_must_give_its_declared_size() -> None:
    p = ProgramBuilder()
    m = p.method()
    x, y = m.input(m.tensor(np.float32, (2, 3))), m.tensor(np.float32, (2, 3))
    m.output(y)
    m.delegate_call(m.delegate("XnnpackBackend", Chunked(100, [b"x" * 60, b"y" * 30])), [x], [y])
    with pytest.raises(XnnquantError, match=r"^segment 1 was declared 100 bytes, its chunks gave 90$"):
        p.to_bytes()
