"""Sequential calibration through the exported graph (``frontend/calibration.py``): layers
found by the graph (convolutions and functional linears too), batches of other shapes than
the example, padding masks, and the errors of bad batches.

Oracles: each layer's statistics are recomputed by hand from the definition, on inputs that
an eager copy of the module computes with the already-quantized layers before it
(``nn.Module`` forward hooks, no graph); a convolution's rows are cut from its input with
explicit window loops in numpy, not with ``unfold``; the Gram's column order is checked
against ``torch.nn.functional.conv2d`` itself (the output error of a filter change).
The quantized codes by hand must appear byte for byte in the exported payload.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.frontend import eager
from xnnquant.frontend.calibration import Rows, layer_rows

torch = pytest.importorskip("torch")
F = torch.nn.functional


# ------------------------------------------------------------------ convolution rows


def _windows(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int],
             dilation: tuple[int, int]) -> np.ndarray:
    """im2col by loops: ``x`` NCHW -> rows ``(N, OH, OW, KH * KW * C)``, each window in
    (kh, kw, c) order, c fastest (an OHWI filter's row flattened)."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
    padded = np.zeros((n, c, h + 2 * ph, w + 2 * pw), x.dtype)
    padded[:, :, ph:ph + h, pw:pw + w] = x
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.empty((n, oh, ow, kh * kw * c), x.dtype)
    for i in range(oh):
        for j in range(ow):
            values = [padded[:, :, i * sh + a * dh, j * sw + b * dw] for a in range(kh) for b in range(kw)]
            out[:, i, j] = np.stack(values, axis=1).reshape(n, -1)  # (N, KH*KW, C) -> c fastest
    return out


def test_im2col_rows_are_the_windows_in_the_stored_filter_order() -> None:
    x = torch.randn(2, 3, 9, 8)
    geometry = Rows("im2col", (3, 2), (2, 1), (1, 0), (1, 2))
    got = layer_rows(x, geometry).numpy()
    np.testing.assert_array_equal(got, _windows(x.numpy(), (3, 2), (2, 1), (1, 0), (1, 2)))


@pytest.mark.parametrize("geometry", [Rows("im2col", (3, 2), (2, 1), (1, 0), (1, 2)), Rows("pixels")])
def test_gram_of_the_rows_gives_the_convolution_output_error(geometry: Rows) -> None:
    """``|conv(x, d)|^2 = sum_o d_o^T G d_o`` with ``d_o`` the OHWI rows of a filter change
    ``d``: the Gram's columns are the stored filter's, in its order (torch's own conv2d)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 9, 8, generator=gen)
    kernel = geometry.kernel
    d = torch.randn(5, 3, *kernel, generator=gen)
    cal = xq.Calibration(3 * kernel[0] * kernel[1]).add(layer_rows(x, geometry))
    want = float((F.conv2d(x.double(), d.double(), stride=geometry.stride, padding=geometry.padding,
                           dilation=geometry.dilation) ** 2).sum())
    rows = d.permute(0, 2, 3, 1).reshape(5, -1).double().numpy()
    got = float(np.einsum("ok,kl,ol->", rows, cal.gram, rows))
    assert got == pytest.approx(want, rel=1e-5)  # float32 products in the Gram: ~1e-7 each


# ------------------------------------------------------------------ sequential, by hand


class ConvNet(torch.nn.Module):
    """A regular convolution, a strided one with dilation, a pointwise one, a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, dilation=1)
        self.c3 = torch.nn.Conv2d(16, 24, 1)
        self.fc = torch.nn.Linear(24 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.c1(x))
        x = F.relu(self.c2(x))
        x = torch.tanh(self.c3(x))
        return self.fc(x.flatten(1))


