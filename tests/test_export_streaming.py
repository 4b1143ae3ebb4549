"""Streaming export: a Llama-shaped decoder on the meta device, its weights in a safetensors file.

The oracle for the bytes is the in-memory export of the same decoder with its weights
loaded: the streamed ``.pte`` must be identical, for every weight scheme.  The fp32 one
must also compute what torch computes.  Bad files stop the export with an error naming
the tensor and leave no output file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import xnnquant as xq

torch = pytest.importorskip("torch")

from xnnquant.models.llama import LlamaConfig, decoder, random_tensors, write_random_safetensors  # noqa: E402

pytestmark = pytest.mark.xnnpack

CONFIG = LlamaConfig(hidden=64, intermediate=128, layers=2, heads=4, seq=8)
X = torch.from_numpy(np.random.default_rng(0).standard_normal((1, CONFIG.seq, CONFIG.hidden)).astype(np.float32))
META_X = torch.empty(1, CONFIG.seq, CONFIG.hidden, device="meta")


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_safetensors(tmp_path_factory.mktemp("llama") / "model.safetensors", CONFIG, seed=3)


def stream(path: Path, weights: str = "qb4w:32", method: str = "minmax") -> xq.export.Exported:  # type: ignore[name-defined]
    return xq.export(decoder(CONFIG), (META_X,), weights=weights, method=method, state_dict=path, progress=False)


@pytest.mark.parametrize(("weights", "method"), [("qb4w:32", "mse"), ("qc8w", "minmax"), ("fp32", "minmax")])
def test_streamed_pte_is_the_in_memory_pte(weights_file: Path, tmp_path: Path, weights: str, method: str) -> None:
    module = decoder(CONFIG, "cpu", seed=3)
    in_memory = xq.export(module, (X,), weights=weights, method=method, progress=False)
    streamed = stream(weights_file, weights, method)
    assert all(math.isnan(row.sqnr_db) for row in streamed.report)  # nothing read yet
    path = streamed.save(tmp_path / "streamed.pte")
    assert path.read_bytes() == in_memory.save(tmp_path / "in_memory.pte").read_bytes()
    assert [(r.path, r.nbytes, r.sqnr_db) for r in streamed.report] == \
        [(r.path, r.nbytes, r.sqnr_db) for r in in_memory.report]
    assert streamed.save(tmp_path / "streamed.xnn").read_bytes() == in_memory.to_bytes()
    if weights == "fp32":
        (out,) = in_memory.run(X)
        with torch.no_grad():
            expected = module(X).numpy()
        # float32 kernels of XNNPACK against torch's: a few ulps per op through two layers
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def rewrite(path: Path, change: dict[str, np.ndarray | None], out: Path) -> Path:
    """A copy of the file with tensors replaced (None: removed), through the safetensors package."""
    from safetensors.numpy import save_file

    tensors = dict(random_tensors(CONFIG, seed=3))
    for name, array in change.items():
        if array is None:
            del tensors[name]
        else:
            tensors[name] = array
    save_file(tensors, str(out))
    return out


def test_bad_files_name_the_tensor_and_leave_no_output(weights_file: Path, tmp_path: Path) -> None:
    q = "layers.1.self_attn.q_proj.weight"
    cases = {
        "missing": ({q: None}, rf"no tensor '{q}' in the file"),
        "shape": ({q: np.zeros((64, 32), np.float32)},
                  rf"tensor '{q}' has shape \(64, 32\), but the weight of 'layers.1.self_attn.q_proj' has "
                  r"shape \(64, 64\)"),
        "dtype": ({q: np.zeros((64, 64), np.int32)}, rf"tensor '{q}' is I32, but the weight of .* needs a "
                                                      r"floating-point tensor"),
        "norm": ({"norm.weight": np.zeros(3, np.float32)}, r"tensor 'norm.weight' has shape \(3,\)"),
    }
    for label, (change, message) in cases.items():
        path = rewrite(weights_file, change, tmp_path / f"{label}.safetensors")
        with pytest.raises(xq.XnnquantError, match=message):
            stream(path)
    nan = np.zeros((64, 64), np.float32)
    nan[1, 2] = np.nan
    for weights in ("qb4w:32", "fp32"):  # quantized or not, the file and the tensor are named when it is read
        exported = stream(rewrite(weights_file, {q: nan}, tmp_path / "nan.safetensors"), weights)
        with pytest.raises(xq.XnnquantError) as info:
            exported.save(tmp_path / "out.pte")
        assert str(info.value) == (
            f"{tmp_path / 'nan.safetensors'}: tensor '{q}' is not finite (NaN or inf, 1 value(s), first nan at flat "
            "index 66): a program computed from it would be too; expected finite values")
    inf_norm = np.ones(64, np.float32)
    inf_norm[5] = np.inf
    with pytest.raises(xq.XnnquantError) as info:  # a constant read while lowering: refused then, by name
        stream(rewrite(weights_file, {"norm.weight": inf_norm}, tmp_path / "inf.safetensors"))
    assert str(info.value).startswith("export refused 1 node(s) or layer(s):\n  - aten.mul.Tensor (node ")
    assert str(info.value).endswith(
        f", module norm): {tmp_path / 'inf.safetensors'}: tensor 'norm.weight' is not finite (NaN or inf, 1 value(s), "
        "first inf at flat index 5): a program computed from it would be too; expected finite values")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(weights_file.read_bytes()[:-100])
    with pytest.raises(xq.XnnquantError, match=r"tensor '.*': its data ends at byte \d+ of the data section, "
                                               r"which has only \d+ bytes \(the file is truncated\)"):
        stream(truncated)
    corrupt = tmp_path / "corrupt.safetensors"
    data = bytearray(weights_file.read_bytes())
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_length])
    header[q]["data_offsets"][1] += 4  # a header whose offsets overlap the next tensor's
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    corrupt.write_bytes(len(text).to_bytes(8, "little") + text + bytes(data[8 + header_length:]))
    with pytest.raises(xq.XnnquantError, match=rf"not a valid safetensors file \(.*\): tensor '{q}' ends at byte "
                                               r"\d+, tensor '.*' begins at byte \d+ of the data section \(an overlap\)"):
        stream(corrupt)
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".safetensors"] * 8  # no output, no temporary


def test_streaming_needs_target_141_and_no_calibration(weights_file: Path) -> None:
    with pytest.raises(xq.XnnquantError, match=r"got target 'xn01', expected '1\.4\.1'"):
        xq.export(decoder(CONFIG), (META_X,), state_dict=weights_file, target="xn01", progress=False)
    with pytest.raises(xq.XnnquantError, match=r"cannot calibrate: the module on the meta device cannot run"):
        xq.export(decoder(CONFIG), (META_X,), state_dict=weights_file, calibration=[(X,)], progress=False)
    with pytest.raises(xq.XnnquantError, match=r"on the meta device: its values are needed here \(pass state_dict="):
        xq.export(decoder(CONFIG), (META_X,), progress=False)


def test_cli_weights_from(weights_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                          capsys: pytest.CaptureFixture[str]) -> None:
    import sys
    import types

    from xnnquant.cli import main

    factory = types.ModuleType("llama_meta_factory")
    factory.make = lambda: (decoder(CONFIG), (META_X,))  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_meta_factory", factory)
    out = tmp_path / "cli.pte"
    main(["export", "llama_meta_factory:make", "-o", str(out), "--weights", "qb4w:32", "--method", "minmax",
          "--weights-from", str(weights_file), "--no-progress"])
    assert out.read_bytes() == stream(weights_file).save(tmp_path / "api.pte").read_bytes()
    assert "wrote" in capsys.readouterr().out


def test_the_read_ahead_thread_ends_with_its_weight_file(weights_file: Path) -> None:
    """The reader is a daemon thread (a process that ends does not wait for it) and stops
    once the WeightFile is gone, after reading what was asked."""
    import gc
    import threading

    from xnnquant.frontend.streaming import WeightFile

    before = set(threading.enumerate())
    f = WeightFile(weights_file)
    (reader,) = [t for t in set(threading.enumerate()) - before if t.name == "xnnquant-read-ahead"]
    assert reader.daemon
    del f
    gc.collect()
    reader.join(timeout=30)  # it reads this small file's warm start first
    assert not reader.is_alive()


class TokenModel(torch.nn.Module):
    """Token ids -> embedding (on the portable kernels: a mixed program) -> norm -> two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = torch.nn.Embedding(256, 64)
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(self.norm(self.tokens(ids)))))


