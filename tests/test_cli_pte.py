"""``xnnquant inspect`` and ``xnnquant verify`` on ``.pte`` files ExecuTorch 1.4.1 wrote
(``tests/oracles/et_programs.py``), and capturing what a program feeds its delegates.

The byte counts below follow from the shapes of the oracle's layers and the datatypes
ExecuTorch chose for torchao's configs: fc1 int4 group 32 ``[64, 128]`` (4096 bytes of
nibbles, 256 bf16 scales), fc2 int4 group 64 ``[96, 64]`` (3072 bytes, 96 bf16 scales),
fc3 int8 per channel ``[16, 96]`` (1536 bytes, 16 fp32 scales), biases of fc1 and fc3 fp32.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from xnnquant import cli
from xnnquant.pte import read_pte
from xnnquant.pte.run import delegate_io, run_method

pytestmark = pytest.mark.xnnpack

TORCHAO_BYTES = {"qbint4": {"constants": 2, "bytes": 4096 + 3072, "scale_bytes": 2 * (256 + 96)},
                 "qcint8": {"constants": 1, "bytes": 1536, "scale_bytes": 4 * 16},
                 "fp32": {"constants": 2, "bytes": 4 * (64 + 16), "scale_bytes": 0}}


def inspect_json(capsys: pytest.CaptureFixture, *args: str) -> dict:
    assert cli.main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name, data", [("torchao.pte", []), ("torchao_ext.pte", ["model.ptd"])])
def test_inspect_json_of_an_8da4w_program(et_programs: Path, capsys: pytest.CaptureFixture, name: str,
                                          data: list[str]) -> None:
    args = [str(et_programs / name)] + [a for d in data for a in ("--data", str(et_programs / d))]
    record = inspect_json(capsys, *args)
    assert record["methods"] == ["forward"] and record["other_delegates"] == []
    (delegate,) = record["delegates"]
    weights = [v for v in delegate["values"] if v["quant"] and v["quant"]["kind"] != "PerTokenDynamicQuant"]
    assert [(v["datatype"], v["shape"], v["quant"].get("group_size")) for v in weights] == [
        ("qbint4", [64, 128], 32), ("qbint4", [96, 64], 64), ("qcint8", [16, 96], None)]
    assert [(v["bytes"], v["scale_bytes"], v["quant"]["scale_dtype"]) for v in weights] == [
        (4096, 512, "bf16"), (3072, 192, "bf16"), (1536, 64, "fp32")]
    assert record["bytes_by_datatype"] == delegate["bytes_by_datatype"] == TORCHAO_BYTES
    assert record["named_data"]["origins"] == ([str(et_programs / "model.ptd")] if data else ["program"])


def test_inspect_text_of_a_three_method_program(et_programs: Path, capsys: pytest.CaptureFixture) -> None:
    """xnnquant.pte: fc1 qb4w:32 [64, 128], fc2 qc4w [96, 64] (written as group 64), fc3 qc8w
    [16, 96], proj qb4w:64 [24, 128], and weight_only's proj folded to fp32 [24, 128]."""
    assert cli.main(["inspect", str(et_programs / "xnnquant.pte")]) == 0
    out = capsys.readouterr().out
    assert "methods forward, head, weight_only; 4 XNNPACK delegate(s)" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("delegate ")] == [
        "forward/0", "forward/1", "head/0", "weight_only/0"]
    *_, totals, checked, not_checked = out.rstrip().splitlines()
    assert totals == ("bytes by datatype, all delegates: fp32 5 constants 12,800 B; qbint4 3 constants "
                      "8,704 B + 800 B scales; qcint8 1 constant 1,536 B + 64 B scales")
    assert checked == ("checked: the file's structure: headers, offsets, flatbuffers; every payload against XNNPACK "
                       "1.4.1's rules for values and nodes (graph.validate)")
    assert not_checked == (f"not checked: the runtime: nothing was loaded or run (xnnquant verify "
                           f"{et_programs / 'xnnquant.pte'} runs it, isolated)")


def test_inspect_without_the_data_file(et_programs: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["inspect", str(et_programs / "torchao_ext.pte")]) == 2
    err = capsys.readouterr().err
    assert "names 8 constant(s) that are neither in the program nor in its data files (none given;" in err
    assert err.rstrip().endswith("(xnnquant CLI: --data) (beside it: model.ptd)")


@pytest.mark.parametrize("name, data, isolate", [("torchao.pte", [], True), ("torchao_ext.pte", ["model.ptd"], False),
                                                 ("xnnquant.pte", [], False)])
