"""Bad input to every public entry point: ``XnnquantError`` or success, nothing else.

The properties (hypothesis) call each public entry point with one or two of its arguments
replaced by values of wrong types and values (``JUNK``: None, bools, huge and negative
integers, NaN and infinities, strings, bytes, arrays and tensors of every shape, dtype
and value, containers of those, objects of no use) and assert that the call either
succeeds or raises ``XnnquantError``: a raw ``TypeError``, ``IndexError``,
``struct.error``, ``OSError`` or a crash fails the test.  Calls that reach the runtime
with a payload or program that could crash it run isolated (``isolate=True``).  The CLI
must exit with a status and a message of its own, never a traceback.

Then the cases a probe of the entry points found, each with its message pinned.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import xnnquant as xq
from xnnquant import pte as pte_module
from xnnquant.arguments import MAX_SECONDS
from xnnquant.errors import OutputFileError, PayloadError, ProgramError, XnnquantError
from xnnquant.graph import Graph, interpret, load, run, to_pte

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = pytest.mark.xnnpack

#: Hypothesis settings of the properties: a fixed seed (the same examples on every run and
#: machine, so the test's time is known) and no deadline (the first call of a kind imports
#: or starts the runtime).
#: ``FEW`` for properties whose examples may reach the runtime or torch.export (up to a
#: second each), ``MANY`` for the ones that stay in numpy (milliseconds).
FEW = settings(max_examples=30, deadline=None, derandomize=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MANY = settings(FEW, max_examples=150)

# ------------------------------------------------------------------------- junk

#: Objects no entry point takes, whatever the argument.
ODD = [object(), Ellipsis, 1 + 2j, set(), frozenset({1}), Path(__file__).parent / "missing-folder" / "x.pte", lambda: 1, type,
       np.float32("nan"), np.float64("-inf"), np.int64(-3), np.int8(7), np.bool_(True), slice(2), range(3),
       bytearray(b"PK\x03\x04"), memoryview(b"ET12ET12"), "qb4w:\u00b2", "\x00", "qc8w\n", "1.4.1 "]

_DTYPES = st.sampled_from([np.float32, np.float64, np.float16, np.int8, np.int64, np.uint8, np.bool_, np.complex64])
_SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4) | st.sampled_from([(2, 64), (1, 2, 64)])
ARRAYS = hnp.arrays(_DTYPES, _SHAPES) | hnp.arrays(np.dtype("<U2"), st.just((2,)))
_DENSE = torch.randn(2, 64)
#: Tensors that hold no dense CPU values numpy can read (sparse, meta, quantized), or in a
#: dtype numpy has not (bf16, float8, uint16), a 0-d one and a channels-last view.
ODD_TENSORS = st.sampled_from([
    _DENSE.to_sparse(), _DENSE.to_sparse_csr(), _DENSE.to("meta"), torch.quantize_per_tensor(_DENSE, 0.1, 0, torch.qint8),
    _DENSE.to(torch.bfloat16), _DENSE.to(torch.float8_e4m3fn), torch.zeros(2, 64, dtype=torch.uint16),
    torch.tensor(3.0), torch.randn(1, 2, 2, 64).to(memory_format=torch.channels_last), _DENSE.t(),
    torch.nn.Parameter(_DENSE.clone())])
TENSORS = hnp.arrays(_DTYPES, _SHAPES).map(lambda a: torch.from_numpy(np.ascontiguousarray(a))) | ODD_TENSORS
SCALARS = (st.none() | st.booleans() | st.integers(-3, 70) | st.integers() | st.floats() | st.text(max_size=6)
           | st.binary(max_size=12) | st.sampled_from(ODD))
JUNK = st.one_of(SCALARS, ARRAYS, TENSORS, st.lists(SCALARS, max_size=3), st.tuples(SCALARS), st.tuples(SCALARS, SCALARS),
                 st.lists(TENSORS | ARRAYS, max_size=2), st.lists(st.tuples(TENSORS), max_size=2),
                 st.dictionaries(st.text(max_size=3) | st.integers(), SCALARS | ARRAYS, max_size=2))


def refused_or_done(call: Callable[[], Any]) -> None:
    """Run ``call``: success and ``XnnquantError`` pass, any other exception fails the test."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(XnnquantError):  # stderr: tqdm, libraries
        call()


def with_junk(draw: st.DrawFn, valid: dict[str, Any], *, fixed: tuple[str, ...] = ()) -> dict[str, Any]:
    """``valid`` with one or two arguments (not those in ``fixed``) replaced by junk."""
    names = [n for n in valid if n not in fixed]
    chosen = draw(st.lists(st.sampled_from(names), min_size=1, max_size=2, unique=True))
    return {**valid, **{n: draw(JUNK) for n in chosen}}


