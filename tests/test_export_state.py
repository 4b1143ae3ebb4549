"""State in programs: ``xq.export`` of modules that update their own buffers (a KV cache).

The oracle is the eager module itself, called step by step on a copy: the ``.pte`` on
ExecuTorch's runtime, called with the same inputs in the same order (``Exported.session``,
one loaded program), must give the same outputs at every step.  The programs are float32:
XNNPACK's kernels sum in other orders than torch's, so values agree to float rounding
(``RTOL``: the few-ulp differences of short sums, far below any wrong update, which is off
by the values' size).  Integer state (a counter) must agree exactly.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import xnnquant as xq
from xnnquant.errors import UnsupportedConfigError, XnnquantError
from xnnquant.pte import read_pte

pytestmark = pytest.mark.xnnpack

#: relative to each output's largest magnitude: float32 rounding of sums of a few dozen terms
RTOL = 1e-5
CTX = 16
N = torch.export.Dim("n", min=1, max=8)


class Cache(torch.nn.Module):
    """Writes ``proj(x)`` at positions ``pos .. pos + n`` of its cache (``index_copy_``, as
    transformers' static cache does), and reads the whole cache back."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.out = torch.nn.Linear(4, 4)
        self.register_buffer("k", torch.zeros(1, CTX, 4))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1]) + pos
        self.k.index_copy_(1, positions, self.proj(x))
        return self.out(self.k.mean(1)) + x.sum(1)


