"""Calibration batches: the inputs an export runs its program on, checked once, and the
program they run on.

``CalibrationData.parse(batches, mask)`` takes ``calibration=`` and ``calibration_mask=`` of
``xq.export`` as given and either returns the batches (each a tuple of torch tensors, the
module's positional inputs) with one bool mask per batch (or none), or raises
``XnnquantError`` naming the batch that is wrong.  A mask marks the rows that count
(True: a real token; False: padding): it is

* a sequence of masks, one per batch, each bool or numeric with values 0 and 1 only; or
* an int ``i``: input ``i`` of every batch is the mask (a model that takes its padding
  mask as an input, as a BERT encoder does, needs nothing else).

``check_fits(example)`` checks the batches against the example inputs (count, dtype,
rank).  ``programs_for(module, lowered, decompositions)`` gives the ``AtenProgram`` to
evaluate each batch on: the lowering's own program for a batch of the shapes it was traced
at (or that its dynamic dims allow), else ``module`` traced again, statically at each other
shape of the batches when they are few (``STATIC_SHAPES``), or once with every dim that
differs between batches dynamic; each decomposed with the tables the export's program was
decomposed with (size arithmetic aside, which torch computes as it is) and rewritten by the
same passes (``passes.BEFORE_CALIBRATION``), so that all have the same layers, constants and
names, node for node (``isomorphic``).  A static trace is ``fx_traced``'s (``make_fx``, about
half torch.export's cost) when it matches a torch.export trace at another shape node for
node, every argument but sizes equal; else torch.export's.  Not decomposed by what its own
nodes would need: a program is only run here (torch runs every ATen op), and a dim made
dynamic for the batches can make an op look in need of decomposition for lowering (a norm
over a dynamic batch dim took 7 s to decompose on MiniLM, for nothing).

This module knows nothing of what the batches are used for: weight statistics
(``calibration.py``) or anything else that runs a program on inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..arrays import check_plain_tensor, contiguous
from ..errors import XnnquantError
from .program import AtenProgram

#: Batches of at most this many shapes are traced once per shape; more, once with dynamic dims
#: (a dynamic trace costs about as much as two or three static ones: see docs/benchmarks.md).
STATIC_SHAPES = 2


@dataclass(frozen=True)
class CalibrationData:
    """Checked batches (tuples of torch tensors) and their bool masks (None: every row counts)."""

    batches: tuple[tuple[Any, ...], ...]
    masks: tuple[Any, ...] | None = None

    @classmethod
    def parse(cls, batches: Any, mask: Any = None) -> CalibrationData:
        """``calibration=`` and ``calibration_mask=`` as given (module docstring)."""
        parsed = calibration_batches(batches)
        return cls(parsed, None if mask is None else parse_masks(mask, parsed))

    def __len__(self) -> int:
        return len(self.batches)

    def check_fits(self, example: tuple[Any, ...]) -> None:
        """Each batch has the example inputs' count, dtypes and ranks."""
        check_batches_fit(self.batches, example)

    def fits(self, program: AtenProgram, batch: int | None = None) -> bool:
        """True when batch ``batch`` (default: every batch) has the shapes ``program``'s inputs
        were traced at (a dynamic dim takes any size)."""
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for inputs in self.batches if batch is None else (self.batches[batch],):
            for name, x in zip(program.inputs, inputs):
                val = placeholders[name].meta.get("val")
                shape = tuple(getattr(val, "shape", ()))
                if getattr(val, "dtype", x.dtype) != x.dtype or len(shape) != x.dim():
                    return False
                if any(isinstance(d, int) and d != n for d, n in zip(shape, x.shape)):
                    return False
        return True

    def programs_for(self, module: Any, lowered: AtenProgram, decompositions: Sequence[dict[Any, Any]] = (),
                     exported: Any = None) -> tuple[AtenProgram, ...]:
        """The program to run each batch on (module docstring), all with the same nodes in
        the same order (``isomorphic``): the lowering's own for the batches that fit it; for
        the others, when they come in at most ``STATIC_SHAPES`` shapes, one program traced
        at each shape (by ``fx_traced`` when ``exported``, the ``ExportedProgram``
        ``lowered`` was made of, is given and nothing was decomposed, else by
        torch.export), else one program traced with the dims that differ dynamic; each
        traced program decomposed with ``decompositions`` in turn (the tables ``lowered``
        was decomposed with)."""
        shapes = [tuple(tuple(x.shape) for x in batch) for batch in self.batches]
        by_shape: dict[Any, AtenProgram] = {}
        for b, shape in enumerate(shapes):
            if shape not in by_shape and self.fits(lowered, b):
                by_shape[shape] = lowered
        missing = sorted({shape for shape in shapes if shape not in by_shape}, key=shapes.index)
        if len(missing) <= STATIC_SHAPES:
            # a quick trace is checked against a program torch.export traced statically: the
            # lowering's own (unless dynamic: it has size nodes), else the last shape's
            reference = None if lowered.ranges or exported is None or decompositions else lowered
            for shape in missing:
                index = shapes.index(shape)
                quick = None if reference is None else fx_traced(module, self.batches[index], exported, reference)
                by_shape[shape] = quick or self._traced(module, index, decompositions, dynamic=False)
                if quick is None and exported is not None and not decompositions:
                    reference = by_shape[shape]
            programs = tuple(by_shape[shape] for shape in shapes)
            if all(isomorphic(programs[0], p) for p in programs[1:]):
                return programs
        dynamic = self._traced(module, 0, decompositions, dynamic=True)
        return (dynamic,) * len(self.batches)

    def _traced(self, module: Any, index: int, decompositions: Sequence[dict[Any, Any]],
                dynamic: bool) -> AtenProgram:
        """``module`` traced on batch ``index``'s inputs (with the dims that differ between
        batches dynamic), decomposed with ``decompositions`` and rewritten by the passes
        before calibration."""
        import torch

        from .passes import BEFORE_CALIBRATION, run_passes

        first = self.batches[index]
        varying = [{d for d in range(x.dim()) if any(b[i].shape[d] != x.shape[d] for b in self.batches)}
                   for i, x in enumerate(first)] if dynamic else [set() for _ in first]
        spec = by_signature(module, [dict.fromkeys(sorted(dims), torch.export.Dim.AUTO) or None for dims in varying])
        try:
            with without_stack_traces():
                exported = torch.export.export(module, first, dynamic_shapes=spec if any(varying) else None,
                                               strict=False)
        except Exception as exc:  # torch's tracing errors come in many types; say where they came from
            raise _misfit(module, index, first, exc) from None
        for table in decompositions:
            exported = exported.run_decompositions(table)
        program = AtenProgram.of(exported)
        run_passes(program, None, BEFORE_CALIBRATION)
        if dynamic:
            for b in range(len(self.batches)):
                if not self.fits(program, b):
                    self._refuse(program, b, index)
        return program

    def _refuse(self, program: AtenProgram, b: int, index: int) -> None:
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        for i, (name, x) in enumerate(zip(program.inputs, self.batches[b])):
            for d, size in enumerate(tuple(placeholders[name].meta["val"].shape)):
                if isinstance(size, int) and size != x.shape[d]:
                    raise XnnquantError(
                        f"calibration batch {b}, input {i} has shape {tuple(x.shape)}: the module traced on "
                        f"calibration batch {index} ({_shapes(self.batches[index])}) fixes dim {d} at {size} (its "
                        f"code specializes it); expected batches whose dim {d} is {size}, or a first batch with a "
                        "size other than 0 or 1 there")