def _hand_sequential(module: torch.nn.Module, batches: list[tuple[Any, ...]], layers: dict[str, Rows],
                     quantize: Callable[[np.ndarray, xq.Calibration], xq.QuantizedTensor],
                     masks: list[np.ndarray] | None = None) -> dict[str, xq.QuantizedTensor]:
    """Each layer in ``layers`` (in call order) quantized on the inputs an eager twin computes
    with the layers before it holding their dequantized weights."""
    twin = copy.deepcopy(module)
    out: dict[str, xq.QuantizedTensor] = {}
    for name, rows in layers.items():
        layer = twin.get_submodule(name)
        seen: list[np.ndarray] = []

        def record(_: Any, args: tuple[Any, ...], seen: list[np.ndarray] = seen) -> None:
            seen.append(args[0].detach().numpy().copy())

        handle = layer.register_forward_pre_hook(record)
        with torch.no_grad():
            for batch in batches:
                twin(*batch)
        handle.remove()
        w = layer.weight.detach().numpy()
        if rows.kind == "im2col":
            k = rows.kernel[0] * rows.kernel[1] * w.shape[1]
            cal = xq.Calibration(k)
            for x in seen:
                cal.add(_windows(x, rows.kernel, rows.stride, rows.padding, rows.dilation))
            stored = w.transpose(0, 2, 3, 1).reshape(w.shape[0], -1)
        elif rows.kind == "pixels":
            cal = xq.Calibration(w.shape[1])
            for x in seen:
                cal.add(x.transpose(0, 2, 3, 1))
            stored = w.reshape(w.shape[0], w.shape[1])
        else:
            cal = xq.Calibration(w.shape[1])
            for b, x in enumerate(seen):
                cal.add(x, mask=None if masks is None else masks[b])
            stored = w
        qt = quantize(stored, cal)
        out[name] = qt
        dq = qt.dequantize().reshape(stored.shape)
        if rows.kind == "im2col":
            dq = dq.reshape(w.shape[0], rows.kernel[0], rows.kernel[1], w.shape[1]).transpose(0, 3, 1, 2)
        layer.weight = torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(dq.reshape(w.shape))))
    return out


def test_convolutions_are_calibrated_and_quantized_sequentially() -> None:
    torch.manual_seed(0)
    module = ConvNet().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 10, 10, generator=gen),) for _ in range(2)]
    exported = xq.export(module, batches[0], weights="qc8w", method="gptq", calibration=batches, progress=False)
    payload = exported.to_bytes()
    layers = {"c1": Rows("im2col", (3, 3), (1, 1), (1, 1), (1, 1)), "c2": Rows("im2col", (3, 3), (2, 2)),
              "c3": Rows("pixels"), "fc": Rows("last")}
    by_hand = _hand_sequential(module, batches, layers,
                               lambda w, cal: xq.quantize_per_channel(w, 8, method="gptq", calibration=cal))
    for name, qt in by_hand.items():
        assert qt.to_bytes() in payload, name  # int8 codes: an OHWI filter's bytes are its rows'
    assert {row.path: row.scheme for row in exported.report} == {"c1": "qc8w", "c2": "qc8w", "c3": "qc8w",
                                                                  "fc": "qc8w"}
    # the oracle can tell: calibrated on the float model's activations, c2 differs
    floating = _hand_sequential(module, batches, {"c2": layers["c2"]},
                                lambda w, cal: xq.quantize_per_channel(w, 8, method="gptq", calibration=cal))
    assert floating["c2"].to_bytes() != by_hand["c2"].to_bytes()
    report = xq.verify(exported, batches[0], module)
    assert report.ok, str(report)


class ConvNet1d(torch.nn.Module):
    """1-D convolutions (as Whisper's encoder starts): padded, strided, pointwise; a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv1d(4, 8, 3, padding=1)
        self.c2 = torch.nn.Conv1d(8, 16, 3, stride=2, padding=1)
        self.c3 = torch.nn.Conv1d(16, 24, 1)
        self.fc = torch.nn.Linear(24 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.c1(x))
        x = F.gelu(self.c2(x))
        return self.fc(torch.tanh(self.c3(x)).flatten(1))


class Height1(torch.nn.Module):
    """``ConvNet1d`` as 2-D convolutions of height 1 (the oracle's twin: its inputs ``[N, C, 1, L]``)."""

    def __init__(self, one_d: ConvNet1d) -> None:
        super().__init__()
        for name in ("c1", "c2", "c3"):
            c = one_d.get_submodule(name)
            two = torch.nn.Conv2d(c.in_channels, c.out_channels, (1, c.kernel_size[0]), stride=(1, c.stride[0]),
                                  padding=(0, c.padding[0]))
            two.weight = torch.nn.Parameter(c.weight.detach().unsqueeze(2).clone())
            two.bias = torch.nn.Parameter(c.bias.detach().clone())
            setattr(self, name, two)
        self.fc = copy.deepcopy(one_d.fc)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.c1(x))
        x = F.gelu(self.c2(x))
        return self.fc(torch.tanh(self.c3(x)).flatten(1))