@pytest.fixture(scope="module", autouse=True)
def in_a_scratch_directory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Junk that happens to be a writable relative path (``"a.pte"``) lands here."""
    scratch = tmp_path_factory.mktemp("scratch")
    before = os.getcwd()
    os.chdir(scratch)
    yield scratch
    os.chdir(before)


# ---------------------------------------------------------------------- fixtures

W = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
X = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)


def small_module() -> Any:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


@pytest.fixture(scope="module")
def payload() -> bytes:
    g = Graph()
    x = g.input((2, 64))
    g.output(g.fully_connected(g.convert(x, xq.Datatype.qdint8), g.constant(xq.quantize_per_channel(W, bits=8))))
    return g.to_bytes()


@pytest.fixture(scope="module")
def exported() -> xq.Exported:
    return xq.export(small_module(), (torch.from_numpy(X),), weights="qc8w", progress=False)


@pytest.fixture(scope="module")
def pte(exported: xq.Exported) -> bytes:
    return exported.to_pte()


# -------------------------------------------------------------------- properties


@MANY
@given(data=st.data())
def test_schemes(data: st.DataObject) -> None:
    entry, valid = data.draw(st.sampled_from([
        (xq.quantize_per_tensor, dict(x=W, dtype=xq.Datatype.qint8, symmetric=False)),
        (xq.quantize_per_tensor, dict(x=W, scale=0.1, zero_point=0)),
        (xq.quantize_per_channel, dict(w=W, bits=4, axis=0, method="mse")),
        (xq.quantize_per_channel, dict(w=W, bits=8, method="gptq", calibration=X)),
        (xq.quantize_blockwise, dict(w=W, group_size=32, method="minmax", scale=None)),
        (xq.quantize_bias, dict(b=W[0], input_scale=0.1, weight_scale=0.2)),
        (xq.quantize_per_token, dict(x=X, num_nonbatch_dims=1)),
    ]))
    kwargs = with_junk(data.draw, valid)
    refused_or_done(lambda: entry(**kwargs))


#: Graph node builders with valid arguments on ``_nodes_graph``'s values: x NHWC (1, 4, 4, 8)
#: id 0, a (8, 8) float constant id 1, a (4, 3, 3, 8) filter id 2, a (1, 3, 3, 8) depthwise
#: filter id 3.
NODE_CALLS: dict[str, dict[str, Any]] = {
    "input": dict(dims=(2, 3), datatype=xq.Datatype.fp32),
    "tensor": dict(dims=(2, 3), datatype=xq.Datatype.qint8, quant=xq.graph.PerTensorQuant(0.5, 1)),
    "constant": dict(data=W),
    "output": dict(value_id=0),
    "add": dict(a=0, b=0, output_min=-1.0, output_max=1.0, debug_handle=3, flags=0),
    "multiply": dict(a=0, b=1),
    "prelu": dict(x=0, slope=1),
    "batch_matrix_multiply": dict(a=0, b=1, transpose_b=True),
    "fully_connected": dict(x=0, w=1, bias=None, transpose_weights=False),
    "conv2d": dict(x=0, w=2, bias=None, padding=1, stride=(1, 1), dilation=1, groups=1),
    "depthwise_conv2d": dict(x=0, w=3, padding=(1, 1, 1, 1), stride=1),
    "conv_transpose2d": dict(x=0, w=2, stride=2, adjustment=1, groups=1),
    "avg_pooling_2d": dict(x=0, kernel=2, stride=None, padding=0),
    "max_pooling_2d": dict(x=0, kernel=(2, 2), stride=1, dilation=1),
    "argmax_pooling_2d": dict(x=0, kernel=2),
    "global_avg_pooling_2d": dict(x=0),
    "softmax": dict(x=0, debug_handle=1),
    "clamp": dict(x=0, min_value=-1.0, max_value=1.0),
    "leaky_relu": dict(x=0, negative_slope=0.1),
    "elu": dict(x=0, alpha=1.0),
    "gelu": dict(x=0),
    "convert": dict(x=0, datatype=xq.Datatype.qint8, scale=0.1, zero_point=0),
    "static_reshape": dict(x=0, new_shape=(16, -1)),
    "static_transpose": dict(x=0, perm=(0, 2, 1, 3)),
    "static_slice": dict(x=0, offsets=(0, 1, 1, 0), sizes=(1, 2, 2, 8)),
    "static_constant_pad": dict(x=0, pre_paddings=(0, 1, 1, 0), post_paddings=(0, 0, 0, 0), padding_value=0.5),
    "static_resize_bilinear_2d": dict(x=0, new_height=8, new_width=6, align_corners=True),
    "concatenate": dict(inputs=(0, 0, 0), axis=3),
    "scaled_dot_product_attention": dict(query=0, key=0, value=0, scale=1, mask=1),
}


def _nodes_graph() -> Graph:
    g = Graph(target="1.4.1")
    g.input((1, 4, 4, 8))
    g.constant(np.ones((8, 8), np.float32))
    g.constant(np.ones((4, 3, 3, 8), np.float32))
    g.constant(np.ones((1, 3, 3, 8), np.float32))
    return g


@settings(MANY, max_examples=300)
@given(data=st.data())
def test_graph_builder(data: st.DataObject) -> None:
    method = data.draw(st.sampled_from(sorted(NODE_CALLS)))
    kwargs = with_junk(data.draw, NODE_CALLS[method])
    g = _nodes_graph()
    refused_or_done(lambda: getattr(g, method)(**kwargs))
    refused_or_done(g.validate)


@MANY
@given(JUNK, JUNK)
def test_graph_constructor_and_save(write_scale_bf16: Any, path: Any) -> None:
    refused_or_done(lambda: Graph(write_scale_bf16=write_scale_bf16, scales_in_segment=path))
    refused_or_done(lambda: Graph(target=path))
    refused_or_done(lambda: _nodes_graph().save(path))


def _mutated(payload: bytes, draw: st.DrawFn, span: int = 600) -> bytes:
    """``payload`` cut short, or with a few bytes of its first ``span`` changed."""
    if draw(st.booleans()):
        return payload[:draw(st.integers(0, len(payload) - 1))]
    out = bytearray(payload)
    for at, byte in draw(st.lists(st.tuples(st.integers(0, span - 1), st.integers(0, 255)), min_size=1, max_size=4)):
        out[at] = byte
    return bytes(out)


@FEW
@given(data=st.data())
def test_load_interpret_to_pte(data: st.DataObject, payload: bytes) -> None:
    source = _mutated(payload, data.draw) if data.draw(st.booleans()) else payload
    entry, valid = data.draw(st.sampled_from([
        (load, dict(source=source, named_data=None, validate=True)),
        (interpret, dict(graph=source, inputs=[X], named_data=None)),
        (to_pte, dict(payload=source, inputs=None, outputs=[((2, 8), np.float32)], named_data=None, validate=True,
                      dynamic=False)),
    ]))
    kwargs = with_junk(data.draw, valid)
    refused_or_done(lambda: entry(**kwargs))


@FEW
@given(data=st.data())
def test_run(data: st.DataObject, payload: bytes) -> None:
    """In this process for junk arguments of a valid payload (checked before anything reaches
    the runtime); isolated for a mutated payload, which might pass validation and crash it."""
    mutated = data.draw(st.booleans())
    source = _mutated(payload, data.draw) if mutated else payload
    valid = dict(payload=source, inputs=[X], named_data=None, validate=True, isolate=mutated, timeout=60.0)
    kwargs = with_junk(data.draw, valid, fixed=("payload", "isolate", "validate"))
    refused_or_done(lambda: run(**kwargs))


EXPORT_ARGS = dict(weights="qc8w", method="mse", calibration=None, fallback="auto", activations="dynamic",
                   progress=False, target="1.4.1", state_dict=None, check=False)


def _positional(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` taking its arguments' values in order (``Exported.run(*inputs)``)."""
    return lambda **kwargs: call(*kwargs.values())