def _token_model(tmp_path: Path) -> tuple[TokenModel, TokenModel, Path, torch.Tensor]:
    """The seeded token model, its tensors in a file, its twin on meta, and token ids."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    module = TokenModel().eval()
    path = tmp_path / "tokens.safetensors"
    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(path))
    with torch.device("meta"):
        meta = TokenModel().eval()
    return module, meta, path, torch.tensor([[3, 200, 17, 42, 9]])


@pytest.mark.parametrize("embeddings", [None, "int8"])
def test_a_mixed_program_streams_its_table_from_the_file(tmp_path: Path, embeddings: str | None) -> None:
    """A program with token ids: the embedding table the portable kernels read (as float32, or
    int8 codes and scales) is read from the weight file; the same bytes as the in-memory export."""
    module, meta, path, ids = _token_model(tmp_path)
    in_memory = xq.export(module, (ids,), weights="qb4w:32", embeddings=embeddings, progress=False)
    streamed = xq.export(meta, (ids,), weights="qb4w:32", embeddings=embeddings, state_dict=path, progress=False)
    assert streamed.mixed and streamed.self_check.startswith("skipped")
    saved = streamed.save(tmp_path / "streamed.pte").read_bytes()
    assert saved == in_memory.to_pte()
    assert len(saved) > (256 * 64 * 4 if embeddings is None else 256 * 64)  # the table is in it


def test_a_mixed_program_refuses_a_table_the_file_does_not_hold(tmp_path: Path) -> None:
    """A table the portable kernels read that the file does not hold (a non-persistent buffer):
    refused, naming it, and nothing written."""
    from safetensors.torch import save_file

    class TwoTables(TokenModel):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("extra", torch.zeros(256, 64), persistent=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) + torch.nn.functional.embedding(ids, self.extra)

    path = tmp_path / "two.safetensors"
    save_file({k: v.contiguous() for k, v in TwoTables().state_dict().items()}, str(path))
    with torch.device("meta"):
        meta = TwoTables().eval()
    with pytest.raises(xq.XnnquantError, match="extra"):
        xq.export(meta, (torch.tensor([[3, 2]]),), weights="qb4w:32", state_dict=path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["two.safetensors"]


def _hf_llama_on_meta(rotary_with_data: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """transformers' Llama (``hf_models.llama``) and the same architecture built on meta,
    its rotary embedding (non-persistent ``inv_freq`` buffers, absent from checkpoints) built
    on the CPU when ``rotary_with_data``, as transformers' own loading materializes it."""
    pytest.importorskip("transformers")
    import hf_models
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module, _ = hf_models.llama()
    config = module.model.config
    with torch.device("meta"):
        meta = hf_models._Logits(LlamaForCausalLM(config), "logits").eval()
    if rotary_with_data:
        meta.model.model.rotary_emb = LlamaRotaryEmbedding(config)
    return module, meta


