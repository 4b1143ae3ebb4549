"""Calibration: the inputs of every weighted layer, as statistics, for what uses them.

``statistics(program, data, policy, method)`` runs the program the lowering reads (after
the passes before calibration, ``passes.BEFORE_CALIBRATION``) on the calibration batches,
node by node and all batches at once (``evaluation.evaluate``), and keeps, per layer path
(the names ``Exported.report`` shows, ``AtenProgram.layer_path``; ``LayerStatistics.key``):

* ``absmax``: the largest |input| of each input channel, float32 ``(in_features,)``, of
  every linear, for the equalization of layer-norm-fed linears (``equalization_scales``),
  with ``minmax`` / ``mse``;
* ``grams`` and ``quantized``: with an activation-aware method, a ``Calibration``
  (``xnnquant.schemes``, ``X^T X`` in float64) of the layer's inputs and the layer's
  ``QuantizedTensor``, quantized on them (sequential calibration, below).

Layers are found in the graph (``layer_use``), whatever module computes them::

    ATen node                                weight stored as       input rows (columns in the
                                                                    order of the stored row)
    linear(x, w [N, K])                      w [N, K]               x [..., K]
    addmm(b, x, w [K, N]), mm, matmul        w^T [N, K]             x [..., K]
    convolution 1x1, stride 1, no padding,   w [OC, C]              x NCHW as pixels [N, H, W, C]
      one group (a fully connected layer)
    convolution, one group                   OHWI [OC, KH, KW, C]   im2col [N, OH, OW, KH * KW * C]:
                                             (flattened per row)    each output pixel's window,
                                                                    (kh, kw, c) with c fastest
    1-D convolution, input [N, C, L]         as 2-D of height 1     the 2-D rows of [N, C, 1, L]
                                             (OHWI [OC, 1, K, C])   without the unit dim: [N, L', ...]

A grouped, depthwise or transposed convolution gets no statistics (each group of output
channels reads other inputs: one Gram per group would be needed); its quantized layers
are then refused with an activation-aware method.  Masks (``batches.CalibrationData``)
select rows: a layer's rows are indexed by the leading dims above (``x.shape[:-1]``,
``[N, H, W]``, ``[N, OH, OW]``) and the batch's mask must have that shape (or, for a linear
reading its rows flattened by a view, GPT-2's ``x.view(-1, K)``, the shape before the view).

Sequential calibration.  A deployed layer reads what the quantized layers before it
produce, so each layer is calibrated on those inputs, as ``models.sequential`` does for
the numpy MiniLM.  When the walk reaches a layer whose scheme is quantized, its input is
there for every batch: its ``Calibration`` is accumulated (one per input and row kind,
shared by the layers reading the same input: query, key and value), the layer quantized
(``WeightScheme.quantize``, in the layout the lowering stores; together with the other
layers reading that input with the same scheme, their rows stacked), and the layer, like
every later reader of that weight, computed with the dequantized weight.  Each node is computed
once per batch.  The lowering then stores ``quantized`` as it is.

Non-finite inputs of a layer, and a mask of the wrong shape, raise ``XnnquantError``
naming the batch and the layer.

Equalization.  A layer norm's output often has a few channels far larger than the rest,
and per-token int8 quantization of such a row gives the small channels few levels.  For a
linear reading it, ``x W^T = (x / s) (W s)^T`` for any positive per-channel ``s``: the
input is divided by ``s`` (one XNNMultiply by a constant before the XNNConvert) and the
weight's columns multiplied by it before quantization.  With
``s_j = absmax_j^a / max_i |W_ij|^(1 - a)``, ``a = 0.5`` (SmoothQuant's rule, Xiao et al.
2023), activations and weights share the range (its effect on MiniLM: docs/accuracy.md,
"Equalization").  Linears sharing one input (query, key, value) share ``s``,
taken over all their weights, so they keep sharing one conversion.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple, Protocol

import numpy as np

from ..errors import XnnquantError
from ..schemes.calibration import Calibration
from ..schemes.checks import ACTIVATION_AWARE_METHODS
from ..tensor import QuantizedTensor
from .batches import CalibrationData
from .evaluation import evaluate
from .program import AtenProgram
from .weights import Layer, LayerKind, WeightPolicy, WeightScheme

#: SmoothQuant's migration strength for the equalization (see the module docstring).
EQUALIZATION_ALPHA = 0.5
#: Values of im2col rows made at a time (64 MiB of float32).
IM2COL_PIECE = 1 << 24


@dataclass
class LayerStatistics:
    """Per layer: input channel maxima, ``Calibration``s and the weights quantized by
    sequential calibration (module docstring), keyed by ``key(filter placeholder, path)``:
    the layer path, or, where one path names several filters (slices of one parameter
    read by several linears, as a cross-attention's ``in_proj_weight``), the path with
    the placeholder's name (``renamed``)."""

    absmax: dict[str, np.ndarray] = field(default_factory=dict)
    grams: dict[str, Calibration] = field(default_factory=dict)
    batches: int = 0
    quantized: dict[str, Any] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)

    def key(self, weight: str, path: str) -> str:
        """The key of the layer whose filter is placeholder ``weight``, at ``path``."""
        return self.renamed.get(weight, path)


