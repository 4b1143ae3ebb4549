"""Rotation of the residual stream (``rotation="hadamard"``), folded into the weights.

A decoder's residual stream ``h`` (token embeddings, plus each block's output) is read only
through RMS norms and written only by linear layers.  For an orthogonal ``Q`` (a randomized
Hadamard matrix, ``schemes.rotation``) the program computes the same function on
``h' = h Q``, since ``rms(h Q) = rms(h)``::

    source    token table E                  E' = E Q
    reader    y = (norm(h) * g) W^T + b      W' = (W diag(g)) Q, the norm's scale g folded in
              (q, k, v, gate, up, LM head)   (the multiply by g removed: the norm reads h')
    writer    h + (x W^T + b)                W' = Q^T W, b' = b Q      (o_proj, down_proj)
              with block=B: x' = x R_B,      W' = Q^T W R_B, R_B = blockdiag(H_B / sqrt(B))
              computed in the program        (x read as [..., K / B, B] times H_B / sqrt(B), fp32)

Every rotated weight spreads its outliers over all of ``h``'s channels (``Q``) or over each
block of B input channels (``R_B``, on the writers' inputs: the MLP's product and the
attention's output), where int4 groups and per-token int8 activations keep more levels;
``B`` is the group the writer's weights are quantized in (one Hadamard per quantization
group: the largest multiple of 32 up to the scheme's group dividing K), else the largest
power of two that divides K, at most 128.

What the stream may meet, each checked: an add of a writer's output (or of another
source, a position table); an RMS norm ``h * rsqrt(mean(h ** 2, -1) + eps)`` whose output
(times its scale) is read only by linear layers, through row selections or not (the last
token's slice before the LM head); a multiply by a constant scalar (Gemma's embedding
scale); row selections (slice, select, view keeping the last dim).  Anything else (a layer
norm, which subtracts the mean; the stream as an output; a non-linear use) refuses the
rotation, naming the node and why.  The new weights are new constants (named as the ones
they replace: a tied LM head and token table become two), the module's are left as they
are.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedConfigError
from ...schemes.rotation import hadamard, rotation
from ..program import AtenProgram
from . import rewrite

aten = torch.ops.aten

#: ``node.meta`` key of an online rotation's product: its constant stays fp32 (``weights.py``)
ROTATE = "xnnquant_rotation"
#: Ops that select rows of the stream (any dim but the last).
ROWS = (aten.slice.Tensor, aten.select.int, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
        aten.squeeze.dim, aten.clone.default, aten.contiguous.default)
#: The largest block of an online rotation.
MAX_BLOCK = 128
SEED = 0


@dataclass
class Stream:
    """What the residual stream is made of (module docstring)."""

    width: int
    values: set[Any] = field(default_factory=set)
    sources: list[Any] = field(default_factory=list)  # embedding lookups
    norms: list[tuple[Any, Any, Any]] = field(default_factory=list)  # (core, scale mul or None, scale or None)
    readers: list[tuple[Any, Any]] = field(default_factory=list)  # (linear, its norm's scale or None)
    writers: list[Any] = field(default_factory=list)  # linears added into the stream


def _refuse(node: Any, why: str) -> UnsupportedConfigError:
    where = AtenProgram.module_path(node) or "<top level>"
    return UnsupportedConfigError(f"rotation='hadamard' cannot be folded into this program: {node.target} (node "
                                  f"{node.name}, module {where}) {why}; expected a residual stream read through "
                                  "RMS norms by linear layers and written by linear layers (a decoder)")


def _last(node: Any) -> int:
    return int(node.meta["val"].shape[-1])


def _is_rows(program: AtenProgram, node: Any, width: int) -> bool:
    """A row selection keeping the last dim (module docstring)."""
    if node.target not in ROWS or node.args[0].meta.get("val") is None:
        return False
    val = node.meta.get("val")
    if val is None or not val.shape or int(val.shape[-1]) != width:
        return False
    if node.target in (aten.slice.Tensor, aten.select.int):
        dim = node.args[1] if len(node.args) > 1 else 0
        return dim % len(node.args[0].meta["val"].shape) != len(node.args[0].meta["val"].shape) - 1
    if node.target in (aten.view.default, aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim):
        before = node.args[0].meta["val"].shape
        appended = node.target is aten.unsqueeze.default and node.args[1] in (-1, len(before))  # a new last dim
        return int(before[-1]) == width and not appended
    return True


def _norm_core(program: AtenProgram, square: Any, x: Any) -> Any:
    """The node ``x * rsqrt(mean(x ** 2, -1, keepdim) + eps)`` that ``square`` (``x ** 2`` or
    ``x * x``) begins, ``eps`` a number (or a one-element constant), or None."""
    means = [u for u in square.users if u.target is aten.mean.dim]
    if len(square.users) != 1 or not means:
        return None
    mean = means[0]
    dims = mean.args[1] if len(mean.args) > 1 else None
    if list(dims or []) not in ([-1], [len(x.meta["val"].shape) - 1]) or len(mean.users) != 1:
        return None
    add = next(iter(mean.users))
    if add.target not in (aten.add.Tensor, aten.add.Scalar) or len(add.users) != 1 or len(add.args) != 2:
        return None
    eps = add.args[1 - add.args.index(mean)] if mean in add.args else None
    if not (isinstance(eps, (int, float)) or (isinstance(eps, torch.fx.Node) and program.is_constant(eps)
                                              and program.constants[eps.name].numel() == 1)):
        return None  # an RMS norm adds one eps to every row's mean; anything else would not commute with Q
    rsqrt = next(iter(add.users))
    if rsqrt.target is not aten.rsqrt.default:
        return None
    cores = [u for u in rsqrt.users if u.target is aten.mul.Tensor and x in u.args]
    return cores[0] if len(cores) == 1 and len(rsqrt.users) == 1 else None


def _constant_vector(program: AtenProgram, node: Any, width: int) -> Any:
    if program.is_constant(node):
        tensor = program.constants[node.name]
        if tensor.dim() == 1 and tensor.shape[0] == width:
            return tensor
    return None


def find_stream(program: AtenProgram) -> Stream:
    """The residual stream of ``program``, or ``UnsupportedConfigError`` naming what breaks it."""
    sources = [n for n in program.graph.nodes if n.op == "call_function" and n.target is aten.embedding.default
               and program.is_constant(n.args[0]) and program.constants[n.args[0].name].dim() == 2]
    if not sources:
        raise UnsupportedConfigError("rotation='hadamard' folds a rotation of a decoder's residual stream into its "
                                     "weights, starting at its token embedding: this program looks up no constant "
                                     "embedding table")
    stream = Stream(_last(sources[0]))
    todo = list(sources)
    stream.sources = list(sources)
    consumed: set[Any] = set()  # the norms' own nodes
    while todo:
        s = todo.pop()
        if s in stream.values:
            continue
        stream.values.add(s)
        if _last(s) != stream.width:
            raise _refuse(s, f"has {_last(s)} channels where the stream has {stream.width}")
        for u in list(s.users):
            if u in consumed or u in stream.values:
                continue
            if u.op == "output":
                raise _refuse(s, "is an output of the program: a rotation would change it")
            if u.target in (aten.pow.Tensor_Scalar, aten.mul.Tensor) and (
                    (u.target is aten.pow.Tensor_Scalar and u.args[1] == 2) or u.args == (s, s)):
                core = _norm_core(program, u, s)
                if core is None:
                    raise _refuse(u, "squares the stream outside an RMS norm")
                consumed.update([u, *u.users])
                node = next(iter(u.users))
                while node is not core:  # mean -> add -> rsqrt -> core
                    consumed.add(node)
                    node = next(iter(node.users))
                consumed.add(core)
                _norm_readers(program, stream, core)
                continue
            factor = u.args[1 - u.args.index(s)] if u.target is aten.mul.Tensor and len(u.args) == 2 and \
                s in u.args else None
            if factor is not None and (not isinstance(factor, torch.fx.Node) or (
                    program.is_constant(factor) and program.constants[factor.name].numel() == 1)):
                todo.append(u)  # a scalar multiple (Gemma's embedding scale)
                continue
            if u.target is aten.add.Tensor and len(u.args) == 2 and s in u.args:
                other = u.args[1 - u.args.index(s)]
                if other in stream.values or other in stream.sources or other is s:
                    todo.append(u)
                    continue
                writer = _writer(program, other, stream.width)
                if writer is None:
                    raise _refuse(u, f"adds {getattr(other, 'name', other)} to the stream, which is not a linear "
                                     "layer's output read only there")
                stream.writers.append(writer)
                todo.append(u)
                continue
            if _is_rows(program, u, stream.width):
                todo.append(u)
                continue
            if u.target in (aten.layer_norm.default, aten.native_layer_norm.default):
                raise _refuse(u, "is a layer norm reading the stream: it subtracts the mean, which a rotation changes")
            raise _refuse(u, "reads the stream, and a rotation does not commute with it")
    return stream


def _writer(program: AtenProgram, node: Any, width: int) -> Any:
    """The linear whose output ``node`` is (through row selections), read only on its way to
    the stream, or None."""
    while node is not None and getattr(node, "op", None) == "call_function":
        if len(node.users) != 1:
            return None
        if node.target is aten.linear.default and program.is_constant(node.args[1]):
            return node if int(program.constants[node.args[1].name].shape[0]) == width else None
        if not _is_rows(program, node, width):
            return None
        node = node.args[0]
    return None


def _norm_readers(program: AtenProgram, stream: Stream, core: Any) -> None:
    """Record a norm (``core``, its scale) and the linears reading it."""
    scale_mul, scale, normed = None, None, core
    if len(core.users) == 1:
        user = next(iter(core.users))
        if user.target is aten.mul.Tensor and core in user.args:
            other = user.args[1 - user.args.index(core)]
            scale = _constant_vector(program, other, stream.width) if isinstance(other, torch.fx.Node) else None
            if scale is not None:
                scale_mul, normed = user, user
    stream.norms.append((core, scale_mul, scale))
    todo = [normed]
    while todo:
        value = todo.pop()
        for u in value.users:
            if u.target is aten.linear.default and u.args[0] is value and program.is_constant(u.args[1]):
                stream.readers.append((u, scale))
            elif _is_rows(program, u, stream.width):
                todo.append(u)
            else:
                raise _refuse(u, "reads an RMS norm of the stream and is not a linear layer")


def _replace_weight(program: AtenProgram, node: Any, index: int, values: np.ndarray, suffix: str) -> None:
    """``node``'s argument ``index`` (a constant) becomes a new constant holding ``values``."""
    old = node.args[index]
    tensor = torch.from_numpy(np.ascontiguousarray(values, np.float32))
    new = program.add_constant(tensor, f"{old.name}_{suffix}", origin=program.origins.get(old.name))
    node.replace_input_with(old, new)


