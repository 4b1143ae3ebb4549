"""Vector steps of the compiled loops: numba intrinsics written in LLVM IR.

Each function here runs over ``count`` vectors of ``LANES`` consecutive values of a flat
array, each an LLVM vector (``<32 x float>``) that the backend splits into the target's
registers: two zmm on any AVX-512 CPU, four ymm on an AVX2 one.  A loop written element
by element is vectorized as each target's tuning decides: on a Zen 4, 16 lanes unrolled
4 times, so a 32-value block never reaches the vector loop and runs in its 8-lane
epilogue; on Intel's AVX-512 server parts, whose tuning prefers 256-bit vectors for the
loops LLVM vectorizes itself, 8 lanes unrolled 4 times.  These steps are the same whole
vectors on every target.

The operations and their order are those of the element-wise loops, so the results are
the same bits:

* ``max_abs_bits``: the largest ``bits(x) & 0x7FFFFFFF``, the bit patterns of ``|x|``
  read as uint32 (they order as the values do, NaN's above +inf's); ``block_maxima``: the
  same of 16 blocks of one vector at once;
* ``codes``: ``int(rint(clip(x * inv, lo, hi))) + zero_point`` stored in 8 bits, equal to
  ``clip(rint(x * inv) + zero_point, lo + zero_point, hi + zero_point)`` because ``lo`` and
  ``hi`` are integers (``rint`` is monotonic and keeps integers); the conversion rounds to
  nearest even in the default floating-point environment, as ``np.rint`` does;
* ``capped_codes``: the same with no ``lo`` and no zero point, for min-max scales, whose
  products never round below ``qmin``;
* ``pack_pairs``: int8 codes two to a byte (``packing.int4.pack_int4``'s nibbles), and
  whether every code lay in [-8, 7].

The caller keeps every vector inside its arrays: nothing here checks bounds.  numba
caches the loops' machine code keyed on ``loops.py`` alone: after an edit here, touch
``loops.py`` (or clear its ``__pycache__``) so that they are compiled again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from llvmlite import ir  # type: ignore[import-untyped]  # numba's, untyped
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

#: Values per vector: XNNPACK's least block size, so a qb4w group is whole vectors.
LANES = 32

_I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()


def _vector(kind: ir.Type, lanes: int = LANES) -> ir.VectorType:
    return ir.VectorType(kind, lanes)


def _constant(kind: ir.Type, value: int | float, lanes: int = LANES) -> ir.Constant:
    return ir.Constant(_vector(kind, lanes), [value] * lanes)


def _splat(builder: ir.IRBuilder, value: ir.Value) -> ir.Value:
    """``value`` in every lane."""
    undef = ir.Constant(_vector(value.type), ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undef, _constant(_I32, 0))


def _call(builder: ir.IRBuilder, name: str, result: ir.Type, *args: ir.Value) -> ir.Value:
    function_type = ir.FunctionType(result, [a.type for a in args])
    return builder.call(cgutils.get_or_insert_function(builder.module, function_type, name), args)


class _Flat:
    """A 1-D C-contiguous array argument: vectors loaded from and stored to it."""

    def __init__(self, context: Any, builder: ir.IRBuilder, array_type: types.Array, array: ir.Value) -> None:
        self.builder = builder
        self.data = context.make_array(array_type)(context, builder, array).data

    def _pointer(self, index: ir.Value, vector: ir.VectorType) -> ir.Value:
        return self.builder.bitcast(self.builder.gep(self.data, [index], inbounds=True), vector.as_pointer())

    def load(self, index: ir.Value, vector: ir.VectorType) -> ir.Value:
        """The ``vector.count`` elements from ``index``, as ``vector``."""
        return self.builder.load(self._pointer(index, vector), align=1)

    def store(self, index: ir.Value, value: ir.Value) -> None:
        self.builder.store(value, self._pointer(index, value.type), align=1)


@contextmanager
def _vectors(builder: ir.IRBuilder, start: ir.Value, count: ir.Value, step: int) -> Iterator[ir.Value]:
    """Loop over ``count`` vectors: yields each one's first index, ``start + step * i``."""
    count = builder.sext(count, start.type) if count.type.width < start.type.width else count
    with cgutils.for_range(builder, count) as loop:
        yield builder.add(start, builder.mul(loop.index, ir.Constant(start.type, step)))