#: The name before convolutions were calibrated too.
LinearStatistics = LayerStatistics


class Rows(NamedTuple):
    """How a layer's input becomes rows (module docstring): ``kind`` is "last" (the last
    dim), "pixels" (NCHW read as NHWC) or "im2col" (with the convolution's geometry)."""

    kind: str
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    #: a 1-D convolution's input ``[N, C, L]``, read as ``[N, C, 1, L]`` (its rows lead ``[N, L']``)
    one_d: bool = False


@dataclass(frozen=True)
class LayerUse:
    """A node that reads a constant filter: its activation input, the filter's placeholder,
    what the weight policy sees, how its input becomes rows of ``in_features`` values, how
    the torch filter is stored (``stored``) and back (``unstored``), and why it cannot be
    calibrated (``refusal``, None when it can)."""

    node: Any
    input: Any
    weight: Any
    layer: Layer
    rows: Rows
    in_features: int
    stored: Callable[[np.ndarray], np.ndarray]
    unstored: Callable[[np.ndarray], np.ndarray]
    refusal: str | None = None


def _pair(v: Any) -> tuple[int, int]:
    if isinstance(v, (list, tuple)):
        t = tuple(int(d) for d in v) or (1,)
        return (t[0], t[0]) if len(t) == 1 else (t[0], t[1])
    return int(v), int(v)


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _transposed(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.T)


def layer_use(program: AtenProgram, node: Any) -> LayerUse | None:
    """The ``LayerUse`` of ``node``, or None when it reads no constant filter (module doc)."""
    import torch

    aten = torch.ops.aten
    if node.op != "call_function":
        return None
    args = list(node.args)
    dense = None
    if node.target is aten.linear.default and len(args) >= 2:
        dense = (args[0], args[1], False)
    elif node.target is aten.addmm.default and len(args) >= 3:
        scalars = [node.kwargs.get("beta", args[3] if len(args) > 3 else 1),
                   node.kwargs.get("alpha", args[4] if len(args) > 4 else 1)]
        dense = (args[1], args[2], True) if scalars == [1, 1] else None
    elif node.target in (aten.mm.default, aten.matmul.default) and len(args) >= 2:
        dense = (args[0], args[1], True)
    if dense is not None:
        x, w, transposed = dense
        if not _activation(program, x) or not program.is_constant(w) or program.constants[w.name].dim() != 2:
            return None
        shape = tuple(program.constants[w.name].shape)
        k = int(shape[0] if transposed else shape[1])
        layout = _transposed if transposed else _same
        return LayerUse(node, x, w, Layer(LayerKind.LINEAR, k, program.layer_path(w.name, node)), Rows("last"), k,
                        layout, layout)
    if node.target in (aten.convolution.default, aten.conv2d.default, aten.conv1d.default):
        return _convolution(program, node, args)
    return None


def _activation(program: AtenProgram, x: Any) -> bool:
    return hasattr(x, "op") and not program.is_constant(x)