def tiny_llama() -> Any:
    """A one-layer Llama of width 32 (an export of it takes about a second)."""
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    return tf.LlamaForCausalLM(config).eval()


#: Every public entry point of the front end and the program tools, as (the call, its valid
#: keyword arguments), made from the module's fixtures: the property below replaces one or
#: two arguments by junk and wants success or ``XnnquantError``.  One more entry point is
#: one more row; the CLI, whose arguments are strings, has its own property (``test_cli``).
ENTRY_POINTS: dict[str, Callable[[Any], tuple[Callable[..., Any], dict[str, Any]]]] = {
    "export": lambda f: (xq.export, dict(module=small_module(), example_inputs=(torch.from_numpy(X),), **EXPORT_ARGS)),
    "export calibrated": lambda f: (xq.export, dict(module=small_module(), example_inputs=(torch.from_numpy(X),),
                                                    **{**EXPORT_ARGS, "calibration": [(torch.from_numpy(X),)],
                                                       "calibration_mask": None, "dynamic_shapes": None})),
    "check": lambda f: (xq.check, dict(module=small_module(), example_inputs=(torch.from_numpy(X),), weights="qc8w",
                                       fallback="auto", target="1.4.1", dynamic_shapes=None, strict=False,
                                       embeddings=None)),
    "export_llm": lambda f: (xq.export_llm, dict(model=tiny_llama(), max_context=8, max_seq_len=4, kv_cache="fp32",
                                                 weights="qb4w:16", embeddings="int8", method="mse", calibration=None,
                                                 rotation=None, eos_ids=None, full_logits=False, progress=False)),
    "Exported.run": lambda f: (_positional(f.exported.run), dict(x=torch.from_numpy(X))),
    "Exported.save": lambda f: (f.exported.save, dict(path="out.pte")),
    "Exported.source": lambda f: (f.exported.source, dict(node_index=0)),
    "verify": lambda f: (xq.verify, dict(subject=f.exported, inputs=[X], module=small_module(), tolerance=1e-3)),
    "graph.run": lambda f: (run, dict(payload=f.exported.to_bytes(), inputs=[X], named_data=None)),
    "read_pte": lambda f: (pte_module.read_pte, dict(source=f.pte, data_files=(), validate=True)),
    "run_method": lambda f: (pte_module.run_method, dict(program=f.pte, method="forward", inputs=[X], data_files=())),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@FEW
@given(data=st.data())
def test_public_entry_points(entry: str, data: st.DataObject, exported: xq.Exported, pte: bytes) -> None:
    call, valid = ENTRY_POINTS[entry](SimpleNamespace(exported=exported, pte=pte))
    kwargs = with_junk(data.draw, valid)
    refused_or_done(lambda: call(**kwargs))


#: Calibration batches: lists of input tuples of tensors of any shape, dtype and value.
BATCHES = st.lists(st.tuples(TENSORS) | st.tuples(TENSORS, TENSORS) | TENSORS, max_size=3)


@FEW
@given(BATCHES, st.sampled_from(["minmax", "gptq"]))
def test_export_calibration(batches: list[Any], method: str) -> None:
    args = {**EXPORT_ARGS, "method": method, "weights": "qb4w:32"}
    refused_or_done(lambda: xq.export(small_module(), (torch.from_numpy(X),), **{**args, "calibration": batches}))


@FEW
@given(data=st.data())
def test_pte(data: st.DataObject, pte: bytes) -> None:
    from xnnquant.pte import read_ptd, read_pte, run_method, verify_pte

    entry, valid = data.draw(st.sampled_from([
        (read_pte, dict(source=pte, data_files=(), validate=True)),
        (read_ptd, dict(source=b"\x00\x00\x00\x00FT01" + bytes(60))),
        (run_method, dict(program=pte, method="forward", inputs=[X], data_files=())),
        (verify_pte, dict(source=pte, data_files=(), seed=0, isolate=True, timeout=60.0)),
    ]))
    kwargs = with_junk(data.draw, valid, fixed=("isolate",))
    refused_or_done(lambda: entry(**kwargs))


@settings(FEW, max_examples=8)  # a program read_pte accepts is verified in full: about a second each
@given(data=st.data())
def test_pte_mutated(data: st.DataObject, pte: bytes) -> None:
    """A program cut short or with changed bytes: refused by ``read_pte``, or verified in the
    isolated runtime (which may crash on it: ``RuntimeCrashError``)."""
    from xnnquant.pte import read_pte, verify_pte

    mutated = _mutated(pte, data.draw, len(pte))
    refused_or_done(lambda: read_pte(mutated))
    refused_or_done(lambda: verify_pte(mutated, isolate=True, timeout=60.0))


@MANY
@given(data=st.data())
def test_torchao(data: st.DataObject) -> None:
    from xnnquant.torchao import XnnquantConfig, calibrate

    entry, valid = data.draw(st.sampled_from([
        (XnnquantConfig, dict(weights="qc8w", method="mse", activations="int8_dynamic", calibration=None)),
        (XnnquantConfig, dict(weights="qb4w:32", method="gptq", calibration={"0": X})),
        (calibrate, dict(model=small_module(), batches=[torch.from_numpy(X)], runtime_quantized=True,
                         filter_fn=None)),
    ]))
    kwargs = with_junk(data.draw, valid)
    with warnings.catch_warnings():  # activations=None warns (ExecuTorch drops weight-only scales)
        warnings.simplefilter("ignore")
        refused_or_done(lambda: entry(**kwargs))


#: Values each CLI option is given: valid ones and wrong ones ("{folder}": the property's folder).
CLI_VALUES = {
    "--seed": ["0", "3", "-1", "nan", "1e3", "\u00b2"], "--tolerance": ["0.5", "0", "nan", "-1", "inf", "x"],
    "--timeout": ["60", "0", "-1", "inf", "nan", "1e400"],
    "--data": ["{folder}/pte.bin", "{folder}/payload.bin", "{folder}/missing.ptd", "{folder}"],
    "--weights": ["qc8w", "fp32", "qb4w:32", "qb4w:\u00b2", "qb4w:48", "int4"],
    "--method": ["minmax", "mse", "gptq", "MSE", ""], "--fallback": ["auto", "qc8w,fp32", "qc8w,", "none", "5"],
    "--target": ["1.4.1", "xn01", "seed", "2.0"],
    "--weights-from": ["{folder}/missing.safetensors", "{folder}/payload.bin", "{folder}"],
    "-o": ["{folder}/o.pte", "{folder}/o.xnn", "{folder}/o.txt", "{folder}/missing/o.pte", "{folder}", ""],
}


@FEW
@given(data=st.data())
def test_cli(data: st.DataObject, tmp_path_factory: pytest.TempPathFactory, payload: bytes, pte: bytes) -> None:
    """Every command line gives a status and, on failure, a message of xnnquant's (or
    argparse's usage error), never a traceback."""
    from xnnquant import cli

    folder = tmp_path_factory.getbasetemp() / "cli"
    folder.mkdir(exist_ok=True)
    files = {"payload": payload, "pte": pte, "junk": b"not a payload", "empty": b"", "cut": payload[:100]}
    for name, blob in files.items():
        (folder / f"{name}.bin").write_bytes(blob)
    file = data.draw(st.sampled_from([*(str(folder / f"{n}.bin") for n in files), str(folder), str(folder / "missing" / "x")]))
    command = data.draw(st.sampled_from(["inspect", "verify", "export"]))
    options = {"inspect": ["--json", "--no-validate", "--data"],
               "verify": ["--seed", "--tolerance", "--timeout", "--data", "--json"],
               "export": ["--weights", "--method", "--fallback", "--target", "--weights-from", "--json", "-o"]}[command]
    argv = [command, file] if command != "export" else [command, "my_cli_models:small", "-o", str(folder / "o.pte")]
    for option in data.draw(st.lists(st.sampled_from(options), max_size=3)):
        values = st.sampled_from(CLI_VALUES.get(option, [""])) | st.text(max_size=3)
        argv += [option] if option in ("--json", "--no-validate") else [
            option, data.draw(values).replace("{folder}", str(folder))]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = cli.main(argv)
        except SystemExit as exit_:  # argparse's usage errors, verify's MISMATCH
            status = exit_.code
    text = err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert status == 0 or (status in (1, 2) and text.startswith(("xnnquant: error: ", "usage: "))), (argv, status, text)
    if text.startswith("xnnquant: error: "):
        assert text.count("\n") == 1, text  # one line of ours


@pytest.fixture(scope="module", autouse=True)
def cli_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """``my_cli_models:small`` for ``xnnquant export``."""
    import sys

    folder = tmp_path_factory.mktemp("models")
    (folder / "my_cli_models.py").write_text(
        "import torch\n\n\ndef small():\n    torch.manual_seed(0)\n"
        "    m = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()\n"
        "    return m, (torch.randn(2, 64),)\n")
    sys.path.insert(0, str(folder))
    yield
    sys.path.remove(str(folder))


# ------------------------------------------------------------------ known cases


def test_a_value_of_size_0_is_refused_when_built_and_when_read(payload: bytes) -> None:
    """Measured: a 0-size input passed validation and aborted the process (SIGABRT in
    ExecuTorch 1.4.1's tensor-meta check) when run; now refused by the builder and by
    validation, which every load and write runs."""
    with pytest.raises(XnnquantError) as info:
        Graph().input((0, 8))
    assert str(info.value) == ("dims must be integers >= 1: got (0, 8) (XNNPACK cannot run a value of size 0, and "
                               "ExecuTorch 1.4.1's runtime aborts the process on one)")
    g = Graph()
    x = g.input((2, 8))
    g.output(g.abs(x))
    g.value(x).dims = (2, 0)  # as a payload from elsewhere may declare it
    g.value(1).dims = (2, 0)
    with pytest.raises(XnnquantError) as info:
        g.to_bytes()
    assert str(info.value) == ("value 0: dims [2, 0] hold a 0: XNNPACK cannot run a value of size 0 (ExecuTorch 1.4.1's "
                               "runtime aborts the process on one); expected every dim >= 1")
    g = Graph()
    x = g.input((3, 8))
    g.output(g.static_reshape(x, (8, 3)))
    written = bytearray(g.to_bytes())
    assert load(bytes(written)).value(x).dims == (3, 8)
    at = bytes(written).find(np.array([3, 8], "<u4").tobytes())  # the input's dims in the flatbuffer
    written[at:at + 4] = bytes(4)
    expected = ("value 0: dims [0, 8] hold a 0: XNNPACK cannot run a value of size 0 (ExecuTorch 1.4.1's runtime "
                "aborts the process on one); expected every dim >= 1")
    for refused in (lambda: load(bytes(written)), lambda: run(bytes(written), [np.ones((1, 8), np.float32)])):
        with pytest.raises(XnnquantError) as info:  # run: refused before the runtime sees it
            refused()
        assert str(info.value) == expected


def test_declared_output_dims_must_be_what_the_node_computes() -> None:
    """A declared output larger than computed ran into ``MemoryError`` and shape mismatches
    later (the program is planned at the declared dims); validation now computes each
    node's output dims (``shapes.node_output_dims``) and refuses a disagreement."""
    g = Graph()
    x = g.input((2, 64))
    y = g.fully_connected(x, g.constant(W))
    g.output(y)
    for dims in [(2, 1_000_000), (2, 4), (4, 8), (16,)]:
        g.value(y).dims = dims
        with pytest.raises(XnnquantError) as info:
            g.to_bytes()
        assert str(info.value) == (f"node 0 (XNNFullyConnected): output value 2 is declared with dims {list(dims)}, "
                                   "but the node computes [2, 8] from its inputs' dims [[2, 64], [8, 64]]")
    g.value(y).dims = (2, 8)
    assert load(g.to_bytes()) == g


def test_save_names_the_path_given_not_the_temporary_file(exported: xq.Exported, tmp_path: Path) -> None:
    target = tmp_path / "missing" / "m.pte"
    with pytest.raises(OutputFileError) as info:
        exported.save(target)
    assert str(info.value) == (f"cannot write {str(target)!r}: No such file or directory (its directory "
                               f"{str(target.parent)!r} does not exist)")
    assert ".tmp" not in str(info.value) and isinstance(info.value, OSError)
    with pytest.raises(XnnquantError) as info:
        exported.save(123)  # type: ignore[arg-type]
    assert str(info.value) == "path must be a file path (a non-empty str or os.PathLike): got 123"


def test_exported_source_index(exported: xq.Exported) -> None:
    assert exported.source(0) is not None
    n = len(exported.graph.nodes)
    for bad in (999, -1, "a", 1.0, None):
        with pytest.raises(XnnquantError) as info:
            exported.source(bad)  # type: ignore[arg-type]
        assert str(info.value) == (f"node_index must be the index of a graph node, an integer from 0 to {n - 1}: got "
                                   f"{bad!r}")


def test_verify_module_must_be_callable(exported: xq.Exported) -> None:
    with pytest.raises(XnnquantError) as info:
        xq.verify(exported, [X], "m")
    assert str(info.value) == ("module must be the float torch.nn.Module to compare with (called as "
                               "module(*inputs)), or None: got 'm'")
    with pytest.raises(XnnquantError, match=r"^module\(\*inputs\) failed: TypeError: "):
        xq.verify(exported, [X], lambda: 1)
    with pytest.raises(XnnquantError) as info:
        xq.verify(exported, [X], lambda x: (x, x))
    assert str(info.value).startswith("module(*inputs) must return 1 tensor(s), one per graph output: got Tensor of "
                                      "shape (2, 64)")
    for bad in (float("nan"), -1.0, "1e-3", None):
        with pytest.raises(XnnquantError, match=r"^tolerance "):
            xq.verify(exported, [X], tolerance=bad)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(weights="qb4w:\u00b2"), "unknown weights scheme: got 'qb4w:\u00b2', expected 'fp32', 'qc8w', 'qc4w' or "
                                  "'qb4w:G' with G a multiple of 32 (e.g. 'qb4w:32')"),
    (dict(fallback=5), "fallback must be 'auto', None, a scheme or a sequence of schemes: got int 5 (e.g. "
                       "fallback=('qc8w', 'fp32'))"),
    (dict(fallback=b"qc8w"), "fallback must be 'auto', None, a scheme or a sequence of schemes: got bytes b'qc8w' "
                             "(e.g. fallback=('qc8w', 'fp32'))"),
    (dict(state_dict=123), "state_dict must be the path of a safetensors file (or of a sharded checkpoint's .json "
                           "index): got int"),
    (dict(calibration=5), "calibration must be an iterable of input tuples (one tuple of the module's positional "
                          "inputs per batch): got int"),
    (dict(calibration=[(torch.zeros(2, 63),)]), "calibration batch 0 ((2, 63) torch.float32) does not fit the "
                                                "module: layer '0' (Linear) fails on it: RuntimeError: mat1 and mat2 "
                                                "shapes cannot be multiplied (2x63 and 64x32)"),
    (dict(calibration=[(torch.zeros(2, 64, dtype=torch.float64),)]),
     "calibration batch 0, input 0 is torch.float64 of shape (2, 64): expected torch.float32 of rank 2, as example "
     "input 0 (2, 64)"),
    (dict(calibration=[(torch.zeros(2, 64), torch.zeros(2, 64))]),
     "calibration batch 0 has 2 input(s): expected 1, as the example inputs"),
    (dict(method="gptq", calibration=[(torch.zeros(2, 64, dtype=torch.int64),)]),
     "calibration batch 0, input 0 is torch.int64 of shape (2, 64): expected torch.float32 of rank 2, as example "
     "input 0 (2, 64)"),
    (dict(activations=np.zeros(2)), "unknown activations: got ndarray of shape (2,) float64, expected one of "
                                    "'dynamic', 'qint8' or an xq.StaticInt8(...)"),
])
def test_export_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(XnnquantError) as info:
        xq.export(small_module(), (torch.from_numpy(X),), **{"progress": False, **kwargs})
    assert str(info.value) == message


