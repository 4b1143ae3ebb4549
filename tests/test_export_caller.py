"""What an export owes its caller, and what it takes as inputs (issue 34).

* Export never writes into the caller's tensors or module: example inputs, calibration
  batches, parameters and buffers are the same objects holding the same values after every
  path (self-check, eager and traced calibration, a refused export).
* An input the forward writes into (``x.mul_(2)``) is carried as ExecuTorch carries it: its
  new value is the first output (measured on ExecuTorch 1.4.1's own flow:
  ``to_edge_transform_and_lower(...).to_executorch()`` of the same module returns
  ``(2x, y)`` and leaves the tensor given to ``execute`` as it was).
* Inputs are checked against what the program computes on before lowering, whatever
  ``check=``; 0-d inputs run; tensors that hold no dense CPU values are refused.
* Planned memory the runtime could not allocate is refused before it tries.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.graph import run as graph_run
from xnnquant.pte import run_method

torch = pytest.importorskip("torch")
nn = torch.nn
Dim = torch.export.Dim

pytestmark = pytest.mark.xnnpack


def _seeded(module: Any) -> Any:
    torch.manual_seed(0)
    return module


class Doubles(nn.Module):
    """Writes into its input, then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.fc(x)


class Stateful(nn.Module):
    """A batch norm (running statistics as buffers), a buffer it adds, two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 32)
        self.norm = nn.BatchNorm1d(32)
        self.register_buffer("shift", torch.linspace(-1, 1, 32))
        self.fc2 = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x)) + self.shift))


def _snapshot(module: Any, *tensors: Any) -> list[tuple[str, Any, Any, int]]:
    """(name, object, values, version) of every parameter, buffer and given tensor."""
    named = [*module.named_parameters(), *module.named_buffers(),
             *((f"given {i}", t) for i, t in enumerate(tensors))]
    return [(name, t, t.detach().clone(), t._version) for name, t in named]


def _assert_unchanged(module: Any, before: list[tuple[str, Any, Any, int]], written: tuple[str, ...] = ()) -> None:
    """Every tensor is the object it was, with its values; none was written into, but the
    buffers ``written`` (which the module's own forward updates: export runs it and puts
    their values back)."""
    owned = dict([*module.named_parameters(), *module.named_buffers()])
    for name, tensor, values, version in before:
        if not name.startswith("given"):
            assert owned[name] is tensor, f"{name} is another object"
        assert torch.equal(tensor, values), f"{name} changed"
        assert tensor._version == version or name in written, f"{name} was written into"


# ------------------------------------------------------------ the caller's tensors


@pytest.mark.parametrize("check", [False, True])
def test_an_input_the_forward_writes_into_is_an_output_and_the_callers_tensor_is_kept(check: bool) -> None:
    """Before: check=False wrote into nothing but returned an unexplained extra output;
    check=True doubled the caller's tensor twice and blamed torch.export."""
    module = _seeded(Doubles()).eval()
    x = torch.randn(2, 8)
    before = _snapshot(module, x)
    exported = xq.export(module, (x,), weights="fp32", check=check, progress=False)
    _assert_unchanged(module, before)
    assert exported.mutated_inputs == ["x"]
    assert [o.name for o in exported.outputs] == ["x (written by forward)", "output 1"]
    assert "output 0: input 'x' as forward leaves it (forward writes into it)" in str(exported)
    given = x.clone()
    doubled, y = exported.run(given)
    assert torch.equal(given, x)  # running the program writes into nothing either
    want = x.clone()
    with torch.no_grad():
        expected = module(want)
    np.testing.assert_array_equal(doubled, want.numpy())  # 2x: exact in float32
    # XNNPACK's fp32 linear sums 8 products in another order than torch: a few ulps of |y|
    np.testing.assert_allclose(y, expected.detach().numpy(), rtol=0, atol=1e-5 * float(expected.abs().max()))
    if check:
        assert str(exported.self_check).startswith("self-check passed")