def test_one_d_convolutions_are_calibrated_as_two_d_ones_of_height_one() -> None:
    """GPTQ on 1-D convolutions (they were refused: no statistics): the codes of the 2-D twin of
    height 1 calibrated by hand, whose OHWI filters ``[OC, 1, K, C]`` are what the lowering stores."""
    torch.manual_seed(0)
    module = ConvNet1d().eval()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 4, 12, generator=gen),) for _ in range(2)]
    exported = xq.export(module, batches[0], weights="qc8w", method="gptq", calibration=batches, progress=False)
    payload = exported.to_bytes()
    layers = {"c1": Rows("im2col", (1, 3), (1, 1), (0, 1)), "c2": Rows("im2col", (1, 3), (1, 2), (0, 1)),
              "c3": Rows("pixels"), "fc": Rows("last")}
    by_hand = _hand_sequential(Height1(module).eval(), [(x.unsqueeze(2),) for (x,) in batches], layers,
                               lambda w, cal: xq.quantize_per_channel(w, 8, method="gptq", calibration=cal))
    for name, qt in by_hand.items():
        assert qt.to_bytes() in payload, name
    assert {row.path: row.scheme for row in exported.report} == dict.fromkeys(layers, "qc8w")
    # the oracle can tell: calibrated on the float model's activations, the linear differs
    floating = _hand_sequential(Height1(module).eval(), [(x.unsqueeze(2),) for (x,) in batches], {"fc": layers["fc"]},
                                lambda w, cal: xq.quantize_per_channel(w, 8, method="gptq", calibration=cal))
    assert floating["fc"].to_bytes() != by_hand["fc"].to_bytes()


def test_act_mse_on_a_convolution() -> None:
    torch.manual_seed(0)
    module = ConvNet().eval()
    batches = [(torch.randn(2, 3, 10, 10),)]
    exported = xq.export(module, batches[0], weights="qc8w", method="act_mse", calibration=batches, progress=False)
    by_hand = _hand_sequential(module, batches, {"c1": Rows("im2col", (3, 3), (1, 1), (1, 1), (1, 1))},
                               lambda w, cal: xq.quantize_per_channel(w, 8, method="act_mse", calibration=cal))
    assert by_hand["c1"].to_bytes() in exported.to_bytes()


class Grouped(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, groups=groups)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def test_grouped_convolutions_are_refused_and_depthwise_ones_stay_fp32() -> None:
    x = torch.randn(2, 8, 6, 6)
    with pytest.raises(UnsupportedConfigError,
                       match=r"module conv\): method 'gptq' has no calibration statistics for this layer: got none, "
                             r"expected the inputs of a linear or a one-group convolution reached by the calibration "
                             r"batches \(grouped, depthwise and transposed convolutions are not calibrated\); export "
                             r"such a model with method='mse'"):
        xq.export(Grouped(2).eval(), (x,), weights="qc8w", method="gptq", calibration=[(x,)], progress=False)
    exported = xq.export(Grouped(8).eval(), (x,), weights="qc8w", method="gptq", calibration=[(x,)], progress=False)
    assert [row.scheme for row in exported.report] == ["fp32"]  # depthwise: qc8w refused, nothing to calibrate


class Functional(torch.nn.Module):
    """A linear computed by F.linear from a parameter of its own, and a product by a constant."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.mix = torch.nn.Parameter(torch.randn(64, 32) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.linear(x, self.proj)) @ self.mix


def test_functional_linears_and_products_by_constants_are_calibrated() -> None:
    torch.manual_seed(0)
    module = Functional().eval()
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(48, 64, generator=gen) * torch.linspace(0.2, 3, 64),) for _ in range(2)]
    exported = xq.export(module, batches[0], weights="qb4w:32", method="gptq", calibration=batches, progress=False)
    first = xq.Calibration(64)
    for (x,) in batches:
        first.add(x)
    proj = xq.quantize_blockwise(module.proj.detach().numpy(), 32, "gptq", calibration=first)
    second = xq.Calibration(64)
    for (x,) in batches:
        second.add(torch.relu(F.linear(x, torch.from_numpy(proj.dequantize()))))
    mix = xq.quantize_blockwise(np.ascontiguousarray(module.mix.detach().numpy().T), 32, "gptq", calibration=second)
    payload = exported.to_bytes()
    assert proj.to_bytes() in payload and mix.to_bytes() in payload
    assert sorted(row.path for row in exported.report) == ["mix", "proj"]


# ------------------------------------------------------------------ other shapes, masks


class Encoder(torch.nn.Module):
    """Shapes flow into views (heads), as in a transformer; padding enters as a mask input."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(64, 64)
        self.k = torch.nn.Linear(64, 64)
        self.v = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 64)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q = self.q(h).view(b, t, 4, 16).transpose(1, 2)
        k = self.k(h).view(b, t, 4, 16).transpose(1, 2)
        v = self.v(h).view(b, t, 4, 16).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / 4 + ((1 - mask) * -1e4)[:, None, None, :]
        context = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, t, 64)
        return self.out(context)