def test_run_and_verify_pte_time_limits(payload: bytes, pte: bytes) -> None:
    from xnnquant.pte import verify_pte

    for bad, shown in (("a", "'a'"), (-1, "-1"), (0, "0"), (float("nan"), "nan"), (2**70, str(2**70))):
        with pytest.raises(XnnquantError) as info:
            run(payload, [X], isolate=True, timeout=bad)
        got = repr(float(bad)) if not isinstance(bad, str) else None
        assert str(info.value) == (f"timeout must be a real number: got {shown}" if got is None else
                                   f"timeout is out of range: got {got}, expected a number of seconds > 0 and at most "
                                   f"{MAX_SECONDS:g} (or None)")
        with pytest.raises(XnnquantError, match=r"^timeout "):
            verify_pte(pte, isolate=True, timeout=bad)
    with pytest.raises(XnnquantError, match=r"^seed is out of range: got -1, expected >= 0$"):
        verify_pte(pte, seed=-1)


def test_read_pte_arguments(pte: bytes, tmp_path: Path) -> None:
    from xnnquant.pte import read_pte

    with pytest.raises(XnnquantError) as info:
        read_pte(pte, data_files=123)  # type: ignore[arg-type]
    assert str(info.value) == ("data_files must be the bytes or the path of a .ptd file, or a list of them: got "
                               "123")
    zipped = tmp_path / "model.zip"
    zipped.write_bytes(b"PK\x03\x04" * 8)
    with pytest.raises(ProgramError) as info:
        read_pte(zipped)
    assert str(info.value) == (f"{str(zipped)!r} is not an ExecuTorch program: got identifier b'PK\\x03\\x04' "
                               "(32 bytes), expected b'ET12'")