@pytest.mark.parametrize("example_device", ["cpu", "meta"])
def test_transformers_llama_streams_with_its_rotary_buffers_in_memory(tmp_path: Path, example_device: str) -> None:
    """Parameters on meta, the rotary inv_freq buffers holding data: the rotary tables fold
    from the buffers on the CPU (the trace says device=meta for the positions and the copies),
    and the streamed .pte is the in-memory one byte for byte.  Refused before ('holds data
    of its own'); with the buffers on meta too, refused naming inv_freq (next test)."""
    from safetensors.torch import save_file

    module, meta = _hf_llama_on_meta(rotary_with_data=True)
    path = tmp_path / "llama.safetensors"
    save_file({k: v.contiguous().clone() for k, v in module.state_dict().items()}, str(path))
    assert not any("inv_freq" in name for name in module.state_dict())  # not in the file
    ids = torch.tensor([[5, 77, 3, 120, 64, 9, 31, 2, 88, 14, 60, 1]])
    in_memory = xq.export(module, (ids,), weights="qb4w:32", progress=False)
    example = ids if example_device == "cpu" else torch.empty(ids.shape, dtype=ids.dtype, device="meta")
    streamed = xq.export(meta, (example,), weights="qb4w:32", state_dict=path, progress=False)
    assert streamed.save(tmp_path / "streamed.pte").read_bytes() == in_memory.to_pte()