class Patterns(torch.nn.Module):
    """Every other way a forward updates a buffer: a slice assignment at a position read
    from an input, an index assignment of values of another shape, an overwrite, an
    accumulation, an integer counter."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("buf", torch.linspace(-1, 1, CTX * 4).reshape(1, CTX, 4))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.kind == "slice":
            p = pos[0].item()
            torch._check_is_size(p)
            torch._check(p + x.shape[1] <= CTX)
            self.buf[:, p:p + x.shape[1]] = y
        elif self.kind == "index_put":
            self.buf[:, torch.arange(x.shape[1]) + pos] = y.reshape(x.shape[1], 4)
        elif self.kind == "copy":
            self.buf.copy_(y.mean(1, keepdim=True).expand(1, CTX, 4))
        elif self.kind == "accumulate":
            self.buf.add_(y.mean(1, keepdim=True))
        self.count += x.shape[1]
        return self.buf.sum(1) * 0.5 + self.count


STEPS = [(3, 0), (1, 3), (2, 4), (1, 6)]  # (tokens, position): a prefill, then decoding


def _inputs(module_seed: int, n: int, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(1, n, 4, generator=torch.Generator().manual_seed(module_seed * 100 + pos))
    return x, torch.tensor([pos])


def _step_by_step(module: torch.nn.Module, exported: xq.Exported, steps: list[tuple[int, int]]) -> None:
    eager = copy.deepcopy(module)
    session = exported.session()
    for n, pos in steps:
        x, p = _inputs(0, n, pos)
        with torch.no_grad():
            want = eager(x, p)
        (got,) = session.run(x, p)
        if want.dtype == torch.float32:
            np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=RTOL * float(want.abs().max()))
        else:
            np.testing.assert_array_equal(got, want.numpy())


def _export(module: torch.nn.Module) -> xq.Exported:
    x, p = _inputs(0, 3, 0)
    return xq.export(module, (x, p), weights="fp32", dynamic_shapes=({1: N}, None), progress=False)


def _kernels(exported: xq.Exported) -> list[str]:
    return read_pte(exported.to_pte()).operators


def test_a_cache_updated_in_place_answers_as_the_module_step_by_step() -> None:
    torch.manual_seed(0)
    module = Cache().eval()
    before = {name: (id(b), b.clone()) for name, b in module.named_buffers()}
    exported = _export(module)
    after = dict(module.named_buffers())
    assert all(id(after[name]) == ident and torch.equal(after[name], values)
               for name, (ident, values) in before.items()), "export changed the caller's buffers"
    assert exported.state == {"k": (1, CTX, 4)}
    kernels = _kernels(exported)
    assert "aten::index_put_" in kernels and "aten::copy_" not in kernels  # written in place, no copy
    _step_by_step(module, exported, STEPS)


def test_a_reset_session_and_a_fresh_load_start_from_the_exported_values() -> None:
    """The cache starts from values no runtime would make up (not zeros), written into the file:
    every new session, a reset one and ``run`` answer as the eager module on those values."""
    torch.manual_seed(0)
    module = Cache().eval()
    with torch.no_grad():
        module.k.copy_(torch.linspace(-3, 5, CTX * 4).reshape(1, CTX, 4))
    exported = _export(module)
    session = exported.session()
    x, p = _inputs(0, 3, 0)
    with torch.no_grad():
        want = copy.deepcopy(module)(x, p).numpy()
    (first,) = session.run(x, p)
    np.testing.assert_allclose(first, want, rtol=0, atol=RTOL * float(np.abs(want).max()))
    zeros = copy.deepcopy(module)
    with torch.no_grad():
        zeros.k.zero_()
        assert np.abs(zeros(x, p).numpy() - want).max() > 100 * RTOL * float(np.abs(want).max())  # it shows
    session.run(*_inputs(0, 2, 3))  # the cache now holds more than the first call wrote
    session.reset()
    (again,) = session.run(x, p)
    np.testing.assert_array_equal(again, first)
    (fresh,) = exported.session().run(x, p)
    np.testing.assert_array_equal(fresh, first)
    (ran,) = exported.run(x, p)  # run: a fresh load each call
    np.testing.assert_array_equal(ran, first)


@pytest.mark.parametrize("kind", ["slice", "index_put", "copy", "accumulate"])
def test_other_buffer_updates_answer_as_the_module_step_by_step(kind: str) -> None:
    torch.manual_seed(1)
    module = Patterns(kind).eval()
    exported = _export(module)
    assert set(exported.state) == {"buf", "count"}
    assert "aten::copy_" in _kernels(exported)  # these new values are copied into their state
    _step_by_step(module, exported, STEPS)


def test_a_position_past_the_cache_fails_the_call_and_the_session_goes_on() -> None:
    torch.manual_seed(0)
    module = Cache().eval()
    session = _export(module).session()
    x, _ = _inputs(0, 2, 0)
    with pytest.raises(XnnquantError, match="failed to run method 'forward'"):
        session.run(x, torch.tensor([CTX - 1]))  # positions 15 and 16 of 16
    session.reset()
    _step_by_step(module, _export(module), STEPS)


def test_a_program_with_state_cannot_be_one_xnnpack_graph() -> None:
    module = Cache().eval()
    x, p = _inputs(0, 3, 0)
    with pytest.raises(UnsupportedConfigError, match=r"strict=True asks for one pure XNNPACK graph, and the module "
                                                     r"updates its buffers \('k'\)"):
        xq.export(module, (x, p), weights="fp32", strict=True, progress=False)


def test_transformers_own_static_cache_wrapper_answers_as_transformers() -> None:
    """transformers' ``TorchExportableModuleWithStaticCache`` holds its cache in tensors that
    torch.export lifts as constants (reached through the cache object) and updates through
    an alias: they are state all the same, named by the buffers they are.  Its program,
    stepped, gives the logits of transformers' model on the whole sequence (``RTOL``)."""
    import transformers as tf
    from transformers.integrations.executorch import TorchExportableModuleWithStaticCache

    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=64)).eval()
    model.generation_config.cache_implementation = "static"
    wrapper = TorchExportableModuleWithStaticCache(model, batch_size=1, max_cache_len=16).eval()

    class Positional(torch.nn.Module):  # xq.export takes positional tensors
        def __init__(self) -> None:
            super().__init__()
            self.wrapper = wrapper

        def forward(self, ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
            return self.wrapper(input_ids=ids, cache_position=cache_position)

    n = torch.export.Dim("n", min=1, max=16)
    exported = xq.export(Positional().eval(), (torch.tensor([[5, 6]]), torch.tensor([0, 1])), weights="fp32",
                         dynamic_shapes=({1: n}, {0: n}), progress=False)
    assert set(exported.state) == {f"wrapper.{kind}_{i}" for kind in ("key_cache", "value_cache",
                                                                      "cumulative_length") for i in (0, 1)}
    ids = torch.randint(3, 96, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits[0].numpy()
    session = exported.session()
    (got,) = session.run(ids[:, :3], torch.arange(3))
    logits = [got[0, -1]]
    for i in range(3, 7):
        (got,) = session.run(ids[:, i:i + 1], torch.tensor([i]))
        logits.append(got[0, -1])
    np.testing.assert_allclose(np.stack(logits), want[2:], rtol=0, atol=RTOL * float(np.abs(want).max()))