def by_signature(module: Any, specs: list[Any]) -> Any:
    """torch.export's ``dynamic_shapes`` for positional inputs with these ``specs``, keyed by
    the names ``module.forward`` binds them to: a ``*args`` parameter takes one tuple of specs
    (a plain tuple of specs, one per input, does not fit ``forward(self, *inputs)``; for other
    signatures the two say the same)."""
    import inspect

    try:
        signature = inspect.signature(module.forward)
        bound = signature.bind(*range(len(specs)))
    except (TypeError, ValueError):  # no signature to read: one spec per input, in order
        return tuple(specs)
    return {name: tuple(specs[i] for i in where)
            if signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL else specs[where]
            for name, where in bound.arguments.items()}


def fx_traced(module: Any, inputs: tuple[Any, ...], exported: Any, reference: AtenProgram) -> AtenProgram | None:
    """``module`` traced on ``inputs`` at about half torch.export's cost, or None.

    torch.export's program (``exported``, traced from ``module`` at any shape) is ATen as
    ``make_fx`` records it before dispatch, over fake tensors, with the module's parameters
    and buffers lifted to placeholders.  Here ``make_fx`` records ``module`` called
    functionally on those tensors and ``inputs``, without the checks torch.export adds
    (guards, constraint solving, the graph signature), and the placeholders are given the
    names of ``exported``'s, in its order.  The program is used only when, after the
    passes before calibration, it has the nodes of ``reference`` (a program torch.export
    traced statically, at another shape) in the same order (``isomorphic``) and every
    argument other than an int (a size, which the shapes change) equal to
    ``reference``'s, node for node (``fixed_args_equal``); else None, and torch.export
    traces the batch.  Its nodes then take ``reference``'s module stacks (make_fx records
    none).  A module with inputs other than parameters, buffers and user inputs (a lifted
    tensor constant) gives None at once."""
    import torch
    from torch.export.graph_signature import InputKind
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils import _pytree

    from .passes import BEFORE_CALIBRATION, run_passes

    specs = exported.graph_signature.input_specs
    lifted = [s.target for s in specs if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)]
    if len(lifted) + len(inputs) != len(specs) or any(s.kind == InputKind.USER_INPUT for s in specs[:len(lifted)]):
        return None
    tensors = {**dict(module.named_parameters(remove_duplicate=False)),
               **dict(module.named_buffers(remove_duplicate=False))}
    if any(name not in tensors for name in lifted):
        return None

    def call(*flat: Any) -> tuple[Any, ...]:
        out = torch.func.functional_call(module, dict(zip(lifted, flat[:len(lifted)])), tuple(flat[len(lifted):]))
        return tuple(_pytree.tree_leaves(out))

    try:  # torch.export traces it again on failure, and logs and says why if it fails too
        with without_stack_traces(), _backends_off(), _quiet("torch._subclasses.fake_tensor"):
            traced = make_fx(call, tracing_mode="fake", pre_dispatch=True)(*(tensors[n] for n in lifted), *inputs)
        graph = traced.graph
    except Exception:
        return None
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    names = [n.name for n in exported.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(names):
        return None
    for node in placeholders:
        node._rename(f"_{node.name}")  # out of the way of the names given below
    for node, name in zip(placeholders, names):
        node._rename(name)
        node.target = name  # a placeholder's target is its argument's name
    try:  # the quick program is only a shortcut: whatever fails here, torch.export traces the batch
        program = AtenProgram.of(_Exported(graph, traced, exported.graph_signature, exported.state_dict,
                                           getattr(exported, "constants", {})))
        run_passes(program, None, BEFORE_CALIBRATION)
    except Exception:
        return None
    if not (isomorphic(reference, program) and fixed_args_equal(reference, program)):
        return None
    for mine, theirs in zip(program.graph.nodes, reference.graph.nodes):
        # make_fx records no module stack: a filter without a name of its own (a folded a + b)
        # is named by the module its layer ran in (AtenProgram.layer_path), as in ``reference``
        if "nn_module_stack" in theirs.meta:
            mine.meta["nn_module_stack"] = theirs.meta["nn_module_stack"]
    return program


@dataclass(frozen=True)
class _Exported:
    """What ``AtenProgram.of`` reads of a ``torch.export.ExportedProgram``."""

    graph: Any
    graph_module: Any  # the owner of the graph's submodules (a grad-mode block's body)
    graph_signature: Any
    state_dict: Any
    constants: Any


def fixed_args_equal(a: AtenProgram, b: AtenProgram) -> bool:
    """True when the nodes of ``a`` and ``b`` (``isomorphic``) have equal arguments, node
    for node, defaults written out, except ints (sizes, which two traces at two shapes
    differ in): the same structure, the same floats, bools, dtypes, devices, strings and
    None."""
    from torch.fx import Node
    from torch.utils import _pytree

    for x, y in zip(a.graph.nodes, b.graph.nodes):
        if x.op == "placeholder":
            continue
        left, left_spec = _pytree.tree_flatten(_arguments(x))
        right, right_spec = _pytree.tree_flatten(_arguments(y))
        if left_spec != right_spec:
            return False
        for u, v in zip(left, right):
            if isinstance(u, Node) or (type(u) is int and type(v) is int):
                continue
            if type(u) is not type(v) or u != v:
                return False
    return True


def _arguments(node: Any) -> Any:
    """``node``'s arguments, for an ATen op every one of its schema's in order, a default
    written out (one tracer writes ``layer_norm``'s ``cudnn_enable=False``, another leaves
    it out)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or node.op != "call_function":
        return node.args, node.kwargs
    missing = object()
    full = []
    for i, argument in enumerate(schema.arguments):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name, missing)
        if value is missing:
            value = argument.default_value if argument.has_default_value() else None
        full.append(value)
    return full


def isomorphic(a: AtenProgram, b: AtenProgram) -> bool:
    """True when ``a`` and ``b`` have the same nodes in the same order: each pair with the
    same op and target, reading the nodes at the same positions, constants of the same
    names (two traces of one module at two input shapes differ only in size arguments)."""
    if a is b:
        return True
    nodes_a, nodes_b = list(a.graph.nodes), list(b.graph.nodes)
    if len(nodes_a) != len(nodes_b):
        return False
    index_a = {n: i for i, n in enumerate(nodes_a)}
    index_b = {n: i for i, n in enumerate(nodes_b)}
    for x, y in zip(nodes_a, nodes_b):
        if x.op != y.op or x.target != y.target or a.is_constant(x) != b.is_constant(y):
            return False
        if x.op == "placeholder" and x.name != y.name:
            return False
        if [index_a[n] for n in x.all_input_nodes] != [index_b[n] for n in y.all_input_nodes]:
            return False
    return True


@contextmanager
def without_stack_traces() -> Iterator[None]:
    """torch.fx records no Python stack trace per node inside the block (no node's is ever
    read or shown here: a third of a trace's time saved)."""
    import torch.fx.config

    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


@contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """``logger`` logs nothing inside the block."""
    import logging

    log = logging.getLogger(logger)
    before = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = before


@contextmanager
def _backends_off() -> Iterator[None]:
    """cuDNN, oneDNN and NNPACK off inside the block, as torch.export traces (an op that
    takes the flag records it: ``layer_norm(..., cudnn_enable=False)``)."""
    import torch

    backends = (torch.backends.cudnn, torch.backends.mkldnn, torch.backends.nnpack)
    before = [backend.set_flags(False) for backend in backends]
    try:
        yield
    finally:
        for backend, flags in zip(backends, before):
            backend.set_flags(*flags)


def _misfit(module: Any, index: int, batch: tuple[Any, ...], exc: Exception) -> XnnquantError:
    """The error for a batch the module could not be traced on, naming the innermost module
    that fails when the batch runs through it eagerly (when one does)."""
    import torch

    from .caller import buffers_kept, copies

    names = {m: name for name, m in module.named_modules()}
    running: list[Any] = []  # the modules entered and not yet left, innermost last

    def enter(m: Any, _: Any) -> None:
        running.append(m)

    def leave(m: Any, _: Any, __: Any) -> None:  # returns None: a value would replace the output
        running.pop()

    hooks = [m.register_forward_pre_hook(enter) for m in names] + [m.register_forward_hook(leave) for m in names]
    failure: Exception = exc
    try:
        with torch.no_grad(), buffers_kept(module):
            module(*copies(batch))
        running.clear()  # the module runs it: tracing itself failed
    except Exception as eager:  # the module's own error on a batch that does not fit it
        failure = eager
    finally:
        for hook in hooks:
            hook.remove()
    text = f"{type(failure).__name__}: {str(failure).splitlines()[0] if str(failure) else ''}"
    if running:
        layer = running[-1]
        return XnnquantError(
            f"calibration batch {index} ({_shapes(batch)}) does not fit the module: layer "
            f"{names[layer] or '<top level>'!r} ({type(layer).__name__}) fails on it: {text}")
    return XnnquantError(f"calibration batch {index} ({_shapes(batch)}) has other shapes than the example inputs, "
                         f"and tracing {type(module).__name__} on it failed: {text}")


def _shapes(batch: tuple[Any, ...]) -> str:
    return ", ".join(f"{tuple(x.shape)} {x.dtype}" for x in batch)


def calibration_batches(batches: Any) -> tuple[tuple[Any, ...], ...]:
    """``calibration=`` as a tuple of input tuples (torch tensors; numpy arrays are converted),
    at least one; ``XnnquantError`` naming the first batch that is not."""
    import numpy as np
    import torch

    if isinstance(batches, (str, bytes, torch.Tensor, np.ndarray)) or not hasattr(batches, "__iter__"):
        raise XnnquantError(f"calibration must be an iterable of input tuples (one tuple of the module's positional "
                            f"inputs per batch): got {type(batches).__name__}")
    out = []
    for i, batch in enumerate(batches):
        inputs = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        converted = []
        for j, x in enumerate(inputs):
            if isinstance(x, np.ndarray):
                x = torch.from_numpy(contiguous(x))
            if not isinstance(x, torch.Tensor):
                raise XnnquantError(f"calibration batch {i}, input {j}: expected a torch tensor or a numpy array, "
                                    f"got {type(x).__name__}")
            check_plain_tensor(x, f"calibration batch {i}, input {j}")
            if x.numel() == 0:
                raise XnnquantError(f"calibration batch {i}, input {j} has no elements (shape {tuple(x.shape)}): "
                                    "expected every dim >= 1")
            converted.append(x)
        out.append(tuple(converted))
    if not out:
        raise XnnquantError("calibration= is empty: expected at least one batch of inputs")
    return tuple(out)


def check_batches_fit(batches: tuple[tuple[Any, ...], ...], example: tuple[Any, ...]) -> None:
    """Each calibration batch has the example inputs' count, dtypes and ranks."""
    for i, batch in enumerate(batches):
        if len(batch) != len(example):
            raise XnnquantError(f"calibration batch {i} has {len(batch)} input(s): expected {len(example)}, as the "
                                "example inputs")
        for j, (x, e) in enumerate(zip(batch, example)):
            if x.dtype != e.dtype or x.dim() != e.dim():
                raise XnnquantError(f"calibration batch {i}, input {j} is {x.dtype} of shape {tuple(x.shape)}: "
                                    f"expected {e.dtype} of rank {e.dim()}, as example input {j} "
                                    f"{tuple(e.shape)}")


def parse_masks(mask: Any, batches: Sequence[tuple[Any, ...]]) -> tuple[Any, ...]:
    """``calibration_mask=`` as one bool tensor per batch (module docstring)."""
    import numpy as np
    import torch

    single = isinstance(mask, (bool, str, bytes, torch.Tensor, np.ndarray))
    if single or not (isinstance(mask, int) or hasattr(mask, "__iter__")):
        raise XnnquantError(f"calibration_mask must be a sequence of masks, one per calibration batch, or the index "
                            f"of the input that is the mask: got {type(mask).__name__}")
    if isinstance(mask, int) and not isinstance(mask, bool):
        width = min(len(b) for b in batches)
        if not 0 <= mask < width:
            raise XnnquantError(f"calibration_mask={mask} names input {mask}, but the batches have {width} input(s)")
        given: list[Any] = [b[mask] for b in batches]
    else:
        given = list(mask)
    if len(given) != len(batches):
        raise XnnquantError(f"calibration_mask has {len(given)} mask(s): expected one per calibration batch "
                            f"({len(batches)})")
    out = []
    for i, m in enumerate(given):
        if isinstance(m, np.ndarray):
            m = torch.from_numpy(contiguous(m))
        if not isinstance(m, torch.Tensor):
            raise XnnquantError(f"calibration_mask of batch {i}: expected a tensor or numpy array, got "
                                f"{type(m).__name__}")
        check_plain_tensor(m, f"calibration_mask of batch {i}")
        if m.dtype != torch.bool:
            if m.dtype.is_complex or not bool(((m == 0) | (m == 1)).all()):
                raise XnnquantError(f"calibration_mask of batch {i} is {m.dtype} with values other than 0 and 1: "
                                    "expected bool, or 0 (padding) and 1 (a real row)")
            m = m != 0
        out.append(m)
    return tuple(out)