def _is_flat(array: types.Type, *dtypes: types.Type) -> bool:
    return isinstance(array, types.Array) and array.ndim == 1 and array.layout == "C" and array.dtype in dtypes


def _are_ints(*values: types.Type) -> bool:
    return all(isinstance(v, types.Integer) for v in values)


@intrinsic
def max_abs_bits(typingctx, x, start, count):  # type: ignore[no-untyped-def]
    """``max(bits(x[j]) & 0x7FFFFFFF for j in [start, start + count * LANES))`` as uint32
    (0 when ``count`` is 0); ``x`` float32 1-D C."""
    if not (_is_flat(x, types.float32) and _are_ints(start, count)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_arg, start_arg, count_arg = args
        values = _Flat(context, builder, signature.args[0], x_arg)
        top = cgutils.alloca_once_value(builder, _constant(_I32, 0))
        with _vectors(builder, start_arg, count_arg, LANES) as i:
            magnitude = builder.and_(values.load(i, _vector(_I32)), _constant(_I32, 0x7FFFFFFF))
            builder.store(_call(builder, f"llvm.umax.v{LANES}i32", _vector(_I32), builder.load(top), magnitude), top)
        return _call(builder, f"llvm.vector.reduce.umax.v{LANES}i32", _I32, builder.load(top))

    return types.uint32(x, start, count), codegen


#: Blocks of one vector each whose maxima ``block_maxima`` finds together.
BLOCKS = LANES // 2


@intrinsic
def block_maxima(typingctx, x, start, top, first):  # type: ignore[no-untyped-def]
    """``top[first + b] = max_abs_bits(x, start + b * LANES, 1)`` for ``b < BLOCKS``: the
    maxima of 16 blocks of one vector each (qb4w's groups of 32), ``x`` float32 and ``top``
    uint32, both 1-D C.

    Each block's vector is folded once (the larger of its two halves: 16 partial maxima),
    then the vectors are merged two by two, each lane the larger of two partials::

        16 vectors: 16 partials of 1 block        4 vectors: 4 partials of each of 4 blocks
         8 vectors:  8 partials of each of 2       2 vectors: 2 of each of 8
                     blocks, side by side          1 vector:  the maxima of blocks 0 .. 15

    about 3 operations a block, against 8 to reduce each block's vector on its own.
    """
    if not (_is_flat(x, types.float32) and _is_flat(top, types.uint32) and _are_ints(start, first)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_arg, start_arg, top_arg, first_arg = args
        values = _Flat(context, builder, signature.args[0], x_arg)
        half = _vector(_I32, BLOCKS)

        def larger(a: ir.Value, b: ir.Value) -> ir.Value:
            return _call(builder, f"llvm.umax.v{BLOCKS}i32", half, a, b)

        def pick(a: ir.Value, b: ir.Value, lanes: list[int]) -> ir.Value:
            return builder.shuffle_vector(a, b, ir.Constant(half, lanes))

        merged = []
        for b in range(BLOCKS):
            index = builder.add(start_arg, ir.Constant(start_arg.type, b * LANES))
            v = builder.and_(values.load(index, _vector(_I32)), _constant(_I32, 0x7FFFFFFF))
            merged.append(larger(pick(v, v, list(range(BLOCKS))), pick(v, v, list(range(BLOCKS, LANES)))))
        blocks = 1  # blocks a vector holds, each as BLOCKS // blocks partials side by side
        while len(merged) > 1:
            width = BLOCKS // blocks
            low = [base + k * width + j for base in (0, BLOCKS) for k in range(blocks) for j in range(width // 2)]
            high = [lane + width // 2 for lane in low]
            merged = [larger(pick(a, b, low), pick(a, b, high)) for a, b in zip(merged[0::2], merged[1::2])]
            blocks *= 2
        _Flat(context, builder, signature.args[2], top_arg).store(first_arg, merged[0])
        return context.get_dummy_value()

    return types.void(x, start, top, first), codegen


def _codes_codegen(lo: bool, zero_point: bool):  # type: ignore[no-untyped-def]
    """Code generation of ``codes`` (``lo`` and ``zero_point`` given) or ``capped_codes``."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        x_arg, start_arg, count_arg, inv_arg, *bounds, out_arg = args
        values = _Flat(context, builder, signature.args[0], x_arg)
        out = _Flat(context, builder, signature.args[-1], out_arg)
        inv = _splat(builder, inv_arg)
        low = _splat(builder, bounds.pop(0)) if lo else None
        high = _splat(builder, bounds.pop(0))
        shift = _splat(builder, bounds.pop(0)) if zero_point else None
        with _vectors(builder, start_arg, count_arg, LANES) as i:
            t = builder.fmul(values.load(i, _vector(_F32)), inv)
            if low is not None:
                t = builder.select(builder.fcmp_ordered("<", t, low), low, t)
            t = builder.select(builder.fcmp_ordered(">", t, high), high, t)
            q = _call(builder, f"llvm.lrint.v{LANES}i32.v{LANES}f32", _vector(_I32), t)
            if shift is not None:
                q = builder.add(q, shift)
            out.store(i, builder.trunc(q, _vector(_I8)))
        return context.get_dummy_value()

    return codegen


def _codes_typed(x: types.Type, start: types.Type, count: types.Type, out: types.Type) -> bool:
    return _is_flat(x, types.float32) and _are_ints(start, count) and _is_flat(out, types.int8, types.uint8)


@intrinsic
def codes(typingctx, x, start, count, inv, lo, hi, zero_point, out):  # type: ignore[no-untyped-def]
    """``out[j] = int(rint(clip(x[j] * inv, lo, hi))) + zero_point`` for ``j`` in ``[start,
    start + count * LANES)``: ``x`` float32 1-D C without NaN (a product beyond float32 is
    +-inf, clipped to ``lo`` / ``hi``), ``inv``, ``lo <= hi`` float32 integers, ``zero_point``
    int32, ``out`` int8 or uint8 1-D C (the low 8 bits of each code)."""
    if not (_codes_typed(x, start, count, out) and inv == lo == hi == types.float32 and zero_point == types.int32):
        return None
    return types.void(x, start, count, inv, lo, hi, zero_point, out), _codes_codegen(lo=True, zero_point=True)


@intrinsic
def capped_codes(typingctx, x, start, count, inv, hi, out):  # type: ignore[no-untyped-def]
    """``out[j] = int(rint(min(x[j] * inv, hi)))``: ``codes`` for values whose ``rint(x * inv)``
    is ``lo`` or more already, without a zero point."""
    if not (_codes_typed(x, start, count, out) and inv == hi == types.float32):
        return None
    return types.void(x, start, count, inv, hi, out), _codes_codegen(lo=False, zero_point=False)


@intrinsic
def pack_pairs(typingctx, codes, start, count, packed):  # type: ignore[no-untyped-def]
    """Codes ``codes[start : start + 2 * LANES * count]`` (int8 1-D C) two to a byte into
    ``packed[start // 2 : ...]`` (uint8 1-D C, ``start`` even); True if every code lay in
    [-8, 7] (``packed`` is meaningless otherwise)::

        c = code + 8 (mod 256)          in range: 0 .. 15, bits 7..4 clear
        pair j (little-endian uint16)   bits 15..8: c[2j+1]   bits 7..0: c[2j]
        packed[j] = low byte of (pair | pair >> 4)
                                        bits  7..4: c[2j+1]   bits 3..0: c[2j]
    """
    if not (_is_flat(codes, types.int8) and _are_ints(start, count) and _is_flat(packed, types.uint8)):
        return None

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        codes_arg, start_arg, count_arg, packed_arg = args
        source = _Flat(context, builder, signature.args[0], codes_arg)
        out = _Flat(context, builder, signature.args[3], packed_arg)
        high = cgutils.alloca_once_value(builder, _constant(_I8, 0, 2 * LANES))
        with _vectors(builder, start_arg, count_arg, 2 * LANES) as i:
            c = builder.add(source.load(i, _vector(_I8, 2 * LANES)), _constant(_I8, 8, 2 * LANES))
            builder.store(builder.or_(builder.load(high), c), high)
            pairs = builder.bitcast(c, _vector(_I16))
            byte = builder.trunc(builder.or_(pairs, builder.lshr(pairs, _constant(_I16, 4))), _vector(_I8))
            out.store(builder.lshr(i, ir.Constant(i.type, 1)), byte)
        seen = _call(builder, f"llvm.vector.reduce.or.v{2 * LANES}i8", _I8, builder.load(high))
        return builder.icmp_unsigned("<", seen, ir.Constant(_I8, 16))

    return types.boolean(codes, start, count, packed), codegen