def _convolution(program: AtenProgram, node: Any, args: list[Any]) -> LayerUse | None:
    import torch

    def arg(i: int, name: str, default: Any) -> Any:
        return args[i] if len(args) > i else node.kwargs.get(name, default)

    x, w = args[0], args[1]
    if node.target in (torch.ops.aten.conv2d.default, torch.ops.aten.conv1d.default):
        stride, padding, dilation, transposed, groups = (arg(3, "stride", 1), arg(4, "padding", 0),
                                                         arg(5, "dilation", 1), False, arg(6, "groups", 1))
    else:
        stride, padding, dilation, transposed, groups = args[3], args[4], args[5], bool(args[6]), args[8]
    if not _activation(program, x) or not program.is_constant(w) or isinstance(padding, str):
        return None
    filt = program.constants[w.name]
    val = x.meta.get("val")
    rank = getattr(val, "dim", lambda: 0)()
    if filt.dim() != rank or rank not in (3, 4):
        return None
    if rank == 3:  # 1-D: a 2-D convolution of height 1, as the lowering stores it (lowering/conv.py)
        return _one_d(_convolution_2d(node, x, w, tuple(int(d) for d in filt.shape[:2]) + (1, int(filt.shape[2])),
                                      int(val.shape[1]), (1, _one(stride)), (0, _one(padding)), (1, _one(dilation)),
                                      transposed, int(groups)))
    return _convolution_2d(node, x, w, tuple(int(d) for d in filt.shape), int(val.shape[1]), _pair(stride),
                           _pair(padding), _pair(dilation), transposed, int(groups))


def _one(v: Any) -> int:
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


def _one_d(use: LayerUse) -> LayerUse:
    """A 2-D ``LayerUse`` of height 1 as the 1-D convolution's: rows of ``[N, C, L]`` inputs
    (``Rows.one_d``), filters ``[OC, C/g, K]``."""
    stored, unstored = use.stored, use.unstored

    def stored_1d(a: np.ndarray) -> np.ndarray:
        return stored(a.reshape(a.shape[0], a.shape[1], 1, a.shape[2]))

    def unstored_1d(a: np.ndarray) -> np.ndarray:
        b = unstored(a)
        return b.reshape(b.shape[0], b.shape[1], b.shape[3])

    return replace(use, rows=use.rows._replace(one_d=True), stored=stored_1d, unstored=unstored_1d)


def _convolution_2d(node: Any, x: Any, w: Any, shape: tuple[int, ...], channels: int, stride: tuple[int, int],
                    padding: tuple[int, int], dilation: tuple[int, int], transposed: bool,
                    groups: int) -> LayerUse:
    oc, per_group, kh, kw = shape
    geometry = Rows("im2col", (kh, kw), stride, padding, dilation)
    if transposed:
        return LayerUse(node, x, w, Layer(LayerKind.TRANSPOSED), geometry, 0, _same, _same,
                        "a transposed convolution is not calibrated")
    if (kh, kw) == (1, 1) and geometry.stride == (1, 1) and geometry.padding == (0, 0) and groups == 1:
        return LayerUse(node, x, w, Layer(LayerKind.LINEAR, per_group), Rows("pixels"), per_group,
                        lambda a: a.reshape(oc, per_group), lambda a: a.reshape(oc, per_group, 1, 1))
    if groups == channels and channels > 1 and per_group == 1:
        return LayerUse(node, x, w, Layer(LayerKind.DEPTHWISE), geometry, 0, _same, _same,
                        "a depthwise convolution is not calibrated")
    if groups != 1:
        return LayerUse(node, x, w, Layer(LayerKind.CONV), geometry, 0, _same, _same,
                        f"a grouped convolution (groups={groups}) is not calibrated: each group of output channels "
                        "reads other input channels")
    return LayerUse(node, x, w, Layer(LayerKind.CONV), geometry, kh * kw * per_group,
                    lambda a: np.ascontiguousarray(a.transpose(0, 2, 3, 1)),
                    lambda a: np.ascontiguousarray(a.transpose(0, 3, 1, 2)))


