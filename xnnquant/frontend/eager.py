"""Sequential calibration on the module itself, when it can stand in for the program.

``calibration.statistics`` runs the program the lowering reads node by node, which at a
batch shape other than the example's needs the module traced again at that shape
(``batches.CalibrationData.programs_for``: 0.2-0.3 s a shape on MiniLM, two shapes for its
128 calibration sentences).  When every layer the calibration quantizes is an
``nn.Linear`` module whose weight the program reads once, unchanged, the module's own
forward computes those layers on the same inputs, and ``statistics`` here runs the batches
through it instead, one thread per batch.  A hook before each of those linears holds its
thread there until every batch has arrived::

    batch threads                          the calling thread
    module(*batch 0) ... query(x0) waits ─┐
    module(*batch 1) ... query(x1) waits ─┴> every batch at 'query': its inputs x0, x1
                                             calibrate query and the layers reading the
                                             same input (key, value), quantized together
                                             (calibration.Calibrating); their weights
    ... key(x0), value(x0) pass ...     <─── become the dequantized values; released
    ... output(...) waits ...                ...
    forward done                             weights restored, statistics returned

Each layer is thus calibrated on what the quantized layers before it produce, and each
batch runs through the module once, as the program's run computes each node once.  The
statistics are the program's run's (same keys, same quantization; the inputs are the
module's eager values, which torch computes with the kernels the program's ATen ops call).

The batches' forwards run side by side and take turns at those layers, so a module that
keeps Python state from one layer to a later one within a forward (an attribute, not a
tensor the program reads) would see another batch's there; its layers would then be
calibrated on other inputs than its program computes, never lowered otherwise.  Buffers are
not such state: ``AtenProgram.of`` refuses a module that updates them.  The six
architectures of ``tests/hf_models.py`` that take this path (BERT, RoBERTa, DistilBERT,
Llama, Qwen2, T5) give the traced path's bytes.

The batch threads do not inherit the caller's thread-local state: under autocast or a
torch function or dispatch mode, the program's run calibrates instead.

The module must meet the layers in the program's order, each once, in every batch (the
program is a trace of this forward at the example's shapes: a branch on a shape can take
another way at a batch's shapes).  When a batch does not, or its forward raises, or a mask
does not have a layer's rows' shape, or a layer's inputs are not usable (not finite, not
its width), the weights are restored and ``statistics`` returns None: the program's run then
calibrates, and names what is wrong, if anything, as it always does.  The module's
parameters are its own again whatever happens (the objects themselves: the
``module._parameters`` entries are swapped, never written into).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..compute.parallel import num_threads
from ..errors import XnnquantError
from .batches import CalibrationData
from .calibration import Calibrating, LayerStatistics, LayerUse, layer_use
from .caller import buffers_kept, copies
from .evaluation import torch_threads
from .program import AtenProgram
from .weights import WeightPolicy, WeightScheme

#: Most batches run this way (a thread each); more go through the program's run.
MAX_BATCHES = 64


@dataclass(frozen=True)
class _Step:
    """A calibrated linear: its use in the program, its scheme and its module."""

    use: LayerUse
    scheme: WeightScheme
    module: Any


class _Refused(BaseException):
    """The module does not stand in for the program on these batches (module docstring).
    Not an ``Exception``: a module's own ``except Exception`` around a layer must not
    swallow it."""


def statistics(module: Any, program: AtenProgram, data: CalibrationData, policy: WeightPolicy | None,
               method: str, keep_grams: bool = False) -> LayerStatistics | None:
    """``calibration.statistics``' result for ``program`` (after the passes before
    calibration) with ``data``'s batches run through ``module`` (module docstring), or None
    when the module cannot stand in for the program."""
    state = Calibrating(program, data, policy, method, keep_grams)
    plain = state.aware and 1 <= len(data) <= MAX_BATCHES and not _caller_modes()
    steps = _plan(module, program, state) if plain else None
    if not steps:
        return None
    meeting = _Meeting(module, steps, data, state)
    try:
        with buffers_kept(module):
            meeting.run()
    except _Refused:
        return None
    return state.stats


def _caller_modes() -> bool:
    """True when the calling thread computes under a state its batch threads would not
    inherit (it is thread-local): autocast, a torch function or dispatch mode."""
    import torch

    return bool(torch.is_autocast_enabled("cpu") or torch._C._len_torch_function_stack()
                or torch._C._len_torch_dispatch_stack())


def _plan(module: Any, program: AtenProgram, state: Calibrating) -> list[_Step] | None:
    """The calibrated layers in the program's order, each an ``nn.Linear`` of ``module``
    whose weight the program reads once, as it is; None when one is not."""
    import torch
    from torch.nn.modules import module as torch_module

    if getattr(torch_module, "_global_forward_pre_hooks", None) or getattr(torch_module, "_global_forward_hooks", None):
        return None  # a global hook may change what a linear reads
    steps: list[_Step] = []
    for node in program.graph.nodes:
        use = layer_use(program, node)
        scheme = None if use is None else state.scheme(use)
        if use is None or scheme is None:
            continue
        origin = program.origins.get(use.weight.name, "")
        owner = _submodule(module, origin[: -len(".weight")]) if origin.endswith(".weight") else None
        weight = program.constants.get(use.weight.name)
        if not isinstance(owner, torch.nn.Linear) or type(owner) is not torch.nn.Linear:
            return None  # a subclass may compute otherwise
        if (node.target is not torch.ops.aten.linear.default or len(use.weight.users) != 1
                or "forward" in vars(owner) or owner._forward_pre_hooks or owner._forward_hooks
                or owner.weight is not weight or weight.dtype != torch.float32 or weight.device.type != "cpu"
                or any(step.module is owner for step in steps)):
            return None
        steps.append(_Step(use, scheme, owner))
    return steps


def _submodule(module: Any, path: str) -> Any:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


class _Inputs:
    """What ``Calibrating`` reads of a run: the layer's input in every batch."""

    def __init__(self, node: Any, values: list[Any]) -> None:
        self._node, self._values = node, values

    def values(self, node: Any) -> list[Any]:
        assert node is self._node
        return self._values

    def shapes(self, node: Any) -> list[tuple[int, ...]] | None:
        return None