def test_verify_programs(et_programs: Path, capsys: pytest.CaptureFixture, name: str, data: list[str],
                         isolate: bool) -> None:
    """Isolated (the default: a child process) once, in this process for the others."""
    args = [str(et_programs / name)] + [a for d in data for a in ("--data", str(et_programs / d))]
    assert cli.main(["verify", *args] + ([] if isolate else ["--no-isolate"])) == 0
    lines = capsys.readouterr().out.splitlines()
    delegates = [line for line in lines if line.startswith("  delegate ")]
    assert len(delegates) == (4 if name == "xnnquant.pte" else 1)
    alone = [line.rsplit("payload run alone: ", 1)[1] for line in delegates]
    assert alone == ["identical"] * (3 if name == "xnnquant.pte" else 1) + (
        ["not possible (unused delegate arguments)"] if name == "xnnquant.pte" else [])
    assert lines[-1].startswith("OK: worst relative error")


def test_verify_reports_a_mismatch(et_programs: Path, capsys: pytest.CaptureFixture,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault in the interpreter's fully connected layer (1 % too large) is found both end to
    end and node by node (the program's constants are named data)."""
    from xnnquant.graph import interpreter

    real = interpreter.HANDLERS["XNNFullyConnected"]
    monkeypatch.setitem(interpreter.HANDLERS, "XNNFullyConnected",
                        lambda node, args: [y * np.float32(1.01) for y in real(node, args)])
    with pytest.raises(SystemExit) as exited:
        cli.main(["verify", str(et_programs / "torchao.pte"), "--no-isolate"])
    assert exited.value.code == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("MISMATCH: worst relative error 0.0099")


@pytest.mark.parametrize("name, data", [("torchao.pte", []), ("torchao_ext.pte", ["model.ptd"])])
def test_node_by_node_check_of_constants_in_named_data(et_programs: Path, name: str, data: list[str],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """ExecuTorch keeps an 8da4w program's constants in named data (in the program or a .ptd);
    the node-by-node check rewrites the delegate with them and judges it all the same.  Forced
    here (threshold 0) because this small program's end-to-end error is below the threshold;
    ExecuTorch's MiniLM int4 program needs it (end to end 5.1e-4, node by node 4.0e-6)."""
    import xnnquant.pte.run as pte_run

    monkeypatch.setattr(pte_run, "NODE_CHECK_ABOVE", 0.0)
    program = read_pte(et_programs / name, [et_programs / d for d in data])
    x = np.load(et_programs / f"input_{name.removesuffix('.pte')}.npy")
    (check,) = pte_run.check_delegates(program, "forward", [x])
    # the runtime's own values fed to each node: what is left is XNNPACK's float32 rounding
    # of one layer (a few ulps of the largest output), far below the 1e-4 threshold
    assert check.node_error is not None and check.node_error < 1e-5


def test_verify_isolated_past_its_timeout(et_programs: Path, capsys: pytest.CaptureFixture,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The isolated check stops at its timeout.  Certain, not a race: the worker is handed a call
    that sleeps 60 s (time.sleep, run in the worker process) with the CLI's 0.5 s timeout."""
    import time

    import xnnquant.pte.run as pte_run
    from xnnquant.graph.worker import worker

    def stalled(*args: object, timeout: float | None = None, **kwargs: object) -> object:
        return worker().call(time.sleep, (60,), timeout, "verifying the program")

    monkeypatch.setattr(pte_run, "verify_pte", stalled)
    started = time.monotonic()
    assert cli.main(["verify", str(et_programs / "torchao.pte"), "--timeout", "0.5"]) == 2
    assert "the isolated runtime did not finish verifying the program within 0.5 s: stopped it" \
        in capsys.readouterr().err
    assert time.monotonic() - started < 50  # stopped, not waited for


def test_isolated_verify_keeps_the_runtime_log_off_this_process(et_programs: Path,
                                                                 capfd: pytest.CaptureFixture) -> None:
    """What the isolated runtime writes (the libraries it imports, the runtime's CPU probe)
    goes to the worker's log, not to the caller's file descriptors."""
    from xnnquant.pte.run import verify_pte

    program = read_pte(et_programs / "torchao.pte")
    capfd.readouterr()  # what this process wrote before: its own imports
    errors, _ = verify_pte(program, isolate=True)
    assert max(errors) <= 1e-4
    assert capfd.readouterr() == ("", "")


def test_delegate_inputs_are_what_the_program_computes_between_delegates(et_programs: Path) -> None:
    """forward: delegate 0, cumsum (ExecuTorch's portable kernel), delegate 1, which also takes
    the program constant 8 (a 0-d tensor) as an input."""
    program = read_pte(et_programs / "xnnquant.pte")
    x = np.load(et_programs / "input_forward.npy")
    first_in, first_out = delegate_io(program, "forward/0", [x])
    second_in, second_out = delegate_io(program, "forward/1", [x])
    np.testing.assert_array_equal(first_in[0], x)
    # the portable cumsum adds in the same order as numpy's float32 cumsum
    np.testing.assert_array_equal(second_in[0], np.cumsum(first_out[0], axis=-1, dtype=np.float32))
    assert second_in[1].shape == () and second_in[1] == 8
    np.testing.assert_array_equal(second_out[0], run_method(program, "forward", [x])[0])
    np.testing.assert_array_equal(second_out[0], np.load(et_programs / "output_forward.npy"))