def test_transformers_llama_on_meta_alone_is_refused_naming_inv_freq(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    module, meta = _hf_llama_on_meta(rotary_with_data=False)
    path = tmp_path / "llama.safetensors"
    save_file({k: v.contiguous().clone() for k, v in module.state_dict().items()}, str(path))
    with pytest.raises(xq.XnnquantError) as info:
        xq.export(meta, (torch.tensor([[5, 77, 3]]),), weights="qb4w:32", state_dict=path, progress=False)
    message = str(info.value)
    assert "'model.model.rotary_emb.inv_freq' is on the meta device and" in message
    assert "does not hold it" in message and "outside torch.device('meta')" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama.safetensors"]


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5_encoder", "resnet"])
def test_transformers_architectures_stream_to_the_in_memory_bytes(tmp_path: Path, name: str) -> None:
    """Small transformers models built on meta, the example on the CPU, the checkpoint in a
    file: the same bytes as the in-memory export.  Their folds read small tensors the file
    holds: BERT's token type table and GPT-2's position table looked up at the example's
    positions, T5's relative attention bias (each refused on the old code, 'computed from them
    ahead of time'); ResNet's float example is traced on meta with the parameters (torch.export
    failed: two devices).  The buffers no checkpoint holds (BERT's position ids) are given the
    module's values, as a user builds their submodules outside meta."""
    pytest.importorskip("transformers")
    import hf_models
    from safetensors.torch import save_file

    build = hf_models.ARCHITECTURES[name]
    module, example = build()
    stored = module.state_dict()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous().clone() for k, v in stored.items()}, str(path))
    with torch.device("meta"):
        meta, _ = build()
    data = dict(module.named_buffers())
    for owner, sub in meta.named_modules():
        for buffer in [b for b, value in sub._buffers.items() if value is not None]:
            full = f"{owner}.{buffer}" if owner else buffer
            if full not in stored:
                sub._buffers[buffer] = data[full].clone()
    in_memory = xq.export(module, example, weights="qb4w:32", progress=False)
    streamed = xq.export(meta, example, weights="qb4w:32", state_dict=path, progress=False)
    written = streamed.save(tmp_path / "streamed.pte").read_bytes()
    assert written == (in_memory.to_pte() if in_memory.mixed else in_memory.save(tmp_path / "mem.pte").read_bytes())


def test_a_fold_reading_more_than_the_bound_from_the_file_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-2's position table looked up at the example's positions, with FOLD_READ_BYTES below
    the table's size: not read, so refused naming the table, nothing written."""
    pytest.importorskip("transformers")
    import hf_models
    from safetensors.torch import save_file

    from xnnquant.frontend.passes import constants

    module, example = hf_models.gpt2()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous().clone() for k, v in module.state_dict().items()}, str(path))
    with torch.device("meta"):
        meta, _ = hf_models.gpt2()
    table = module.model.transformer.wpe.weight
    monkeypatch.setattr(constants, "FOLD_READ_BYTES", table.numel() * table.element_size() - 1)
    with pytest.raises(xq.XnnquantError, match=r"computed from 'model\.transformer\.wpe\.weight'"):
        xq.export(meta, example, weights="qb4w:32", state_dict=path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]