def test_a_program_the_deserializer_cannot_read_is_a_program_error(pte: bytes) -> None:
    """Measured: a ``.pte`` with bytes that neither ``read_pte`` nor the runtime's loader read
    made ExecuTorch's Python deserializer (which ``verify_pte`` uses to cut the method after
    each delegate call) raise ``UnicodeDecodeError`` or ``struct.error``; in this process and
    isolated it is now a ``ProgramError`` saying the program is malformed."""
    from xnnquant.pte import read_pte, verify_pte

    data = bytearray(pte)
    at = data.find(b"[1, ")  # the method's pytree input spec, a string only the Python deserializer decodes
    assert at > 0
    data[at:at + 4] = b"\xff\xfe\xff\xfe"
    read_pte(bytes(data))  # nothing read_pte looks at
    for isolate in (False, True):
        with pytest.raises(ProgramError) as info:
            verify_pte(bytes(data), isolate=isolate)
        assert str(info.value) == ("the program is malformed: ExecuTorch's deserializer cannot read it "
                                   "(UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 0: invalid "
                                   "start byte)")


def test_cli_verify_tolerance_nan_is_a_usage_error(tmp_path: Path, payload: bytes) -> None:
    """``--tolerance nan`` printed MISMATCH and exited 0 before: now argparse refuses it."""
    from xnnquant import cli

    path = tmp_path / "m.xnn"
    path.write_bytes(payload)
    for option, value, expected in (("--tolerance", "nan", "expected a finite number >= 0, got 'nan'"),
                                    ("--timeout", "-1", "expected a number of seconds > 0 and at most"),
                                    ("--seed", "-3", "expected an integer >= 0, got '-3'")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            cli.main(["verify", str(path), option, value])
        assert exit_.value.code == 2 and expected in err.getvalue()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["verify", str(path), "--data", str(path)]) == 2
        assert cli.main(["verify", str(path), "--no-isolate", "--timeout", "5"]) == 2
    assert err.getvalue() == (f"xnnquant: error: --data goes with an ExecuTorch program (.pte): {str(path)!r} is not "
                              "one (its bytes 4..7 are not b'ET12'), and an XNNGraph payload has no data files\n"
                              "xnnquant: error: --timeout limits the isolated runtime: got --timeout 5 with "
                              "--no-isolate (drop one of them)\n")