def _encoder_batches(lengths: list[int], seed: int = 4) -> list[tuple[Any, Any]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in lengths:
        h = torch.randn(3, t, 64, generator=gen) * torch.linspace(0.2, 3, 64)
        mask = torch.ones(3, t)
        mask[1, t - 2:] = 0  # padding
        out.append((h, mask))
    return out


@pytest.mark.parametrize("run", ["module", "traces"])
@pytest.mark.parametrize("lengths", [[10, 7], [5, 6, 7, 9]], ids=["two shapes", "four shapes"])
def test_batches_of_other_shapes_than_the_example(monkeypatch: pytest.MonkeyPatch, lengths: list[int],
                                                  run: str) -> None:
    """Batches of other sequence lengths (and batch size) than the example run through the
    module itself (its layers are ``nn.Linear`` calls: ``frontend/eager.py``) or, with that
    switched off, on the module traced at their shapes: one static trace per shape, or, past
    ``STATIC_SHAPES`` shapes, one with the length dynamic.  Padding rows are left out with
    ``calibration_mask=1``."""
    if run == "traces":
        monkeypatch.setattr(eager, "statistics", lambda *args: None)
    torch.manual_seed(0)
    module = Encoder().eval()
    example = (torch.randn(1, 8, 64), torch.ones(1, 8))
    batches = _encoder_batches(lengths)
    exported = xq.export(module, example, weights="qb4w:32", method="gptq", calibration=batches,
                         calibration_mask=1, progress=False)
    masks = [mask.numpy() > 0 for _, mask in batches]
    layers = {"q": Rows("last"), "k": Rows("last"), "v": Rows("last"), "out": Rows("last")}
    by_hand = _hand_sequential(module, batches, layers,
                               lambda w, cal: xq.quantize_blockwise(w, 32, "gptq", calibration=cal), masks)
    payload = exported.to_bytes()
    # q, k and v read the same input: one Calibration, the same as each would get alone
    for name, qt in by_hand.items():
        assert qt.to_bytes() in payload, name
    # the oracle can tell: with padding rows counted, out differs
    unmasked = _hand_sequential(module, batches, layers,
                                lambda w, cal: xq.quantize_blockwise(w, 32, "gptq", calibration=cal))
    assert unmasked["out"].to_bytes() != by_hand["out"].to_bytes()
    assert unmasked["out"].to_bytes() not in payload


@pytest.mark.parametrize(("norm", "lengths"), [("vector_norm", [5, 6, 7, 9]), ("normalize", [10, 7]),
                                               ("normalize", [5, 6, 7, 9])])
def test_calibration_traces_are_decomposed_as_the_export(monkeypatch: pytest.MonkeyPatch, norm: str,
                                                         lengths: list[int],
                                                         decompositions: list[list[str] | None]) -> None:
    """A module traced again for the batches' shapes applies the decompositions the export's
    own program got, and no others.  ``vector_norm``: the export decomposes nothing, but
    with the batch and length dynamic (one trace for four shapes) the norm looks in need of
    decomposition to lowering's checks (XNNPACK's composition of it cannot resize); the
    trace is only run, so it is not decomposed (on MiniLM that cost 7 s of a 23 s export).
    ``normalize`` (its ``expand_as`` has no lowering): the export decomposes, and so does
    every trace, static or dynamic."""

    class Normalized(Encoder):
        def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            out = super().forward(h, mask)
            if norm == "normalize":
                return torch.nn.functional.normalize(out, dim=-1)
            return out / torch.linalg.vector_norm(out, dim=-1, keepdim=True)

    calls = decompositions
    monkeypatch.setattr(eager, "statistics", lambda *args: None)  # traced, not run through the module
    torch.manual_seed(0)
    module = Normalized().eval()
    example = (torch.randn(1, 8, 64), torch.ones(1, 8))
    xq.export(module, example, weights="qb4w:32", progress=False, check=False)
    own = list(calls)
    calls.clear()
    xq.export(module, example, weights="qb4w:32", method="gptq", calibration=_encoder_batches(lengths),
              calibration_mask=1, progress=False, check=False)
    traces = 2 if lengths == [10, 7] else 1
    assert calls == own * (1 + traces)
    assert bool(own) == (norm == "normalize")  # the oracle can tell: the export decomposed only that one


def test_a_mask_per_batch_equals_the_mask_input() -> None:
    torch.manual_seed(0)
    module = Encoder().eval()
    batches = _encoder_batches([6, 6])
    given = [mask.bool() for _, mask in batches]
    one = xq.export(module, batches[0], weights="qb4w:32", method="gptq", calibration=batches, calibration_mask=1,
                    progress=False)
    two = xq.export(module, batches[0], weights="qb4w:32", method="gptq", calibration=batches,
                    calibration_mask=given, progress=False)
    assert one.to_bytes() == two.to_bytes()


def test_torchao_calibrate_leaves_padding_out() -> None:
    from xnnquant.torchao import calibrate

    torch.manual_seed(0)
    module = Encoder().eval()
    batches = _encoder_batches([6, 5])
    got = calibrate(module, batches, runtime_quantized=False, mask=1)
    kept = xq.Calibration(64)
    for h, mask in batches:
        kept.add(h, mask=mask.numpy() > 0)
    np.testing.assert_array_equal(got["q"].gram, kept.gram)
    assert got["q"].tokens == kept.tokens == 3 * 11 - 4
    every = calibrate(module, batches, runtime_quantized=False)
    assert every["q"].tokens == 33


# ------------------------------------------------------------------ bad input


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


X = torch.randn(2, 5, 16)


def _export(calibration: Any, method: str = "gptq", **kwargs: Any) -> Any:
    return xq.export(Mlp().eval(), (X,), weights="qc8w", method=method, calibration=calibration, progress=False,
                     **kwargs)


def _blowing_up() -> torch.Tensor:
    x = X.clone()
    x[1, 2, 3] = float("inf")
    return x


BAD: list[tuple[str, Callable[[], Any], str]] = [
    ("no batch", lambda: _export([]), "calibration= is empty: expected at least one batch of inputs"),
    ("input count", lambda: _export([(X, X)]),
     "calibration batch 0 has 2 input(s): expected 1, as the example inputs"),
    ("dtype", lambda: _export([(X,), (X.double(),)]),
     "calibration batch 1, input 0 is torch.float64 of shape (2, 5, 16): expected torch.float32 of rank 3, as "
     "example input 0 (2, 5, 16)"),
    ("width", lambda: _export([(X,), (torch.randn(2, 5, 15),)]),
     "calibration batch 1 ((2, 5, 15) torch.float32) does not fit the module: layer 'a' (Linear) fails on it: "
     "RuntimeError: mat1 and mat2 shapes cannot be multiplied (10x15 and 16x16)"),
    ("empty batch", lambda: _export([(torch.randn(2, 0, 16),)]),
     "calibration batch 0, input 0 has no elements (shape (2, 0, 16)): expected every dim >= 1"),
    ("not finite, gptq", lambda: _export([(X,), (_blowing_up(),)]),
     "calibration batch 1: the input of layer 'a' (node linear) is not usable: calibration must be finite: got inf "
     "at index (1, 2, 3) (1 non-finite value(s) in all)"),
    ("not finite, equalization", lambda: _export([(X,), (_blowing_up(),)], method="mse"),
     "calibration batch 1: the input of layer 'a' (node linear) is not finite (NaN or inf in channel 3): expected "
     "finite activations"),
    ("mask shape", lambda: _export([(X,)], calibration_mask=[torch.ones(2, 4, dtype=torch.bool)]),
     "calibration_mask of batch 0 has shape (2, 4), but layer 'a' (node linear) reads rows of shape (2, 5) (its "
     "input x[..., K] has that shape): expected one bool per row of every calibrated layer"),
    ("mask count", lambda: _export([(X,), (X,)], calibration_mask=[torch.ones(2, 5)]),
     "calibration_mask has 1 mask(s): expected one per calibration batch (2)"),
    ("mask values", lambda: _export([(X,)], calibration_mask=[torch.full((2, 5), 0.5)]),
     "calibration_mask of batch 0 is torch.float32 with values other than 0 and 1: expected bool, or 0 (padding) "
     "and 1 (a real row)"),
    ("mask index", lambda: _export([(X,)], calibration_mask=1),
     "calibration_mask=1 names input 1, but the batches have 1 input(s)"),
    ("mask alone", lambda: xq.export(Mlp().eval(), (X,), weights="qc8w", calibration_mask=[torch.ones(2, 5)],
                                     progress=False),
     "calibration_mask= goes with calibration=: got a mask and no calibration batches"),
    ("one mask tensor", lambda: _export([(X,)], calibration_mask=torch.ones(2, 5)),
     "calibration_mask must be a sequence of masks, one per calibration batch, or the index of the input that is "
     "the mask: got Tensor"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_calibration_is_refused_naming_the_batch_and_the_layer(case: tuple[str, Callable[[], Any], str]) -> None:
    _, call, message = case
    with pytest.raises(XnnquantError, match="^" + re.escape(message) + "$"):
        call()


def test_a_mask_cannot_select_convolution_windows_of_another_shape() -> None:
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3)).eval()
    x = torch.randn(2, 3, 6, 6)
    with pytest.raises(XnnquantError, match=re.escape(
            "calibration_mask of batch 0 has shape (2, 6, 6), but layer '0' (node conv2d) reads rows of shape "
            "(2, 4, 4) (its output pixels' windows have that shape): expected one bool per row of every calibrated "
            "layer")):
        xq.export(module, (x,), weights="qc8w", method="gptq", calibration=[(x,)],
                  calibration_mask=[torch.ones(2, 6, 6, dtype=torch.bool)], progress=False)


def test_torchao_calibrate_refuses_a_mask_of_the_wrong_shape() -> None:
    from xnnquant.torchao import calibrate

    with pytest.raises(XnnquantError, match=re.escape(
            "mask of batch 0 has shape (2, 4), but layer 'a' reads rows of shape (2, 5) (its input's shape but the "
            "last dim): expected one bool per row")):
        calibrate(Mlp().eval(), [X], mask=[torch.ones(2, 4, dtype=torch.bool)])
    with pytest.raises(XnnquantError, match=re.escape(
            "calibration batch 0: the input of layer 'a' is not usable: calibration must be finite: got inf at index "
            "(1, 2, 3) (1 non-finite value(s) in all)")):
        calibrate(Mlp().eval(), [_blowing_up()])


# ------------------------------------------------------------------ the evaluation


def test_the_evaluation_drops_each_value_after_its_last_reader() -> None:
    from xnnquant.frontend.evaluation import evaluate
    from xnnquant.frontend.program import AtenProgram

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(30):
                x = torch.tanh(x) + x
            return x

    x = torch.randn(4, 8)
    program = AtenProgram.of(torch.export.export(Chain(), (x,), strict=False))
    held: list[int] = []
    outputs = evaluate(program, [(x,), (x * 2,)], after=lambda node, run: held.append(len(run._values)))
    assert max(held) <= 3  # the input, a tanh and the sum being made: never the whole chain
    with torch.no_grad():
        np.testing.assert_array_equal(outputs[1][0].numpy(), Chain()(x * 2).numpy())


def test_a_calibration_holds_no_gram_or_dequantized_filter_past_its_layers() -> None:
    """An export's calibration drops each layer's Gram and dequantized filter once read (an LLM
    held 1.3 GB of them to the end): the same codes and scales as when they are kept."""
    from xnnquant.frontend.calibration import Calibrating
    from xnnquant.frontend.evaluation import evaluate
    from xnnquant.frontend.options import ExportOptions
    from xnnquant.frontend.program import AtenProgram

    torch.manual_seed(0)
    module = Encoder().eval()
    batches = _encoder_batches([10, 10, 10])
    options = ExportOptions.parse(weights="qb4w:32", method="gptq", calibration=batches)
    program = AtenProgram.of(torch.export.export(module, batches[0], strict=False))
    runs = {}
    for keep in (False, True):
        state = Calibrating(program, options.calibration, options.policy, "gptq", keep_grams=keep)
        evaluate(program, options.calibration.batches, before=state.before, outputs=False)
        runs[keep] = state
    dropped, kept = runs[False], runs[True]
    assert sorted(dropped.stats.quantized) == sorted(kept.stats.quantized) == ["k", "out", "q", "v"]
    for path, qt in kept.stats.quantized.items():
        assert np.array_equal(dropped.stats.quantized[path].codes, qt.codes)
        assert np.array_equal(dropped.stats.quantized[path].scale, qt.scale)
    assert kept.stats.grams["q"] is kept.stats.grams["v"]  # one Calibration for the three readers of h
    assert dropped.stats.grams == {} and dropped.shared == {}
    assert len(dropped.swapped) == 4 and all(value is None for value in dropped.swapped.values())
