"""The exact bytes XNNPACK reads: int4 nibbles, bf16 scales, conv weight layouts."""

from ..rounding import Bf16, bf16_bits_to_float32, to_bf16
from .conv import conv_weight, depthwise_weight, transposed_conv_weight
from .gemm import pack_gemm
from .gemm_configs import kernel_configs
from .int4 import pack_int4, pack_int4_high_first, unpack_int4

__all__ = [
    "Bf16",
    "bf16_bits_to_float32",
    "conv_weight",
    "depthwise_weight",
    "kernel_configs",
    "pack_gemm",
    "pack_int4",
    "pack_int4_high_first",
    "to_bf16",
    "transposed_conv_weight",
    "unpack_int4",
]