def test_state_dict_for_a_module_with_weights_api_and_cli(tmp_path: Path) -> None:
    """A module with weights of its own and a safetensors file: the same message from
    ``xq.export(..., state_dict=)`` and from ``xnnquant export --weights-from``."""
    from safetensors.numpy import save_file

    from xnnquant import cli

    path = tmp_path / "unrelated.safetensors"
    save_file({"other.weight": np.zeros((3, 3), np.float32)}, str(path))
    expected = (f"state_dict= (xnnquant export --weights-from) reads the module's tensors from {str(path)!r}, but "
                "'0.weight' holds data of its own (on cpu): build the module on the meta device (with "
                "torch.device('meta'): ...), or export it without state_dict=")
    with pytest.raises(XnnquantError) as info:
        xq.export(small_module(), (torch.from_numpy(X),), state_dict=path, progress=False)
    assert str(info.value) == expected
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        status = cli.main(["export", "my_cli_models:small", "-o", str(tmp_path / "o.pte"), "--weights-from", str(path)])
    assert status == 2 and err.getvalue() == f"xnnquant: error: {expected}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated.safetensors"]


def test_torchao_arguments() -> None:
    from torchao.quantization import quantize_

    from xnnquant.torchao import XnnquantConfig, calibrate

    with pytest.raises(XnnquantError) as info:
        XnnquantConfig(activations=[])  # type: ignore[arg-type]
    assert str(info.value) == "unknown activations: got [], expected 'int8_dynamic' or None"
    with pytest.raises(XnnquantError) as info:
        XnnquantConfig(method="gptq", calibration=np.zeros((10, 64)))  # type: ignore[arg-type]
    assert str(info.value) == ("calibration must map layer names (or modules) to calibrations: got ndarray of shape "
                               "(10, 64) float64, expected {layer name: Calibration or (tokens, in_features) array} "
                               "(see calibrate)")
    with pytest.raises(XnnquantError) as info:
        XnnquantConfig(weights="qb4w:\u00b2")
    assert str(info.value).startswith("unknown weights scheme: got 'qb4w:\u00b2', expected 'fp32', 'qc8w'")
    module = small_module()
    with pytest.raises(XnnquantError) as info:
        calibrate(module, 5)
    assert str(info.value) == ("batches must be an iterable of batches (each a tensor or a tuple of the model's "
                               "positional inputs): got 5")
    with pytest.raises(XnnquantError) as info:
        calibrate(module, [torch.zeros(2, 63)])
    assert str(info.value) == ("calibration batch 0: the input of layer '0' is not usable: calibration has the wrong "
                               "width: got 63 features (shape (2, 63)), expected in_features=64")
    quantize_(module, XnnquantConfig(weights="qc8w"))
    with pytest.raises(XnnquantError) as info:  # torchao's tensor subclass: once is enough
        quantize_(module, XnnquantConfig(weights="qc8w"))
    assert str(info.value) == ("layer '0' is quantized already: its weight is a IntxUnpackedToInt8Tensor of "
                               "torch.float32, expected a float tensor (apply quantize_ to the float model, once)")


