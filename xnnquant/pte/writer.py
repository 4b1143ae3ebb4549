"""ProgramBuilder -> ``.pte`` bytes: the ET12 flatbuffer, the extended header, the segments.

The flatbuffer is built with the flatc-generated builders of ``program_generated``
(xnnquant's program.fbs).  Each table is written the way flatc's object API packs it,
which is how ExecuTorch 1.4.1 serializes: first the table's strings, vectors and
sub-tables in field order, then the table with its fields in field order, scalars equal
to their default left out, absent fields (None) not written, empty lists written as
empty vectors.  The same program then gives ExecuTorch's bytes, and always the same.

What goes where::

    Program        version 0 (omitted), execution_plan (one per method), constant_buffer [],
                   backend_delegate_data [], segments, constant_segment (segment 0),
                   mutable_data_segments (with state: [segment 1]; else absent),
                   named_data (absent without named data)
    ExecutionPlan  name, container_meta_type (pytree.py), values, inputs, outputs,
                   chains [one chain: inputs [], outputs [], instructions],
                   operators, delegates (payloads in segments), non_const_buffer_sizes
    segments       0: the constant segment (always; empty without constants), then
                   with state the mutable data segment (initial values of method state,
                   ``Tensor.data_buffer_idx`` indexing its offsets for a tensor that also
                   has an ``allocation_info``), then each distinct delegate payload, then
                   each distinct named-data blob; last, a *view* for each named blob whose
                   bytes are a constant's: a segment over that constant inside segment 0,
                   no bytes of its own (``SegmentLayout.of``)

A view lets a kernel's constant and an XNNPACK delegate read the same bytes (a token
table looked up by ExecuTorch's quantized embedding kernel and read by the LM head's
fully-connected node): ExecuTorch 1.4.1 resolves a named key by loading
``segment_base + offset`` for ``size`` bytes (``PteDataMap::get_data``) and checks no
segment against another, and a constant tensor by its offset in the constant segment.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import flatbuffers

from ..constants import CONSTANT_TENSOR_ALIGNMENT, PTE_SEGMENT_ALIGNMENT, PTE_TENSOR_ALIGNMENT
from ..errors import XnnquantError
from . import header
from . import program_generated as fb
from .builder import Blob, Chunked, DelegateCall, KernelCall, MethodBuilder, Payload, ProgramBuilder
from .memory import PLANNED_MEMORY_ID, MemoryPlan, plan_memory
from .pytree import input_spec, output_spec
from .values import (
    Bool,
    BoolList,
    Double,
    DoubleList,
    EValue,
    Int,
    IntList,
    Null,
    OptionalTensorList,
    String,
    Tensor,
    TensorList,
)

FILE_IDENTIFIER = b"ET12"


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


@dataclass(frozen=True)
class Segment:
    """One segment: its pieces (bytes, or a ``Chunked`` payload), size and offset from
    the segment base.  A view (``view``) has no pieces: its bytes are written by the
    segment it lies in."""

    pieces: tuple[Payload, ...]
    size: int
    offset: int
    view: bool = False


@dataclass(frozen=True)
class SegmentLayout:
    """Where a program's data goes: ``segments`` in file order, ``constant_offsets`` (the
    start of each constant in segment 0), the segment of each method's delegates
    (``delegate_segments[method][delegate]``) and of each named-data key; with state, the
    mutable data segment (segment 1) and the start of each state's initial values in it
    (``mutable_offsets``; ``()`` without state)."""

    segments: tuple[Segment, ...]
    constant_offsets: tuple[int, ...]
    delegate_segments: tuple[tuple[int, ...], ...]
    named_segments: tuple[tuple[str, int], ...]
    mutable_offsets: tuple[int, ...] = ()

    @property
    def data_size(self) -> int:
        """Bytes from the segment base to the end of the last segment written."""
        last = [s for s in self.segments if not s.view][-1]
        return last.offset + last.size

    @classmethod
    def of(cls, program: ProgramBuilder) -> SegmentLayout:
        """The constant segment, then the mutable data segment (with state: each state's
        initial values end to end, unpadded: the runtime copies them into planned memory),
        then each distinct delegate payload in method and delegate order, then each distinct
        named blob in the order added; each segment at the next multiple of 128
        (``PTE_SEGMENT_ALIGNMENT``) after the previous one.  This is ExecuTorch 1.4.1's order
        (``exir/_serialize/_program.py``).  A named blob (bytes, not ``Chunked``) equal to a
        constant is no segment of its own but a view of that constant, after the others
        (module docstring): its offset is the constant's, a multiple of 16
        (``CONSTANT_TENSOR_ALIGNMENT``, what a named blob's segment keeps)."""
        # constants: each padded with zeros to 16, except the last
        pieces: list[Payload] = []
        offsets, at = [], 0
        for k, data in enumerate(program.constants):
            offsets.append(at)
            pieces.append(data)
            at += len(data)
            pad = _align(at, PTE_TENSOR_ALIGNMENT) - at
            if pad and k < len(program.constants) - 1:
                pieces.append(bytes(pad))
                at += pad
        segments = [(tuple(pieces), at, 1)]
        mutable_offsets: list[int] = []
        if len(program.mutable) > 1:
            at = 0
            for data in program.mutable:
                mutable_offsets.append(at)
                at += len(data)
            segments.append((tuple(program.mutable), at, 1))
        first = len(segments)  # the first delegate's segment
        distinct: list[Payload] = []
        delegate_segments = []
        for method in program.methods:
            found = []
            for delegate in method.delegates:
                payload = delegate.payload
                same = next((k for k, p in enumerate(distinct) if not isinstance(p, Chunked) and
                             not isinstance(payload, Chunked) and len(p) == len(payload) and p == payload), None)
                if same is None:
                    distinct.append(payload)
                    segments.append(((payload,), _size(payload), 1))
                    same = len(distinct) - 1
                found.append(first + same)
            delegate_segments.append(tuple(found))
        by_size: dict[int, list[int]] = {}  # constants by length (index 0, the placeholder, is none)
        for k, data in enumerate(program.constants):
            if k and data and offsets[k] % CONSTANT_TENSOR_ALIGNMENT == 0:
                by_size.setdefault(len(data), []).append(k)
        named: list[tuple[str, int | tuple[int]]] = []  # (key, segment) or (key, (constant,)): a view
        blobs: list[Payload] = []
        for key, blob in program.named_data.items():
            constant = _equal_constant(program, blob, by_size.get(_size(blob), ()))
            if constant is not None:
                named.append((key, (constant,)))
                continue
            same = None if isinstance(blob, Chunked) else next(
                (k for k, b in enumerate(blobs) if not isinstance(b, Chunked) and len(b) == len(blob) and b == blob),
                None)
            if same is None:
                blobs.append(blob)
                segments.append(((blob,), _size(blob), CONSTANT_TENSOR_ALIGNMENT))
                same = len(blobs) - 1
            named.append((key, first + len(distinct) + same))
        placed, end = [], 0
        for seg_pieces, size, alignment in segments:
            offset = _align(end, math.lcm(PTE_SEGMENT_ALIGNMENT, alignment))
            placed.append(Segment(seg_pieces, size, offset))
            end = offset + size
        views: dict[int, int] = {}  # constant -> its view's segment
        resolved: list[tuple[str, int]] = []
        for key, where in named:
            if isinstance(where, tuple):
                (constant,) = where
                if constant not in views:
                    views[constant] = len(placed)
                    placed.append(Segment((), len(program.constants[constant]), placed[0].offset + offsets[constant],
                                          view=True))
                where = views[constant]
            resolved.append((key, where))
        return cls(tuple(placed), tuple(offsets), tuple(delegate_segments), tuple(resolved), tuple(mutable_offsets))


def _size(payload: Payload) -> int:
    return payload.size if isinstance(payload, Chunked) else len(payload)


def _equal_constant(program: ProgramBuilder, blob: Payload, candidates: Sequence[int]) -> int | None:
    """The first of the constants ``candidates`` (indices, each of ``blob``'s size) holding
    ``blob``'s bytes, or None.  A ``Chunked`` blob is made once to compare (its chunks
    iterate again when written, ``graph.writer.named_payload``'s do), only when a
    constant has its size."""
    if not candidates:
        return None
    data = b"".join(blob.chunks) if isinstance(blob, Chunked) else blob
    return next((k for k in candidates if program.constants[k] == data), None)


# ---------------------------------------------------------------------- flatbuffer


def _ints(b: flatbuffers.Builder, start: object, items: Sequence[Any], prepend: str) -> int:
    """A vector of scalars (``prepend``: the builder's method for one element)."""
    start(b, len(items))  # type: ignore[operator]
    add = getattr(b, prepend)
    for item in reversed(items):
        add(item)
    return int(b.EndVector())


def _tables(b: flatbuffers.Builder, start: object, offsets: Sequence[int]) -> int:
    start(b, len(offsets))  # type: ignore[operator]
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return int(b.EndVector())


def _evalue_table(b: flatbuffers.Builder, value: EValue, allocation: int | None) -> tuple[int, int]:
    """(KernelTypes tag, offset) of the table of ``value``; ``allocation``: a planned
    tensor's byte offset in arena 1."""
    if isinstance(value, Tensor):
        sizes = _ints(b, fb.TensorStartSizesVector, value.sizes, "PrependInt32")
        order = _ints(b, fb.TensorStartDimOrderVector, value.dim_order, "PrependUint8")
        info = None
        if allocation is not None:
            fb.AllocationDetailsStart(b)
            fb.AllocationDetailsAddMemoryId(b, PLANNED_MEMORY_ID)
            fb.AllocationDetailsAddMemoryOffsetLow(b, allocation % (1 << 32))
            fb.AllocationDetailsAddMemoryOffsetHigh(b, allocation >> 32)
            info = fb.AllocationDetailsEnd(b)
        fb.TensorStart(b)
        fb.TensorAddScalarType(b, int(value.scalar_type))
        fb.TensorAddStorageOffset(b, 0)
        fb.TensorAddSizes(b, sizes)
        fb.TensorAddDimOrder(b, order)
        fb.TensorAddRequiresGrad(b, False)
        fb.TensorAddDataBufferIdx(b, value.state or value.constant)  # state: mutable data, else constants
        if info is not None:
            fb.TensorAddAllocationInfo(b, info)
        fb.TensorAddLayout(b, 0)
        fb.TensorAddShapeDynamism(b, int(value.dynamism))
        return fb.KernelTypes.Tensor, fb.TensorEnd(b)
    if isinstance(value, Null):
        fb.NullStart(b)
        return fb.KernelTypes.Null, fb.NullEnd(b)
    if isinstance(value, Int):
        fb.IntStart(b)
        fb.IntAddIntVal(b, value.value)
        return fb.KernelTypes.Int, fb.IntEnd(b)
    if isinstance(value, Bool):
        fb.BoolStart(b)
        fb.BoolAddBoolVal(b, value.value)
        return fb.KernelTypes.Bool, fb.BoolEnd(b)
    if isinstance(value, Double):
        fb.DoubleStart(b)
        fb.DoubleAddDoubleVal(b, value.value)
        return fb.KernelTypes.Double, fb.DoubleEnd(b)
    if isinstance(value, String):
        text = b.CreateString(value.value)
        fb.StringStart(b)
        fb.StringAddStringVal(b, text)
        return fb.KernelTypes.String, fb.StringEnd(b)
    # the lists: one vector, then the table
    kinds = {IntList: ("IntList", "PrependInt64"), DoubleList: ("DoubleList", "PrependFloat64"),
             BoolList: ("BoolList", "PrependBool"), TensorList: ("TensorList", "PrependInt32"),
             OptionalTensorList: ("OptionalTensorList", "PrependInt32")}
    name, prepend = kinds[type(value)]
    items = _ints(b, getattr(fb, f"{name}StartItemsVector"), value.items, prepend)
    getattr(fb, f"{name}Start")(b)
    getattr(fb, f"{name}AddItems")(b, items)
    return getattr(fb.KernelTypes, name), getattr(fb, f"{name}End")(b)


def _instruction(b: flatbuffers.Builder, instruction: KernelCall | DelegateCall) -> int:
    if isinstance(instruction, KernelCall):
        args = _ints(b, fb.KernelCallStartArgsVector, instruction.args, "PrependInt32")
        fb.KernelCallStart(b)
        fb.KernelCallAddOpIndex(b, instruction.op_index)
        fb.KernelCallAddArgs(b, args)
        tag, call = fb.InstructionArguments.KernelCall, fb.KernelCallEnd(b)
    else:
        args = _ints(b, fb.DelegateCallStartArgsVector, instruction.args, "PrependInt32")
        fb.DelegateCallStart(b)
        fb.DelegateCallAddDelegateIndex(b, instruction.delegate_index)
        fb.DelegateCallAddArgs(b, args)
        tag, call = fb.InstructionArguments.DelegateCall, fb.DelegateCallEnd(b)
    fb.InstructionStart(b)
    fb.InstructionAddInstrArgsType(b, tag)
    fb.InstructionAddInstrArgs(b, call)
    return int(fb.InstructionEnd(b))


def _execution_plan(b: flatbuffers.Builder, method: MethodBuilder, plan: MemoryPlan,
                    delegate_segments: tuple[int, ...]) -> int:
    name = b.CreateString(method.name)
    inp, out = method.container or (input_spec(len(method.inputs)), output_spec(len(method.outputs)))
    inp_str, out_str = b.CreateString(inp), b.CreateString(out)
    fb.ContainerMetadataStart(b)
    fb.ContainerMetadataAddEncodedInpStr(b, inp_str)
    fb.ContainerMetadataAddEncodedOutStr(b, out_str)
    container = fb.ContainerMetadataEnd(b)
    evalues = []
    for index, value in enumerate(method.values):
        tag, table = _evalue_table(b, value, plan.offsets.get(index))
        fb.EValueStart(b)
        fb.EValueAddValType(b, tag)
        fb.EValueAddVal(b, table)
        evalues.append(fb.EValueEnd(b))
    values = _tables(b, fb.ExecutionPlanStartValuesVector, evalues)
    inputs = _ints(b, fb.ExecutionPlanStartInputsVector, method.inputs, "PrependInt32")
    outputs = _ints(b, fb.ExecutionPlanStartOutputsVector, method.outputs, "PrependInt32")
    chain_inputs = _ints(b, fb.ChainStartInputsVector, (), "PrependInt32")
    chain_outputs = _ints(b, fb.ChainStartOutputsVector, (), "PrependInt32")
    instructions = _tables(b, fb.ChainStartInstructionsVector, [_instruction(b, i) for i in method.instructions])
    fb.ChainStart(b)
    fb.ChainAddInputs(b, chain_inputs)
    fb.ChainAddOutputs(b, chain_outputs)
    fb.ChainAddInstructions(b, instructions)
    chains = _tables(b, fb.ExecutionPlanStartChainsVector, [fb.ChainEnd(b)])
    operators = []
    for op_name, overload in method.operators:
        name_str, overload_str = b.CreateString(op_name), b.CreateString(overload)
        fb.OperatorStart(b)
        fb.OperatorAddName(b, name_str)
        fb.OperatorAddOverload(b, overload_str)
        operators.append(fb.OperatorEnd(b))
    operator_vector = _tables(b, fb.ExecutionPlanStartOperatorsVector, operators)
    delegates = []
    for delegate, segment in zip(method.delegates, delegate_segments):
        backend = b.CreateString(delegate.backend_id)
        fb.BackendDelegateDataReferenceStart(b)
        fb.BackendDelegateDataReferenceAddLocation(b, fb.DataLocation.SEGMENT)
        fb.BackendDelegateDataReferenceAddIndex(b, segment)
        processed = fb.BackendDelegateDataReferenceEnd(b)
        specs = []
        for key, spec_value in delegate.compile_specs:
            key_str = b.CreateString(key)
            spec_bytes = _ints(b, fb.CompileSpecStartValueVector, spec_value, "PrependUint8")
            fb.CompileSpecStart(b)
            fb.CompileSpecAddKey(b, key_str)
            fb.CompileSpecAddValue(b, spec_bytes)
            specs.append(fb.CompileSpecEnd(b))
        spec_vector = _tables(b, fb.BackendDelegateStartCompileSpecsVector, specs)
        fb.BackendDelegateStart(b)
        fb.BackendDelegateAddId(b, backend)
        fb.BackendDelegateAddProcessed(b, processed)
        fb.BackendDelegateAddCompileSpecs(b, spec_vector)
        delegates.append(fb.BackendDelegateEnd(b))
    delegate_vector = _tables(b, fb.ExecutionPlanStartDelegatesVector, delegates)
    arenas = _ints(b, fb.ExecutionPlanStartNonConstBufferSizesVector, plan.arena_sizes, "PrependInt64")
    fb.ExecutionPlanStart(b)
    fb.ExecutionPlanAddName(b, name)
    fb.ExecutionPlanAddContainerMetaType(b, container)
    fb.ExecutionPlanAddValues(b, values)
    fb.ExecutionPlanAddInputs(b, inputs)
    fb.ExecutionPlanAddOutputs(b, outputs)
    fb.ExecutionPlanAddChains(b, chains)
    fb.ExecutionPlanAddOperators(b, operator_vector)
    fb.ExecutionPlanAddDelegates(b, delegate_vector)
    fb.ExecutionPlanAddNonConstBufferSizes(b, arenas)
    return int(fb.ExecutionPlanEnd(b))


def program_flatbuffer(program: ProgramBuilder, layout: SegmentLayout,
                       plans: Sequence[MemoryPlan]) -> bytes:
    """The ET12 flatbuffer of ``program`` (without the extended header)."""
    b = flatbuffers.Builder(1024)
    plan_tables = [_execution_plan(b, m, p, s) for m, p, s in zip(program.methods, plans, layout.delegate_segments)]
    execution_plan = _tables(b, fb.ProgramStartExecutionPlanVector, plan_tables)
    constant_buffer = _tables(b, fb.ProgramStartConstantBufferVector, [])
    inline_data = _tables(b, fb.ProgramStartBackendDelegateDataVector, [])
    segment_tables = []
    for segment in layout.segments:
        fb.DataSegmentStart(b)
        fb.DataSegmentAddOffset(b, segment.offset)
        fb.DataSegmentAddSize(b, segment.size)
        segment_tables.append(fb.DataSegmentEnd(b))
    segments = _tables(b, fb.ProgramStartSegmentsVector, segment_tables)
    offsets = _ints(b, fb.SubsegmentOffsetsStartOffsetsVector, layout.constant_offsets, "PrependUint64")
    fb.SubsegmentOffsetsStart(b)
    fb.SubsegmentOffsetsAddSegmentIndex(b, 0)
    fb.SubsegmentOffsetsAddOffsets(b, offsets)
    constant_segment = fb.SubsegmentOffsetsEnd(b)
    mutable = None
    if layout.mutable_offsets:
        mutable_offsets = _ints(b, fb.SubsegmentOffsetsStartOffsetsVector, layout.mutable_offsets, "PrependUint64")
        fb.SubsegmentOffsetsStart(b)
        fb.SubsegmentOffsetsAddSegmentIndex(b, 1)
        fb.SubsegmentOffsetsAddOffsets(b, mutable_offsets)
        mutable = _tables(b, fb.ProgramStartMutableDataSegmentsVector, [fb.SubsegmentOffsetsEnd(b)])
    named = None
    if program.named_data:
        entries = []
        for key, segment_index in layout.named_segments:
            key_str = b.CreateString(key)
            fb.NamedDataStart(b)
            fb.NamedDataAddKey(b, key_str)
            fb.NamedDataAddSegmentIndex(b, segment_index)
            entries.append(fb.NamedDataEnd(b))
        named = _tables(b, fb.ProgramStartNamedDataVector, entries)
    fb.ProgramStart(b)
    fb.ProgramAddVersion(b, 0)
    fb.ProgramAddExecutionPlan(b, execution_plan)
    fb.ProgramAddConstantBuffer(b, constant_buffer)
    fb.ProgramAddBackendDelegateData(b, inline_data)
    fb.ProgramAddSegments(b, segments)
    fb.ProgramAddConstantSegment(b, constant_segment)
    if mutable is not None:
        fb.ProgramAddMutableDataSegments(b, mutable)
    if named is not None:
        fb.ProgramAddNamedData(b, named)
    b.Finish(fb.ProgramEnd(b), file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


# ---------------------------------------------------------------------- the file


def program_chunks(program: ProgramBuilder) -> Iterator[Blob]:
    """The ``.pte`` of ``program``, piece by piece (joined: the file)::

        [0, P)        the ET12 flatbuffer with the extended header at bytes 8..40
                      (header.py); P = 32 + flatbuffer size = "program size"
        [P, B)        zeros; B = P rounded up to 128 = "segment base offset"
        B + offset_0  segment 0: the constant segment, constant i at its offset
                      constant_segment.offsets[i], each but the last zero-padded to 16
        ...           zeros to the next multiple of 128 (from the file start), then the
                      next segment: each delegate payload, then each named-data blob;
                      Program.segments[i] = (offset_i, size_i), offsets from B
        end           B + "segment data size" (no padding after the last segment)

    Without segment data (no constants, delegates or named data) the file is the bare
    flatbuffer: no extended header, nothing after it.  A ``Chunked`` payload is read as
    its segment is written, and must produce exactly its declared size.
    """
    if not program.methods:
        raise XnnquantError("a program needs at least one method: add one with ProgramBuilder.method()")
    layout = SegmentLayout.of(program)
    plans = [plan_memory(m) for m in program.methods]
    flatbuffer = program_flatbuffer(program, layout, plans)
    if layout.data_size == 0:
        yield flatbuffer
        return
    size = header.LENGTH + len(flatbuffer)
    base = _align(size, PTE_SEGMENT_ALIGNMENT)
    yield header.insert(flatbuffer, header.ExtendedHeader(size, base, layout.data_size)) + bytes(base - size)
    at = 0
    for index, segment in enumerate(layout.segments):
        if segment.view:  # its bytes are those of the segment it lies in
            continue
        if segment.offset > at:
            yield bytes(segment.offset - at)
        for piece in segment.pieces:
            if isinstance(piece, Chunked):
                got = 0
                for chunk in piece.chunks:
                    got += len(chunk)
                    yield chunk
                if got != piece.size:
                    raise XnnquantError(f"segment {index} was declared {piece.size} bytes, its chunks gave {got}")
            else:
                yield piece
        at = segment.offset + segment.size
