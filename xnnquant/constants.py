"""XNNPACK's and ExecuTorch's numbers, each defined once, under its C (or Python) name.

Sources: XNNPACK at commit 1adaa7c7 (the one in executorch 1.4.1) and ExecuTorch 1.4.1.
Every other module imports these; none restates them.
"""

from __future__ import annotations

import numpy as np

# --- include/xnnpack.h (XNNPACK 1adaa7c7) ----------------------------------------------

#: Most dimensions a tensor value may have.
XNN_MAX_TENSOR_DIMS = 6
#: "No value": a missing bias, an internal (non-external) value.
XNN_INVALID_VALUE_ID = 0xFFFFFFFF
#: Least block size of blockwise (qbint4) operators; block sizes are multiples of it.
XNN_MIN_BLOCKSIZE = 32
#: Entries XNNPACK may read past the end of an ``xnn_quantization_params`` array.
XNN_EXTRA_QUANTIZATION_PARAMS = 15
#: Bytes a kernel may read past the end of an input: 16, or 128 on Hexagon.  We pad by
#: the larger value, which is safe on every CPU.
XNN_EXTRA_BYTES = 128

# value flags (xnn_define_tensor_value)
XNN_VALUE_FLAG_EXTERNAL_INPUT = 0x1
XNN_VALUE_FLAG_EXTERNAL_OUTPUT = 0x2

# node flags (several share a bit: each node kind reads only its own)
XNN_FLAG_TRANSPOSE_WEIGHTS = 0x1  # fully connected: the filter is [IC, OC]
XNN_FLAG_TRANSPOSE_B = XNN_FLAG_TRANSPOSE_WEIGHTS  # batch matrix multiply: b is [..., N, K]
XNN_FLAG_TENSORFLOW_SAME_PADDING = 0x4  # convolution, pooling: padding computed as TF "SAME"
XNN_FLAG_TENSORFLOW_LEGACY_MODE = 0x4  # resize bilinear: TensorFlow 1.x sampling
XNN_FLAG_ALIGN_CORNERS = 0x8  # resize bilinear
XNN_FLAG_TRANSIENT_INDIRECTION_BUFFER = 0x20  # convolution
XNN_FLAG_KEEP_DIMS = 0x40  # global average pooling, reductions: keep reduced dims as 1

# runtime flags (xnn_create_runtime_v4)
XNN_FLAG_BASIC_PROFILING = 0x8

# --- src/xnnpack/common.h (XNNPACK 1adaa7c7) --------------------------------------------

#: Alignment of XNNPACK's allocations on x86-64 (not mobile): packed weight buffers are
#: a multiple of it.  Not the payload's constant alignment (CONSTANT_TENSOR_ALIGNMENT).
XNN_ALLOCATION_ALIGNMENT = 64

# --- <float.h>; XNNPACK refuses any scale that is not a positive normal float -----------

#: The smallest positive normal float32, 2**-126.
FLT_MIN = np.float32(np.finfo(np.float32).tiny)

# --- ExecuTorch 1.4.1 -------------------------------------------------------------------

#: backends/xnnpack/serialization/xnnpack_graph_serialize.py: the XNNHeader places the
#: flatbuffer and the constant segment at multiples of it, every constant in the segment
#: starts at one, and backends/xnnpack/operators/node_visitor.py aligns named data to it.
CONSTANT_TENSOR_ALIGNMENT = 16

#: backends/xnnpack/runtime/XNNCompiler.cpp: most external values a payload may declare.
MAX_NUM_EXTERNS = 4096

#: backends/xnnpack/runtime/XNNCompiler.cpp (convertF32TensorToBF16): the factor an fp32
#: blockwise scale is multiplied by before the runtime keeps the product's upper 16 bits.
RUNTIME_BF16_FACTOR = np.float32(1.00389105)

# --- ExecuTorch 1.4.1 programs (.pte) ---------------------------------------------------

#: backends/xnnpack/xnnpack_preprocess.py (the name of its BackendDetails class): the backend
#: id of XNNPACK delegates, under which the runtime registers its XNNPACK backend.
XNNPACK_BACKEND_ID = "XnnpackBackend"

#: exir/tensor.py ALIGNMENT: a planned tensor starts at a multiple of it and takes a whole
#: multiple of it; a constant tensor starts at a multiple of it in the constant segment.
PTE_TENSOR_ALIGNMENT = 16
#: exir/_serialize/_program.py (serialize_pte_binary's default): the segment base and every
#: segment start at multiples of it, counted from the start of the file.
PTE_SEGMENT_ALIGNMENT = 128
#: exir/memory_planning.py (apply_algo): bytes planned after a method's last tensor when the
#: method calls an XNNPACK delegate, whose kernels may read past the end of a tensor.
PTE_XNNPACK_EXTRA_PLANNED_BYTES = 64