def test_graph_run_inputs_and_named_data(payload: bytes, tmp_path: Path) -> None:
    with pytest.raises(XnnquantError) as info:
        run(payload, None)  # type: ignore[arg-type]
    assert str(info.value).startswith("run needs one array per external input, in a list: got None, expected 1")
    with pytest.raises(XnnquantError) as info:
        run(payload, [X], named_data=True)  # type: ignore[arg-type]
    assert str(info.value) == "named_data must map str keys to bytes: got True"
    missing = tmp_path / "missing" / "m.xnn"
    with pytest.raises(PayloadError, match=f"^cannot read payload file {re.escape(repr(str(missing)))}"):
        run(missing, [X])
    with pytest.raises(XnnquantError) as info:
        to_pte(7)  # type: ignore[arg-type]
    assert str(info.value) == "payload must be bytes, a path or a Graph: got 7"


def test_is_pte_never_opens_a_file_descriptor() -> None:
    """``is_pte(5)`` opened (and closed) file descriptor 5 before."""
    from xnnquant.pte import is_pte

    read, write = os.pipe()
    try:
        assert not is_pte(read) and not is_pte(write)  # type: ignore[arg-type]
        os.write(write, b"still open")
        assert os.read(read, 10) == b"still open"
    finally:
        os.close(read)
        os.close(write)
    assert not is_pte("bad\x00path")