def test_export_never_changes_the_module_or_the_tensors_it_is_given() -> None:
    """Every path that runs the module: the self-check, calibration on the module itself
    (batches of another shape than the example: ``eager.py``), the program's run on
    calibration batches of the example's shape, and a static int8 export."""
    module = _seeded(Stateful()).eval()
    with torch.no_grad():
        module.norm.running_mean.uniform_(-1, 1)
        module.norm.running_var.uniform_(0.5, 2)
    x = torch.randn(4, 32)
    same = [(torch.randn(4, 32),) for _ in range(2)]
    other = [(torch.randn(3, 32),) for _ in range(2)]
    before = _snapshot(module, x, *(b[0] for b in same + other))
    for kwargs in (dict(weights="qb4w:32", method="gptq", calibration=same),
                   dict(weights="qc8w", method="gptq", calibration=other),
                   dict(weights="qc8w", calibration=same),
                   dict(weights="qc8w", calibration=same, activations="qint8")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", xq.FallbackWarning)
            xq.export(module, (x,), progress=False, **kwargs)
        _assert_unchanged(module, before)


def test_inputs_written_into_in_a_mixed_program_lead_its_outputs_in_input_order() -> None:
    """Token ids incremented (a portable kernel) and a float input scaled (XNNPACK)."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Embedding(10, 8)
            self.fc = nn.Linear(8, 4)

        def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            ids.add_(1)
            x.mul_(3)
            return self.fc(self.table(ids)) + x.sum(dim=0, keepdim=True)

    module = _seeded(Both()).eval()
    ids, x = torch.tensor([[1, 2, 3]]), torch.randn(2)
    before = _snapshot(module, ids, x)
    exported = xq.export(module, (ids, x), weights="fp32", progress=False)
    _assert_unchanged(module, before)
    assert exported.mixed and exported.mutated_inputs == ["ids", "x"]
    assert [o.name for o in exported.outputs] == ["ids (written by forward)", "x (written by forward)", "output 2"]
    new_ids, new_x, _ = exported.run(ids, x)
    assert new_ids.tolist() == [[2, 3, 4]] and np.array_equal(new_x, (x * 3).numpy())  # exact: integers, one product
    assert torch.equal(ids, torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("rows", [4, 3])
def test_calibration_batches_the_forward_writes_into_are_kept(rows: int) -> None:
    """Batches of the example's shape run through the program; of another shape, through the
    module itself (``eager.py``), which wrote into them before."""
    module = _seeded(Doubles()).eval()
    x = torch.randn(4, 8)
    batches = [(torch.randn(rows, 8),) for _ in range(2)]
    before = _snapshot(module, x, *(b[0] for b in batches))
    xq.export(module, (x,), weights="qc8w", method="gptq", calibration=batches, progress=False)
    _assert_unchanged(module, before)


def test_a_forward_that_writes_into_its_buffers_leaves_them_as_they_were() -> None:
    """The buffer becomes program state (``test_export_state.py``); the caller's buffer keeps
    its object and values (export runs the forward to check the program, and puts them back)."""

    class Counts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls.add_(1)
            return self.fc(x) + self.calls

    module = _seeded(Counts()).eval()
    before = _snapshot(module)
    exported = xq.export(module, (torch.randn(2, 4),), weights="fp32", progress=False)
    _assert_unchanged(module, before, written=("calls",))
    assert exported.state == {"calls": (1,)}


def test_a_forward_that_writes_into_a_parameter_is_refused_and_the_parameter_kept() -> None:
    class Grows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.fc.weight.mul_(2)
            return self.fc(x)

    module = _seeded(Grows()).eval()
    before = _snapshot(module)
    for call in (xq.export, xq.check):
        with pytest.raises(UnsupportedConfigError) as info:
            call(module, (torch.randn(2, 4),), weights="fp32", **({"progress": False} if call is xq.export else {}))
        assert str(info.value) == (
            "the module's forward writes into its parameter(s) 'fc.weight': a program's weights are constants, and "
            "a forward that changes them computes something else at each call; expected a forward that leaves its "
            "parameters as they are")
    _assert_unchanged(module, before)


# ------------------------------------------------------------------ inputs


class Scales(nn.Module):
    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return x * s


def test_a_0d_input_runs() -> None:
    """Before: the self-check handed the program shape (1,) and refused its own input."""
    exported = xq.export(Scales().eval(), (torch.randn(2, 4), torch.tensor(3.0)), weights="fp32", progress=False)
    assert exported.inputs[1].shape == ()
    x = torch.randn(2, 4)
    (y,) = exported.run(x, torch.tensor(-1.5))
    np.testing.assert_array_equal(y, (x * -1.5).numpy())  # one float32 product each: exact on both sides
    (y,) = exported.run(x.numpy(), np.float32(2.0))
    np.testing.assert_array_equal(y, (x * 2).numpy())


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("dtype", ["int64", "bool"])
def test_an_integer_input_to_a_float_linear_is_refused_whatever_check(check: bool, dtype: str) -> None:
    """Before: check=False wrote a program the runtime refuses (0x12 in aten::linear.out),
    check=True raised torch's RuntimeError from inside the self-check."""
    x = torch.ones(2, 4, dtype=getattr(torch, dtype))
    with pytest.raises(XnnquantError) as info:
        xq.export(_seeded(nn.Linear(4, 3)).eval(), (x,), weights="fp32", check=check, progress=False)
    torch_name = {"int64": "Long", "bool": "Bool"}[dtype]
    assert str(info.value) == (
        f"the module's program cannot run on its example inputs: node linear (aten.linear.default, module <top "
        f"level>) raises RuntimeError: mat1 and mat2 must have the same dtype, but got {torch_name} and Float; it "
        f"reads example input(s) 'input' ({dtype} (2, 4)); expected inputs of the dtypes and values the module "
        "computes on (a float layer takes float32, token ids lie below the table's size)")
    report = xq.check(_seeded(nn.Linear(4, 3)).eval(), (x,), weights="fp32")
    assert not report.ok and report.refused[0] == str(info.value)


def test_a_node_that_reads_no_input_does_not_blame_the_inputs() -> None:
    """A lookup of the module's own out-of-range ids fails whatever the inputs: the error says so
    (it once asked for other example inputs)."""

    class Lookup(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.randn(3, 4))
            self.register_buffer("ids", torch.tensor([1, 5]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + nn.functional.embedding(self.ids, self.table).sum(0)

    with pytest.raises(XnnquantError) as info:
        xq.export(Lookup().eval(), (torch.randn(2, 4),), weights="fp32", progress=False)
    assert str(info.value) == (
        "the module's program cannot run: node embedding (aten.embedding.default, module <top level>) raises "
        "IndexError: index out of range in self; it reads no example input, only the module's own tensors: "
        "expected a module whose forward runs in torch (it does not with these parameters and buffers)")


def test_token_ids_outside_the_table_are_refused() -> None:
    """Before: torch's IndexError from the self-check."""
    with pytest.raises(XnnquantError, match=r"node embedding \(aten.embedding.default, module <top level>\) raises "
                                            r"IndexError: index out of range in self; it reads example input\(s\) "
                                            r"'input' \(int64 \(1, 2\)\)"):
        xq.export(_seeded(nn.Embedding(10, 4)).eval(), (torch.tensor([[1, 12]]),), weights="fp32", check=False,
                  progress=False)


def _odd_tensors() -> dict[str, Any]:
    dense = torch.randn(2, 4)
    return {"sparse": (dense.to_sparse(), "is a sparse_coo tensor: expected a dense one (x.to_dense())"),
            "meta": (dense.to("meta"), "is on the meta device, which holds no values: expected a tensor on the CPU"),
            "quantized": (torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8),
                          "is a quantized torch tensor (torch.qint8): expected its float values (x.dequantize())")}


@pytest.mark.parametrize("kind", ["sparse", "meta", "quantized"])
def test_tensors_without_dense_cpu_values_are_refused_everywhere(kind: str) -> None:
    """Before: TypeError (sparse), NotImplementedError (meta) from deep inside."""
    odd, message = _odd_tensors()[kind]
    linear = _seeded(nn.Linear(4, 3)).eval()
    x = torch.randn(2, 4)
    with pytest.raises(XnnquantError) as info:  # meta goes on (a module built on meta traces there): torch refuses
        xq.export(linear, (odd,), weights="fp32", progress=False)
    if kind != "meta":
        assert str(info.value) == f"example_inputs[0] {message}"
    with pytest.raises(XnnquantError) as info:
        xq.export(linear, (x,), weights="qc8w", calibration=[(x,), (odd,)], progress=False)
    assert str(info.value) == f"calibration batch 1, input 0 {message}"
    exported = xq.export(linear, (x,), weights="fp32", progress=False)
    for run in (exported.run, lambda t: graph_run(exported.to_bytes(), [t]),
                lambda t: run_method(exported.to_pte(), "forward", [t])):
        with pytest.raises(XnnquantError) as info:
            run(odd)
        assert str(info.value) == f"inputs[0] {message}"


# ------------------------------------------------------------------ planned memory


def test_a_dim_bound_past_32_bits_is_named_as_such() -> None:
    """Before: Dim(max=2**31) was said to have no upper bound."""
    with pytest.raises(XnnquantError, match=r"^input 'input' has a dynamic dim s\d+ with upper bound 2147483648: "
                                            r"ExecuTorch holds a size in 32 bits; expected a max of at most "
                                            r"2147483647 \(and one whose planned memory fits\)$"):
        xq.export(nn.Linear(4, 3).eval(), (torch.randn(2, 4),), weights="fp32", check=False, progress=False,
                  dynamic_shapes=({0: Dim("b", max=2**31)},))


def test_a_plan_larger_than_the_machine_is_refused_at_export_and_before_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``Dim(max=2**30)`` exported, and loading the program raised MemoryError
    (std::bad_alloc: 28 GiB planned).  The machine's memory is set to 1 MiB here: a bound
    of 2**16 rows plans (4 + 3) * 4 bytes a row, 1.75 MiB."""
    from xnnquant.pte import planned

    linear = nn.Linear(4, 3).eval()
    spec = ({0: Dim("b", max=2**16)},)
    exported = xq.export(linear, (torch.randn(2, 4),), weights="fp32", dynamic_shapes=spec, progress=False)
    monkeypatch.setattr(planned, "physical_memory", lambda: 2**20)
    with pytest.raises(XnnquantError) as info:
        xq.export(linear, (torch.randn(2, 4),), weights="fp32", dynamic_shapes=spec, progress=False)
    assert str(info.value) == (
        "the exported program: method 'forward' plans 0.00171 GiB (1835008 bytes) of memory, which the runtime "
        "allocates when it loads the method, and this machine has 0.000977 GiB; expected a plan that fits (its "
        "dynamic dims plan their memory at their upper bounds: b in [1, 65536]; lower their max); memory= checks "
        "against the target device's memory instead of this machine's")
    for load in (lambda: exported.run(torch.randn(3, 4)), lambda: run_method(exported.to_pte(), "forward",
                                                                                      [torch.randn(3, 4)])):
        with pytest.raises(XnnquantError, match=r"plans 0.00171 GiB \(1835\d+ bytes\) of memory, which the runtime "
                                                r"allocates when it loads the method, and this machine has 0.000977"):
            load()


#: ``Dim(max=2**30)`` rows of a Linear(4, 3): (4 + 3) * 4 bytes a row, 28 GiB planned.
PLAN_28_GIB = ({0: Dim("b", max=2**30)},)


def _export_28_gib(**kwargs: Any) -> Any:
    return xq.export(nn.Linear(4, 3).eval(), (torch.randn(2, 4),), weights="fp32", progress=False,
                     dynamic_shapes=PLAN_28_GIB, **kwargs)


@pytest.mark.parametrize("gib", [16, 64])
def test_without_memory_the_export_checks_this_machine_s_memory_and_says_so(gib: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a skip on machines of more than 28 GiB.  The answer depends on the exporting
    machine (here set: 16 or 64 GiB of physical memory), and both the error and the report
    say whose memory it was checked against."""
    from xnnquant.pte import planned

    monkeypatch.setattr(planned, "physical_memory", lambda: gib * 2**30)
    if gib < 28:
        with pytest.raises(XnnquantError) as info:
            _export_28_gib()
        assert str(info.value) == (
            "the exported program: method 'forward' plans 28 GiB (30064771072 bytes) of memory, which the runtime "
            "allocates when it loads the method, and this machine has 16 GiB; expected a plan that fits (its dynamic "
            "dims plan their memory at their upper bounds: b in [1, 1073741824]; lower their max); memory= checks "
            "against the target device's memory instead of this machine's")
        return
    exported = _export_28_gib()
    assert str(exported).splitlines()[-1] == ("planned memory: 'forward' 28 GiB; fits this machine's physical memory, "
                                              "64 GiB (memory= checks against the target's instead)")
    assert exported.summary["memory"] == {"planned_bytes": {"forward": 28 * 2**30}, "limit_bytes": 64 * 2**30,
                                          "checked_against": "this machine"}


@pytest.mark.parametrize("gib", [16, 64])
def test_memory_names_the_target_and_gives_one_answer_on_any_machine(gib: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The target's memory decides, whatever this machine has (16 or 64 GiB here): a 4 GB
    phone refuses the 28 GiB plan, a 64 GiB server takes it."""
    from xnnquant.pte import planned

    monkeypatch.setattr(planned, "physical_memory", lambda: gib * 2**30)
    with pytest.raises(XnnquantError) as info:
        _export_28_gib(memory="4GiB")
    assert str(info.value) == (
        "the exported program: method 'forward' plans 28 GiB (30064771072 bytes) of memory, which the runtime "
        "allocates when it loads the method, and the target has 4 GiB (memory=4294967296); expected a plan that fits "
        "(its dynamic dims plan their memory at their upper bounds: b in [1, 1073741824]; lower their max)")
    exported = _export_28_gib(memory=64 * 2**30)
    assert str(exported).splitlines()[-1] == "planned memory: 'forward' 28 GiB; fits the target's memory (memory=), 64 GiB"
    assert exported.summary["memory"]["checked_against"] == "memory="


class TokensDense(nn.Module):
    """Token ids -> embedding (portable kernels) -> linear (XNNPACK): a mixed program."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(100, 32)
        self.dense = nn.Linear(32, 16)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.dense(self.tokens(ids))


def test_a_mixed_program_s_self_check_loads_it_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mixed program's self-check runs it on ExecuTorch's runtime, which allocates its arenas
    here: with check=True it must fit this machine (set to 1 KiB) as well as memory=."""
    from xnnquant.pte import planned

    monkeypatch.setattr(planned, "physical_memory", lambda: 2**10)
    module, ids = _seeded(TokensDense()).eval(), torch.randint(0, 100, (1, 7))
    spec = ({1: Dim("seq", max=48)},)
    with pytest.raises(XnnquantError, match=r"^the exported program's self-check: method 'forward' plans .* and this "
                                            r"machine has 9.54e-07 GiB; expected a plan that fits \(its dynamic dims "
                                            r"plan their memory at their upper bounds: seq in \[1, 48\]; lower their "
                                            r"max\); the self-check loads the program on this machine: check=False "
                                            r"skips it$"):
        xq.export(module, (ids,), weights="fp32", progress=False, dynamic_shapes=spec, memory="1GiB")
    exported = xq.export(module, (ids,), weights="fp32", progress=False, dynamic_shapes=spec, memory="1GiB",
                         check=False)
    assert exported.mixed and exported.memory_check.target and exported.memory_check.limit == 2**30


@pytest.mark.parametrize(("memory", "got"), [("4 parsecs", "'4 parsecs'"), (0, "0"), (True, "True"), (-1, "-1"),
                                             ("0GiB", "'0GiB'")])
def test_memory_refuses_what_is_not_a_size(memory: Any, got: str) -> None:
    with pytest.raises(XnnquantError) as info:
        _export_28_gib(memory=memory)
    assert str(info.value) == (f"memory must be the memory of the device the program is for: got {got}, expected a "
                               "number of bytes > 0 or a string such as '4GiB' or '512 MB' (units: B, KB, MB, GB, TB, "
                               "KiB, MiB, GiB, TiB)")


# ------------------------------------------------------------------ one rule for options


def test_options_ignore_case_and_surrounding_spaces_everywhere() -> None:
    """Before: weights='QC8W' and embeddings='INT8' were taken, method='MSE' and
    activations='QINT8' refused."""
    from xnnquant.torchao import XnnquantConfig

    linear = _seeded(nn.Linear(32, 8)).eval()
    x = torch.randn(2, 32)
    reference = xq.export(linear, (x,), weights="qc8w", method="mse", progress=False).to_pte()
    spelled = xq.export(linear, (x,), weights=" QC8W", method="MSE ", target="1.4.1", fallback="AUTO", progress=False)
    assert spelled.method == "mse" and spelled.to_pte() == reference
    static = xq.export(linear, (x,), weights="qc8w", activations="QINT8", calibration=[(x,)], progress=False)
    assert static.activations == "qint8"
    assert xq.StaticInt8(ranges="MinMax").ranges == "minmax"
    config = XnnquantConfig(weights="QC8W", method="MinMax", activations="INT8_Dynamic")
    assert (config.method, config.activations) == ("minmax", "int8_dynamic")
    assert xq.quantize_per_channel(np.ones((2, 32), np.float32), bits=8, method="MINMAX").scale.shape == (2,)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(weights="qc4w", fallback=("fp32", "fp32")), "fallback names 'fp32' more than once: each scheme is tried "
                                                       "once, in order; expected each scheme once (got ('fp32', 'fp32'))"),
    (dict(weights="qc4w", fallback="qc8w, QC8W"), "fallback names 'qc8w' more than once: each scheme is tried once, "
                                                  "in order; expected each scheme once (got 'qc8w, QC8W')"),
    (dict(dynamic_shapes=[]), "dynamic_shapes=[] makes no dim dynamic: expected a torch.export.Dim for each dynamic "
                              "dim ({1: Dim('seq', max=512)} per input), or dynamic_shapes=None for a program of the "
                              "example inputs' shapes"),
    (dict(dynamic_shapes={}), "dynamic_shapes={} makes no dim dynamic: expected a torch.export.Dim for each dynamic "
                              "dim ({1: Dim('seq', max=512)} per input), or dynamic_shapes=None for a program of the "
                              "example inputs' shapes"),
    (dict(dynamic_shapes=({0: None},)), "dynamic_shapes=({0: None},) makes no dim dynamic: expected a "
                                        "torch.export.Dim for each dynamic dim ({1: Dim('seq', max=512)} per input), "
                                        "or dynamic_shapes=None for a program of the example inputs' shapes"),
    (dict(weights="fp32", method="gptq"), "method='gptq' chooses the scales of quantized weights from calibration "
                                          "activations, and weights='fp32' quantizes none (nor embeddings=) and takes "
                                          "no calibration: expected method='mse' (the default) with fp32 weights, or "
                                          "a quantized scheme"),
])
def test_malformed_or_contradictory_options_are_refused(kwargs: dict[str, Any], message: str) -> None:
    """Before: each was accepted silently."""
    with pytest.raises(XnnquantError) as info:
        xq.export(nn.Linear(4, 3).eval(), (torch.randn(2, 4),), progress=False, **kwargs)
    assert str(info.value) == message


def test_valid_options_that_do_nothing_here_warn() -> None:
    """A valid option without effect for this module or these weights warns, not refuses
    (one configuration may serve many modules and schemes)."""
    with pytest.warns(xq.OptionWarning) as caught:
        xq.export(nn.Linear(4, 3).eval(), (torch.randn(2, 4),), weights="fp32", embeddings="int8", progress=False)
    assert str(caught[0].message) == ("embeddings='int8' does nothing: the module looks up no constant table "
                                      "(aten.embedding); its program is what it would be without it")
    with pytest.warns(xq.OptionWarning) as caught:
        xq.export(nn.Linear(4, 3).eval(), (torch.randn(2, 4),), weights="fp32", method="MinMax", progress=False)
    assert str(caught[0].message) == ("method='minmax' does nothing: weights='fp32' and no embeddings= quantize "
                                      "nothing")
    assert caught[0].filename == __file__  # the caller's line, not the library's wrapper around export
    ids = torch.tensor([[1, 2]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", xq.OptionWarning)
        xq.export(_seeded(nn.Embedding(10, 4)).eval(), (ids,), weights="fp32", embeddings="int8", progress=False)