def test_a_tied_output_layer_is_read_by_the_name_the_file_holds(tmp_path: Path) -> None:
    """transformers' Llama with its output layer tied to the token table (as Llama 3.2 1B):
    checkpoints hold the tensor once, as the token table, while torch.export names the output
    layer's weight 'model.lm_head.weight'.  Streamed, it is read by the file's name; the same
    bytes as in memory (refused on the old code: no tensor 'model.lm_head.weight' in the file)."""
    pytest.importorskip("transformers")
    import hf_models
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    module = hf_models._Logits(LlamaForCausalLM(config), "logits").eval()
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight
    path = tmp_path / "tied.safetensors"
    save_file({k: v.contiguous().clone() for k, v in module.state_dict().items() if k != "model.lm_head.weight"},
              str(path))
    with torch.device("meta"):
        meta = hf_models._Logits(LlamaForCausalLM(config), "logits").eval()
    meta.model.model.rotary_emb = LlamaRotaryEmbedding(config)
    ids = torch.tensor([[5, 77, 3, 120, 64, 9]])
    in_memory = xq.export(module, (ids,), weights="qb4w:32", progress=False)
    streamed = xq.export(meta, (ids,), weights="qb4w:32", state_dict=path, progress=False)
    assert streamed.save(tmp_path / "streamed.pte").read_bytes() == in_memory.to_pte()


def _sharded(tmp_path: Path, shards: int = 2) -> Path:
    """The decoder's tensors in ``shards`` files and a Hugging Face index naming each one's file
    (written by the safetensors package and json, as transformers' save_pretrained does)."""
    from safetensors.numpy import save_file

    tensors = dict(random_tensors(CONFIG, seed=3))
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(part, file))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


def test_a_sharded_checkpoint_streams_to_the_in_memory_bytes(tmp_path: Path) -> None:
    """state_dict= the index of a checkpoint in 3 files, each tensor read from its own: the
    in-memory export's bytes (refused on the old code: not a safetensors file)."""
    index = _sharded(tmp_path, shards=3)
    in_memory = xq.export(decoder(CONFIG, "cpu", seed=3), (X,), weights="qb4w:32", method="minmax", progress=False)
    assert stream(index).save(tmp_path / "out.xnn").read_bytes() == in_memory.to_bytes()


def test_a_bad_index_is_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    index = _sharded(tmp_path)
    content = json.loads(index.read_text())
    q = "layers.1.self_attn.q_proj.weight"
    wrong = next(f for f in set(content["weight_map"].values()) if f != content["weight_map"][q])
    cases = {
        "wrong file": ({**content, "weight_map": {**content["weight_map"], q: wrong}},
                       rf"tensor '{q}' is mapped to '{wrong}', which does not hold it"),
        "missing file": ({**content, "weight_map": {**content["weight_map"], q: "gone.safetensors"}},
                         r"cannot open safetensors file .*gone\.safetensors"),
        "no map": ({"metadata": {}}, r"expected a 'weight_map' of tensor name -> safetensors file name, got NoneType"),
        "empty map": ({"weight_map": {}}, r"safetensors file name, got an empty one"),
    }
    for label, (bad, message) in cases.items():
        path = tmp_path / f"{label.replace(' ', '_')}.index.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(xq.XnnquantError, match=message):
            stream(path).save(tmp_path / "out.pte")
        assert not (tmp_path / "out.pte").exists(), label
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(xq.XnnquantError, match=r"cannot read the checkpoint index .*broken\.json.*expected JSON"):
        stream(tmp_path / "broken.json")