class _Meeting:
    """One run of the batches through the module, the threads meeting at each step."""

    def __init__(self, module: Any, steps: list[_Step], data: CalibrationData, state: Calibrating) -> None:
        self.module, self.steps, self.data, self.state = module, steps, data, state
        self.changed = threading.Condition()
        n = len(data)
        self.reached: list[int] = [0] * n  # per batch: the steps it has passed or stands at
        self.waiting: list[Any] = [None] * n  # per batch: its input at the step it waits at
        self.done = [False] * n
        self.refused: str | None = None
        self.released = -1  # steps up to this one are quantized
        self.stop = False
        self.expected: dict[tuple[int, int], Any] = {}  # (batch, step) -> the input a quantized reader must get
        self.index = {id(step.module): i for i, step in enumerate(steps)}
        self.batch = threading.local()

    def run(self) -> None:
        import torch

        hooks = [step.module.register_forward_pre_hook(self._hook, with_kwargs=True) for step in self.steps]
        originals = [step.module._parameters["weight"] for step in self.steps]
        threads = [threading.Thread(target=self._forward, args=(b,), daemon=True,
                                    name=f"xnnquant-calibration-{b}") for b in range(len(self.data))]
        parallel = len(threads) > 1 and num_threads() > 1
        try:
            with torch_threads(1 if parallel else torch.get_num_threads()):
                for thread in threads:
                    thread.start()
                for i, step in enumerate(self.steps):
                    if step.use.weight in self.state.swapped:
                        continue  # quantized with the layer before it that reads the same input
                    inputs = self._arrivals(i)
                    self._quantize(i, step, inputs)
                self._finished()
        finally:
            with self.changed:
                self.stop = True
                self.changed.notify_all()
            for thread in threads:
                if thread.is_alive() and thread is not threading.current_thread():
                    thread.join()
            for hook in hooks:
                hook.remove()
            for step, weight in zip(self.steps, originals):
                step.module._parameters["weight"] = weight

    def _forward(self, b: int) -> None:
        import torch

        self.batch.index = b
        try:
            with torch.no_grad():
                self.module(*copies(self.data.batches[b]))
        except _Refused:
            pass
        except BaseException as exc:  # the module's own error: the program's run says it
            self._refuse(f"batch {b}: {type(exc).__name__}: {exc}")
        with self.changed:
            self.done[b] = True
            self.changed.notify_all()

    def _refuse(self, why: str) -> None:
        with self.changed:
            if self.refused is None:
                self.refused = why
            self.changed.notify_all()

    def _hook(self, layer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        b = getattr(self.batch, "index", None)
        if b is None:  # another thread calls the module meanwhile: not ours to hold
            return None
        i = self.reached[b]
        x = args[0] if args else kwargs.get("input")
        with self.changed:
            if self.stop or self.refused is not None:
                raise _Refused
            if i >= len(self.steps) or self.steps[i].module is not layer:
                self.refused = f"batch {b} reached {type(layer).__name__} out of the program's order"
                self.changed.notify_all()
                raise _Refused
            self.reached[b] = i + 1
            if (b, i) in self.expected:  # quantized with an earlier reader of its input
                if self.expected.pop((b, i)) is not x:
                    self.refused = f"batch {b}: a layer read another input than the program's"
                    self.changed.notify_all()
                    raise _Refused
                return None
            self.waiting[b] = x
            self.changed.notify_all()
            while self.released < i and not self.stop and self.refused is None:
                self.changed.wait()
            if self.released < i:
                raise _Refused
        return None

    def _arrivals(self, i: int) -> list[Any]:
        """Every batch's input at step ``i``, once all are there."""
        with self.changed:
            while True:
                if self.refused is not None:
                    raise _Refused
                if any(d and r <= i for d, r in zip(self.done, self.reached)):
                    raise _Refused  # a batch finished without this layer
                if all(r == i + 1 and w is not None for r, w in zip(self.reached, self.waiting)):
                    inputs, self.waiting = self.waiting, [None] * len(self.waiting)
                    return inputs
                self.changed.wait()

    def _quantize(self, i: int, step: _Step, inputs: list[Any]) -> None:
        import torch

        use = step.use
        masks = self.data.masks
        if masks is not None and any(tuple(m.shape) != tuple(x.shape[:-1]) for m, x in zip(masks, inputs)):
            raise _Refused  # the program's run reads a view's mask, or names the misfit
        before = set(self.state.swapped)
        try:
            self.state.quantize_readers(use, step.scheme, _Inputs(use.input, inputs))
        except XnnquantError:  # inputs that do not fit the layer or are not finite: the program's run names them
            raise _Refused from None
        for j, other in enumerate(self.steps):
            if other.use.weight in self.state.swapped and other.use.weight not in before:
                other.module._parameters["weight"] = torch.nn.Parameter(self.state.swapped[other.use.weight],
                                                                        requires_grad=False)
                if j != i:
                    self.expected.update({(b, j): x for b, x in enumerate(inputs)})
        with self.changed:
            self.released = i
            self.changed.notify_all()

    def _finished(self) -> None:
        """Every batch through the whole forward, every step met."""
        with self.changed:
            while not all(self.done):
                self.changed.wait()
            if self.refused is not None or any(r != len(self.steps) for r in self.reached) or self.expected:
                raise _Refused