def layer_rows(x: Any, rows: Rows) -> Any:
    """A layer input ``x`` (torch) as rows ``(*lead, in_features)`` (module docstring)."""
    import torch

    if rows.kind == "last":
        return x
    if rows.one_d:  # computed as the 2-D convolution of height 1, the unit dim dropped from the lead
        two_d = layer_rows(x.unsqueeze(2), rows._replace(one_d=False))
        return two_d.reshape(two_d.shape[0], two_d.shape[2], two_d.shape[3])
    if rows.kind == "pixels":
        return x.permute(0, 2, 3, 1)
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = rows.kernel, rows.stride, rows.padding, rows.dilation
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    cols = torch.nn.functional.unfold(x, (kh, kw), dilation=(dh, dw), padding=(ph, pw), stride=(sh, sw))
    # unfold's columns are (c, kh, kw) with kw fastest; the stored filter's are (kh, kw, c)
    return cols.view(n, c, kh * kw, oh, ow).permute(0, 3, 4, 2, 1).reshape(n, oh, ow, kh * kw * c)


def _lead_shape(x: Any, rows: Rows) -> tuple[int, ...]:
    """The leading dims of ``layer_rows(x, rows)`` (what a mask must match)."""
    if rows.kind == "last":
        return tuple(int(d) for d in x.shape[:-1])
    if rows.one_d:  # the 2-D lead (N, 1, L') without its unit dim
        lead = _lead_shape(x.unsqueeze(2), rows._replace(one_d=False))
        return lead[0], lead[2]
    n, _, h, w = (int(d) for d in x.shape)
    if rows.kind == "pixels":
        return n, h, w
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = rows.kernel, rows.stride, rows.padding, rows.dilation
    return n, (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1, (w + 2 * pw - dw * (kw - 1) - 1) // sw + 1


class LayerInputs(Protocol):
    """What the calibration reads of a run of the batches: a node's value in every batch, and
    its shapes (None when not known; a ``BatchRun`` knows them after the node's values are freed)."""

    def values(self, node: Any) -> list[Any]: ...

    def shapes(self, node: Any) -> list[tuple[int, ...]] | None: ...


class Calibrating:
    """The state of one sequential calibration (module docstring): run by ``statistics`` over
    the program's run, or by ``eager.statistics`` over the module's."""

    def __init__(self, program: AtenProgram, data: CalibrationData, policy: WeightPolicy | None,
                 method: str, keep_grams: bool = False) -> None:
        self.program, self.data, self.policy, self.method = program, data, policy, method
        self.keep_grams = keep_grams
        self.aware = method in ACTIVATION_AWARE_METHODS and policy is not None
        self.stats = LayerStatistics(batches=len(data))
        self.shared: dict[tuple[Any, Rows], Calibration] = {}  # (input node, rows) -> its Calibration
        self.swapped: dict[Any, Any] = {}  # filter placeholder -> the dequantized filter later nodes read
        self.unread: dict[Any, int] = {}  # filter placeholder -> its layer nodes not computed yet (program runs)
        owners: dict[str, set[str]] = {}  # layer path -> the filter placeholders it names
        for node in program.graph.nodes:
            use = layer_use(program, node)
            if use is not None:
                owners.setdefault(program.layer_path(use.weight.name, node), set()).add(use.weight.name)
        for path, names in owners.items():
            if len(names) > 1:
                self.stats.renamed.update({name: f"{path} [{name}]" for name in names})

    def before(self, node: Any, run: LayerInputs) -> dict[Any, Any] | None:
        use = layer_use(self.program, node)
        if use is None:
            return None
        path = self.stats.key(use.weight.name, self.program.layer_path(use.weight.name, node))
        if use.weight not in self.swapped:
            if not self.aware:
                if use.rows.kind == "last":
                    self._absmax(use, path, run)
                return None
            scheme = self.scheme(use)
            if scheme is None:
                return None  # the lowering stores it as it is, refuses it, or says why it has no statistics
            self.quantize_readers(use, scheme, run)
        return {use.weight: self._read(use.weight)}

    def _read(self, weight: Any) -> Any:
        """The dequantized filter for one layer node of the program's run; dropped after its
        last such node (an LLM's would otherwise all be held until the run ends)."""
        if weight not in self.unread:
            self.unread[weight] = sum(1 for user in weight.users if (u := layer_use(self.program, user)) is not None
                                      and u.weight is weight)
        self.unread[weight] -= 1
        value = self.swapped[weight]
        if self.unread[weight] <= 0:
            self.swapped[weight] = None  # the key stays: the filter is quantized
        return value

    def scheme(self, use: LayerUse) -> WeightScheme | None:
        """The quantized scheme ``use``'s filter takes, or None (fp32, refused, not calibrated)."""
        assert self.policy is not None
        choice = self.policy.choose(use.layer)
        if isinstance(choice, str) or not choice.scheme.is_quantized or use.refusal is not None:
            return None
        return choice.scheme

    def quantize_readers(self, use: LayerUse, scheme: WeightScheme, run: LayerInputs) -> None:
        """Quantize ``use`` with every other layer that reads the same input the same way and
        takes the same scheme (query, key and value), not yet quantized: their filters' rows
        stacked into one matrix, quantized at once (one factorization of the shared Gram, one
        pass over more rows) and cut back.  Each row is quantized on its own, so each filter
        gets the codes and scales it would get alone."""
        import torch

        readers = [use]
        for user in use.input.users:
            other = layer_use(self.program, user)
            if other is not None and other.rows == use.rows and other.weight not in self.swapped \
                    and all(other.weight is not r.weight for r in readers) and self.scheme(other) == scheme:
                readers.append(other)
        paths = [self.stats.key(r.weight.name, self.program.layer_path(r.weight.name, r.node)) for r in readers]
        calibration = self._gram(use, paths[0], run)
        filters = [r.stored(self.program.array(r.weight.name, f"the weight of {p!r}")) for r, p in zip(readers, paths)]
        rows = [len(f) for f in filters]
        stacked = np.concatenate([f.reshape(len(f), -1) for f in filters])
        qt = scheme.quantize(stacked, self.method, calibration)
        assert isinstance(qt, QuantizedTensor)  # a quantized scheme
        del stacked
        start = 0
        for reader, path, filt, n in zip(readers, paths, filters, rows):
            codes, scale = qt.codes[start:start + n].reshape(filt.shape), qt.scale[start:start + n]
            part = QuantizedTensor(qt.datatype, codes, scale, qt.zero_point, channel_dim=0, group_size=qt.group_size,
                                   meta=dict(qt.meta))
            start += n
            if self.keep_grams:
                self.stats.grams[path] = calibration
            self.stats.quantized[path] = part
            self.swapped[reader.weight] = torch.from_numpy(reader.unstored(part.dequantize()))
        later = (layer_use(self.program, user) for user in use.input.users)
        if not any(u is not None and u.rows == use.rows and u.weight not in self.swapped and self.scheme(u) is not None
                   for u in later):
            self.shared.pop((use.input, use.rows), None)  # no later reader of this input asks for its Calibration

    def _mask(self, b: int, x: Any, use: LayerUse, path: str, run: LayerInputs) -> Any:
        """Batch ``b``'s mask (numpy bool, the rows' leading shape), or None.  A linear whose
        input is its rows flattened (GPT-2's ``x.view(-1, K)`` of ``(batch, tokens, K)``) takes
        the mask flattened alike: the view keeps the rows in their order."""
        import torch

        if self.data.masks is None:
            return None
        mask = self.data.masks[b]
        lead = _lead_shape(x, use.rows)
        source = use.input.args[0] if use.rows.kind == "last" and getattr(use.input, "target", None) in (
            torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default) else None
        shapes = run.shapes(source) if tuple(mask.shape) != lead and hasattr(source, "op") else None
        if shapes is not None and shapes[b][:-1] == tuple(mask.shape) and shapes[b][-1] == x.shape[-1] \
                and math.prod(shapes[b]) == x.numel():
            mask = mask.reshape(lead)
        if tuple(mask.shape) != lead:
            what = {"last": "its input x[..., K] has", "pixels": "its input's pixels have",
                    "im2col": "its output pixels' windows have"}[use.rows.kind]
            raise XnnquantError(
                f"calibration_mask of batch {b} has shape {tuple(mask.shape)}, but layer {path or '<top level>'!r} "
                f"(node {use.node.name}) reads rows of shape {lead} ({what} that shape): expected one bool per row "
                "of every calibrated layer")
        return mask.numpy()

    def _absmax(self, use: LayerUse, path: str, run: LayerInputs) -> None:
        import torch

        top = self.stats.absmax.get(path)
        for b, x in enumerate(run.values(use.input)):
            mask = self._mask(b, x, use, path, run)
            rows = x.detach().reshape(-1, x.shape[-1]) if mask is None else x.detach()[torch.from_numpy(mask)]
            if len(rows) == 0:
                continue
            here = rows.abs().amax(dim=0).float().numpy()
            if not np.isfinite(here).all():
                raise XnnquantError(
                    f"calibration batch {b}: the input of layer {path or '<top level>'!r} (node {use.node.name}) is "
                    f"not finite (NaN or inf in channel {int(np.argmin(np.isfinite(here)))}): expected finite "
                    "activations")
            top = here if top is None else np.maximum(top, here)
        if top is not None:
            self.stats.absmax[path] = top

    def _gram(self, use: LayerUse, path: str, run: LayerInputs) -> Calibration:
        """The ``Calibration`` of ``use``'s input over every batch (shared by its readers)."""
        key = (use.input, use.rows)
        if key in self.shared:
            return self.shared[key]
        calibration = Calibration(use.in_features)
        for b, x in enumerate(run.values(use.input)):
            mask = self._mask(b, x, use, path, run)
            try:
                if use.rows.kind == "im2col":  # a few images at a time: the windows repeat each value
                    per_image = use.in_features * int(np.prod(_lead_shape(x[:1], use.rows)))
                    step = max(1, IM2COL_PIECE // max(1, per_image))
                    for lo in range(0, len(x), step):
                        part = layer_rows(x[lo:lo + step], use.rows)
                        calibration.add(part, mask=None if mask is None else mask[lo:lo + step])
                else:
                    calibration.add(layer_rows(x, use.rows), mask=mask)
            except XnnquantError as exc:
                raise XnnquantError(f"calibration batch {b}: the input of layer {path or '<top level>'!r} (node "
                                    f"{use.node.name}) is not usable: {exc}") from None
        self.shared[key] = calibration
        return calibration


def statistics(programs: tuple[AtenProgram, ...], data: CalibrationData, policy: WeightPolicy | None = None,
               method: str = "mse", keep_grams: bool = False) -> LayerStatistics:
    """Run ``data``'s batches through ``programs`` (one per batch, node for node alike:
    ``batches.CalibrationData.programs_for``) and gather ``LayerStatistics`` (module
    docstring): sequentially calibrated and quantized layers for an activation-aware
    ``method`` (with the export's ``policy``), else the linears' input maxima.  ``keep_grams``:
    keep each quantized layer's ``Calibration`` in ``grams`` (for a test comparing them; an
    export drops each as soon as its layers are quantized: 0.8 GB on a 135M-parameter LLM)."""
    state = Calibrating(programs[0], data, policy, method, keep_grams)
    evaluate(programs[0], data.batches, before=state.before, programs=programs, outputs=False)
    return state.stats


def equalization_scales(absmax: np.ndarray, weights: list[np.ndarray], alpha: float = EQUALIZATION_ALPHA) -> np.ndarray:
    """Per input channel ``s`` (float32 ``(K,)``) for inputs with channel maxima ``absmax``
    read by ``weights`` (each ``[N_i, K]``); see the module docstring."""
    column = np.max([np.abs(w).max(axis=0) for w in weights], axis=0)
    floor = np.float32(1e-5)  # dead channels (all-zero input or weight) keep a usable scale
    s = np.maximum(absmax, floor) ** alpha / np.maximum(column, floor) ** (1 - alpha)
    return np.maximum(s, floor).astype(np.float32)
