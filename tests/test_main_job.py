"""The main job (make run): its code paths on a one-layer MiniLM end to end, and the table format.

The job's own rows are judged against torch: ``run`` compares every program's sentence
embeddings with the float module's (eager torch, each sentence unpadded at its own length).
An fp32 program computes the same float32 sums in another order: over one layer of
384-wide sums the cosine stays within 1e-6 of 1 (measured 1 - cos = 7e-14 here), while a
row read at the wrong length, padding counted as tokens, or one sentence's output given to
another moves it by more than 1e-3.
"""

from __future__ import annotations

import pytest

from xnnquant.cli import main_job

pytest.importorskip("torch")


@pytest.mark.xnnpack
@pytest.mark.filterwarnings("ignore::xnnquant.schemes.calibration.CalibrationWarning")  # 32 sentences: few tokens for GPTQ
def test_rows_end_to_end_on_one_layer() -> None:
    from xnnquant.models import minilm_torch
    from xnnquant.models.sentences import calibration_sentences, evaluation_sentences

    module = minilm_torch.sentence_encoder(num_layers=1)
    sentences = evaluation_sentences()[:main_job.BATCH]  # 8 at batch 1, one batch of 8
    calibration = [minilm_torch.sentence_inputs(calibration_sentences()[i:i + 16]) for i in (0, 16)]
    schemes = [main_job.Scheme("fp32"), main_job.Scheme("qb4w:32", "gptq", calibrated=True),
               main_job.Scheme("qb4w:32", embeddings="int8")]
    fp32, gptq, tables = main_job.run(schemes=schemes, with_executorch=False, repeats=1, module=module,
                                      sentences=sentences, calibration=calibration)
    assert (fp32.flow, fp32.scheme, gptq.scheme) == ("xnnquant", "fp32", "qb4w:32 gptq, calibrated")
    # each sentence at its own length (batch 1) and padded with the mask (batch 8) gives the module's embedding
    assert fp32.cos_worst > 1 - 1e-6 and fp32.cos_worst_8 > 1 - 1e-6
    # one layer's int4 weights and int8 activations: measured 0.9984 mean, 0.9979 worst; a broken program < 0.9
    assert 0.99 < gptq.cos_worst <= gptq.cos_mean < 1 - 1e-4 and gptq.cos_worst_8 > 0.99
    assert fp32.delegates == gptq.delegates == (2, 2)
    # the fp32 word embedding table alone is 30522 x 384 float32 (46.9 MB); int4 layers shrink the rest
    assert fp32.pte_bytes > gptq.pte_bytes > 30522 * 384 * 4
    # int8 tables (ExecuTorch's quantized embedding kernels, registered in the timing process): 3 of 4 table bytes saved
    assert fp32.pte_bytes - tables.pte_bytes > 30522 * 384 * 3 and tables.cos_worst_8 > 0.99
    for row in (fp32, gptq, tables):
        assert row.ms_per_sentence_1 > 0 and row.ms_per_sentence_8 > 0 and row.cpu_ms > 0 and row.export_s > 0


def test_table_format() -> None:
    rows = [main_job.Row("xnnquant", "fp32", 90_320_000, 1.234, 5.678, 2.345, 9.876, (2, 2), 1.0, 0.99999, 0.99998),
            main_job.Row("ExecuTorch", "int4 g32 (torchao)", 53_880_000, 158.4, 2.24, 1.5, 13.456, (52, 58), 0.9625,
                         0.9327, 0.9311)]
    assert main_job.format_rows(rows).splitlines() == [
        "| flow | scheme | .pte size | export time | ms/sentence batch 1 | ms/sentence batch 8 | CPU 1 thread "
        "| delegates | cos mean | cos worst | cos worst batch 8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        "| xnnquant | fp32 | 90.32 MB | 1.23 s | 5.68 | 2.35 | 9.88 ms | 2 | 1.0000 | 1.0000 | 1.0000 |",
        "| ExecuTorch | int4 g32 (torchao) | 53.88 MB | 158.40 s | 2.24 | 1.50 | 13.46 ms | 52 / 58 | 0.9625 "
        "| 0.9327 | 0.9311 |"]


def test_scheme_labels_and_file_names() -> None:
    labels = [str(s) for s in main_job.SCHEMES]
    assert labels == ["fp32", "qb4w:32 mse", "qb4w:32 gptq, calibrated", "qb4w:32 mse, int8 embeddings"]
    assert [main_job.file_name("xnnquant", label, batch) for label in labels[2:] for batch in (1, 8)] == [
        "xnnquant-qb4w_32-gptq-calibrated-b1.pte", "xnnquant-qb4w_32-gptq-calibrated-b8.pte",
        "xnnquant-qb4w_32-mse-int8-embeddings-b1.pte", "xnnquant-qb4w_32-mse-int8-embeddings-b8.pte"]
    assert main_job.file_name("ExecuTorch", "int4 g32 (torchao)") == "executorch-int4-g32-torchao-b1.pte"


def test_workload_names_and_padding() -> None:
    from xnnquant.models.sentences import evaluation_sentences

    sentences = evaluation_sentences()[:2 * main_job.BATCH + 3]
    inputs = main_job.workload(sentences)
    assert list(inputs) == [f"1.{i}" for i in range(19)] + ["8.0", "8.1"]  # the last 3 make no batch
    for i in range(19):
        ids, mask = inputs[f"1.{i}"]
        assert ids.shape == mask.shape and ids.shape[0] == 1 and mask.all()  # own length: no padding
    ids, mask = inputs["8.1"]
    assert ids.shape == (8, max(inputs[f"1.{i}"][0].shape[1] for i in range(8, 16)))
    assert mask.sum(axis=1).tolist() == [inputs[f"1.{i}"][0].shape[1] for i in range(8, 16)]