@pytest.mark.parametrize("scheme", ["qc8w", "qc4w", "qb4w:32", "int8", "int4:32"])
@pytest.mark.parametrize("method", ["minmax", "mse"])
def test_quantizing_by_pieces_of_rows_changes_nothing(monkeypatch: pytest.MonkeyPatch, scheme: str,
                                                      method: str) -> None:
    """by_rows (a large streamed weight or table, a piece of rows at a time) against the whole
    tensor quantized at once: the same codes, scales and SQNR to the last bit, with pieces of
    24 rows over SQNR pieces of 8 (the defaults cut a 1 GB table into 128 MB pieces)."""
    from xnnquant.frontend import streaming, weight_sqnr, weights

    monkeypatch.setattr(weight_sqnr, "SQNR_PIECE", 96 * 8)
    monkeypatch.setattr(streaming, "PIECE_BYTES", 4 * 96 * 24)
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((1000, 96)) * rng.uniform(0.1, 3, (1000, 1))).astype(np.float32)
    w[17, 3] = 40.0  # an outlier in one row: its own scale only
    if scheme.startswith("int"):
        embedding = weights.EmbeddingScheme.parse(scheme)
        assert embedding is not None

        def quantize(x: np.ndarray) -> xq.QuantizedTensor:
            return embedding.quantize(x, method)
    else:
        layer = weights.WeightScheme.parse(scheme)

        def quantize(x: np.ndarray) -> xq.QuantizedTensor:
            return layer.quantize(x, method)
    reads: list[tuple[int, int]] = []

    def read(lo: int, hi: int) -> np.ndarray:
        reads.append((lo, hi))
        return w[lo:hi].copy()

    pieces, sqnr = streaming.by_rows(read, w.shape, quantize)
    whole = quantize(w)
    assert len(reads) == 42 and reads[1] == (24, 48)
    np.testing.assert_array_equal(pieces.codes, whole.codes)
    np.testing.assert_array_equal(pieces.scale, whole.scale)
    assert pieces.datatype == whole.datatype and pieces.group_size == whole.group_size
    assert sqnr == weight_sqnr.weight_sqnr(w, whole)
    assert pieces.to_bytes() == whole.to_bytes()


def test_a_table_and_tied_layer_streamed_by_pieces_give_the_in_memory_bytes(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The token model's int8 table and linears read by pieces of 16 rows: the .pte and the report
    (SQNR to the last bit) of the in-memory export."""
    from xnnquant.frontend import streaming, weight_sqnr

    monkeypatch.setattr(weight_sqnr, "SQNR_PIECE", 64 * 4)
    monkeypatch.setattr(streaming, "PIECE_BYTES", 4 * 64 * 16)
    module, meta, path, ids = _token_model(tmp_path)
    in_memory = xq.export(module, (ids,), weights="qb4w:32", embeddings="int8", progress=False)
    streamed = xq.export(meta, (ids,), weights="qb4w:32", embeddings="int8", state_dict=path, progress=False)
    assert streamed.save(tmp_path / "streamed.pte").read_bytes() == in_memory.to_pte()
    assert [(r.path, r.nbytes, r.sqnr_db) for r in streamed.report] == \
        [(r.path, r.nbytes, r.sqnr_db) for r in in_memory.report]


@pytest.mark.parametrize("shape", [(0, 8), (4, 0)])
def test_quantizing_an_empty_tensor_by_rows_is_the_schemes_error(shape: tuple[int, int]) -> None:
    from xnnquant.frontend import streaming, weights

    scheme = weights.WeightScheme.parse("qc8w")
    empty = np.zeros(shape, np.float32)
    with pytest.raises(xq.XnnquantError, match=r"w is empty: got shape \(\d, \d\)"):
        streaming.by_rows(lambda lo, hi: empty[lo:hi], shape, lambda w: scheme.quantize(w, "minmax"))


@pytest.mark.parametrize(("stored", "message"), [
    (np.zeros((63, 64), np.float32), r"tensor 'model\.transformer\.wpe\.weight' has shape \(63, 64\), but the "
                                     r"module's 'model\.transformer\.wpe\.weight' \(torch\.float32\) has shape "
                                     r"\(64, 64\)"),
    (np.zeros((64, 64), np.int32), r"tensor 'model\.transformer\.wpe\.weight' is I32, but the module's .* needs a "
                                   r"floating-point tensor"),
])
def test_a_table_read_for_a_fold_is_checked_against_the_module(tmp_path: Path, stored: np.ndarray,
                                                                message: str) -> None:
    """GPT-2's position table, read to be looked up at the example's positions, stored with
    another shape or as integers: refused by the file's checks, naming it (on the old code the
    refusal named only a folded value on meta), nothing written."""
    pytest.importorskip("transformers")
    import hf_models
    from safetensors.numpy import save_file

    module, example = hf_models.gpt2()
    tensors = {k: v.contiguous().numpy() for k, v in module.state_dict().items()}
    tensors["model.transformer.wpe.weight"] = stored
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    with torch.device("meta"):
        meta, _ = hf_models.gpt2()
    with pytest.raises(xq.XnnquantError, match=message):
        xq.export(meta, example, weights="qb4w:32", state_dict=path, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
