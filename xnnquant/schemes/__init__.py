"""Quantization schemes (being written: see issue "schemes")."""


def _pending(*_args, **_kwargs):
    raise NotImplementedError("xnnquant.schemes is being written")


quantize_per_tensor = quantize_per_channel = quantize_blockwise = _pending
quantize_bias = quantize_per_token = _pending