def _block(k: int, group: int | None) -> int:
    """The block of a writer's online rotation: the group its weights are quantized in (the
    largest multiple of 32 up to ``group`` dividing ``k``, as ``weights.ladder`` chooses it)
    when a Hadamard matrix of that width exists, else the largest power of two up to
    ``MAX_BLOCK`` dividing ``k``."""
    if group:
        fits = [g for g in range(group, 0, -32) if k % g == 0]
        if fits and hadamard(fits[0]) is not None:
            return fits[0]
    b = 1
    while k % (2 * b) == 0 and 2 * b <= MAX_BLOCK:
        b *= 2
    return b


def _online(program: AtenProgram, linear: Any, block: int, matrices: dict[int, Any]) -> None:
    """Rotate the input of ``linear`` in blocks of ``block`` channels in the program: x ->
    (x as [..., K / B, B]) @ (H_B / sqrt(B)) -> [..., K] (module docstring); ``matrices``:
    block -> its constant, one for the program."""
    x = linear.args[0]
    shape = list(x.meta["val"].shape)
    k = int(shape[-1])
    if block not in matrices:
        h = torch.from_numpy((hadamard(block) / np.sqrt(block)).astype(np.float32))
        matrices[block] = program.add_constant(h, f"hadamard_{block}")
    matrix = matrices[block]
    graph = program.graph
    with graph.inserting_before(linear):
        sizes = []
        for d, size in enumerate(shape[:-1]):
            if isinstance(size, int):
                sizes.append(size)
            else:
                node = graph.call_function(aten.sym_size.int, (x, d))
                node.meta["val"] = size
                sizes.append(node)
        blocks = graph.call_function(aten.view.default, (x, [*sizes, k // block, block]))
        rotated = graph.call_function(aten.matmul.default, (blocks, matrix))
        back = graph.call_function(aten.view.default, (rotated, [*sizes, k]))
    val = x.meta["val"]
    blocks.meta = {**x.meta, "val": val.view(*shape[:-1], k // block, block)}
    rotated.meta = {**x.meta, "val": val.view(*shape[:-1], k // block, block), ROTATE: block}
    back.meta = {**x.meta, "val": val}
    linear.replace_input_with(x, back)


@rewrite("rotation")
def rotate(program: AtenProgram, options: Any) -> None:
    kind = getattr(options, "rotation", None)
    if kind is None:
        return
    stream = find_stream(program)
    q = rotation(stream.width, SEED)
    group = getattr(options, "rotation_group", None)
    for source in stream.sources:
        table = program.array(source.args[0].name, "a token table")
        _replace_weight(program, source, 0, table @ q, "rotated")
    for reader, scale in stream.readers:
        w = program.array(reader.args[1].name, "a linear weight")
        if scale is not None:
            w = w * scale.detach().numpy()[None, :]
        _replace_weight(program, reader, 1, w @ q, "rotated")
    for _core, scale_mul, _scale in stream.norms:
        if scale_mul is not None:
            core = _core
            scale_mul.replace_all_uses_with(core)
            program.graph.erase_node(scale_mul)
    matrices: dict[int, Any] = {}
    for writer in stream.writers:
        w = q.T @ program.array(writer.args[1].name, "a linear weight")
        k = w.shape[1]
        block = _block(k, group)
        if block > 1:
            hb = hadamard(block) / np.sqrt(block)
            w = (w.reshape(w.shape[0], k // block, block) @ hb).reshape(w.shape[0], k)
            _online(program, writer, block, matrices)
        _replace_weight(program, writer, 1, w, "rotated")
        if len(writer.args) > 2 and writer.args[2] is not None:
            _replace_weight(program, writer, 2, program.array(writer.args[2].name, "a bias") @ q, "rotated")
    program.graph.eliminate_dead_code()
