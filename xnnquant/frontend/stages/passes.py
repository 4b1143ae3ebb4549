"""Stage ``passes``: the traced program as an ``AtenProgram``, rewritten by ``frontend/passes/``.

Takes the decomposed ``ExportedProgram`` (``decompose.py``), the module (None for a saved
program), a streaming export's weight file and the options; ``before_calibration`` gives the
``AtenProgram`` (its own copy of the graph) after the passes that the calibration batches run
through (``calibrate.py``), ``after_calibration`` runs the others on it, which read the
statistics (``passes.AFTER_CALIBRATION``, the partition last), and gives their ``PassOptions``
(the nodes sent to the portable kernels, the passes' refusals).  What a program with state
(buffers the module updates) cannot be is refused here (``check_state``).
"""

from __future__ import annotations

from typing import Any

from ...errors import UnsupportedConfigError, XnnquantError
from ..options import ExportOptions
from ..passes import AFTER_CALIBRATION, BEFORE_CALIBRATION, PassOptions, run_passes
from ..program import AtenProgram


def before_calibration(traced: Any, weight_file: Any, prefix: str, eager: Any, options: ExportOptions) -> AtenProgram:
    """The ``AtenProgram`` of ``traced`` after ``passes.BEFORE_CALIBRATION``, its tied weights found
    in ``eager`` and its dynamic dims named (``prefix``: ``export``'s ``_weight_prefix``)."""
    program = AtenProgram.of(traced, weight_file, prefix)
    check_state(program, options)
    if eager is not None:
        program.find_tied(eager, prefix)
    program.name_dims(options.dynamic_shapes, eager)
    run_passes(program, PassOptions(None, options.strict, rotation=options.rotation,
                                    rotation_group=options.policy.weights.group_size), BEFORE_CALIBRATION)
    return program


def after_calibration(program: AtenProgram, statistics: Any, options: ExportOptions) -> PassOptions:
    """Run ``passes.AFTER_CALIBRATION`` on ``program`` with the calibration ``statistics`` (or None)."""
    pass_options = PassOptions(statistics, options.strict, options.embeddings, options.method)
    run_passes(program, pass_options, AFTER_CALIBRATION)
    return pass_options


def check_state(program: AtenProgram, options: ExportOptions) -> None:
    """What a program with state (buffers the module updates) cannot be: one XNNPACK graph
    (``strict=True``: the updates run outside XNNPACK), or static int8.  The initial values
    of a state on the meta device come from the weight file of a streaming export, else are
    zeros (a cache, which no checkpoint holds); without a weight file it is refused."""
    if not program.state:
        return
    names = ", ".join(repr(program.origins[name]) for name in program.mutated)
    if options.strict:
        raise UnsupportedConfigError(
            f"strict=True asks for one pure XNNPACK graph, and the module updates its buffers ({names}): that "
            "state lives in the program around the XNNPACK delegates, which are stateless; export without "
            "strict=True")
    if options.static_int8 is not None:
        raise UnsupportedConfigError(f"activations='qint8' rewrites one XNNPACK graph into int8, and the module "
                                     f"updates its buffers ({names}), state that runs outside XNNPACK; expected "
                                     "activations='dynamic'")
    import torch

    for name, tensor in program.state.items():
        if tensor.device.type != "meta":
            continue
        stored = program.stored_tensor(name)  # a streaming export's weight file may hold it
        if stored is not None:
            program.state[name] = stored
        elif program.weight_file is not None:  # as ExecuTorch starts a buffer its program updates: no values
            program.state[name] = torch.zeros(tensor.shape, dtype=tensor.dtype)
        else:
            raise XnnquantError(f"the buffer {program.origins[name]!r}, which the module updates, is on the meta "
                                "device: its values when exported are the program's initial state; give it data "
                                "(build it outside torch.device('meta')), or export with state_dict=")