def test_every_error_is_a_value_error() -> None:
    """The contract the properties rely on: each class is an ``XnnquantError`` (a ``ValueError``)."""
    for cls in (OutputFileError, PayloadError, ProgramError, xq.RuntimeCrashError, xq.UnsupportedConfigError):
        assert issubclass(cls, XnnquantError) and issubclass(cls, ValueError)
    assert math.isfinite(MAX_SECONDS)


def test_arguments_that_would_be_ignored_are_refused(payload: bytes, pte: bytes) -> None:
    """An argument an entry point would not use is an error, not silently dropped."""
    from xnnquant.pte import read_pte, run_method, verify_pte

    with pytest.raises(XnnquantError) as info:
        run(payload, [X], timeout=5)
    assert str(info.value) == ("timeout= limits the isolated runtime: got timeout=5 with isolate=False (pass "
                               "isolate=True to stop a call that runs too long)")
    with pytest.raises(XnnquantError, match=r"^timeout= limits the isolated runtime: got timeout=5 with isolate"):
        verify_pte(pte, timeout=5)
    with pytest.raises(XnnquantError) as info:
        run_method(read_pte(pte), "forward", [X], data_files=[pte])
    assert str(info.value).startswith("data_files= goes with a .pte's bytes or path: a PteProgram has read its data "
                                      "files already (read_pte(path, data_files)); got [b'")
    g = Graph()
    x = g.input((2, 3))
    with pytest.raises(XnnquantError) as info:
        g.convert(x, xq.Datatype.qdint8, scale=0.5)
    assert str(info.value) == ("convert to qdint8 takes no scale= or zero_point= (they go with qint8 and quint8): got "
                               "scale=0.5, zero_point=None")
    program = torch.export.export(small_module(), (torch.from_numpy(X),), strict=False)
    with pytest.raises(XnnquantError) as info:
        xq.export(program, (torch.from_numpy(X),), progress=False)
    assert str(info.value) == ("example_inputs= goes with a torch.nn.Module: a saved program (ExportedProgram) "
                               "carries its own example inputs; pass none")
    with pytest.raises(XnnquantError) as info:
        interpret(load(payload), [X], named_data={})
    assert str(info.value) == "named_data= goes with payload bytes or a path: a Graph has its constants already"


def test_argument_checks_pin_their_messages() -> None:
    """``xnnquant.arguments``: what each check takes and what it says when it does not."""
    from xnnquant import arguments as a

    assert a.flag(np.bool_(True), "f") is True and a.integer(np.int8(-3), "n") == -3
    assert a.number(np.float32(0.5), "x") == 0.5 and math.isnan(a.number(float("nan"), "x", nan=True))
    assert a.integers(np.array([1, 2]), "s") == (1, 2) and a.integers(range(2), "s") == (0, 1)
    assert a.seconds(None) is None and a.seconds(2) == 2.0 and a.path("a.pte") == Path("a.pte")
    assert a.choice("x", "c", ("x", "y")) == "x" and a.items((1,), "i") == [1]
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: a.flag(1, "check"), "check must be True or False: got 1"),
        (lambda: a.flag(np.zeros(3), "check"), "check must be True or False: got ndarray of shape (3,) float64"),
        (lambda: a.integer(True, "groups"), "groups must be an integer: got True"),
        (lambda: a.integer(2.0, "groups"), "groups must be an integer: got 2.0"),
        (lambda: a.integer(0, "groups", low=1), "groups is out of range: got 0, expected >= 1"),
        (lambda: a.integer(9, "axis", low=0, high=3), "axis is out of range: got 9, expected 0 to 3"),
        (lambda: a.number("1", "alpha"), "alpha must be a real number: got '1'"),
        (lambda: a.number(1j, "alpha"), "alpha must be a real number: got 1j"),
        (lambda: a.number(float("nan"), "alpha"), "alpha is out of range: got nan, expected a number, not NaN"),
        (lambda: a.number(-1, "tolerance", low=0.0), "tolerance is out of range: got -1.0, expected a number >= 0"),
        (lambda: a.number(float("inf"), "scale", finite=True), "scale is out of range: got inf, expected a finite "
                                                               "number"),
        (lambda: a.integers("ab", "perm"), "perm must be a sequence of integers: got 'ab'"),
        (lambda: a.integers((1, 2.5), "perm"), "perm must be a sequence of integers: got 2.5 at index 1"),
        (lambda: a.integers((1,), "kernel", length=2), "kernel must hold 2 integers: got 1 ((1,))"),
        (lambda: a.integers((1, -2), "sizes", low=0), "sizes[1] is out of range: got -2, expected >= 0"),
        (lambda: a.items(iter([]), "inputs", "arrays"), "inputs must be a list or tuple of arrays: got "
                                                        "list_iterator <list_iterator object at 0x"),
        (lambda: a.path(b"m.pte"), "path must be a file path (a non-empty str or os.PathLike): got b'm.pte'"),
        (lambda: a.seconds(float("inf")), f"timeout is out of range: got inf, expected a number of seconds > 0 and "
                                          f"at most {MAX_SECONDS:g} (or None)"),
        (lambda: a.choice(["x"], "mode", ("x", "y")), "mode must be one of 'x', 'y': got ['x']"),
    ]
    for call, message in cases:
        with pytest.raises(XnnquantError) as info:
            call()
        assert str(info.value).startswith(message), (str(info.value), message)
        assert str(info.value) == message or message.endswith("0x")
