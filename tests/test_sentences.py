"""The project's calibration and evaluation sentences: sizes, variety, and kept apart."""

from __future__ import annotations

import re

from xnnquant.models import minilm
from xnnquant.models.sentences import calibration_sentences, evaluation_sentences


def _key(sentence: str) -> str:
    """Case, spacing and punctuation folded, so near-copies count as the same sentence."""
    return re.sub(r"[^a-z0-9]+", " ", sentence.lower()).strip()


def test_sizes_and_no_duplicates() -> None:
    cal, ev = calibration_sentences(), evaluation_sentences()
    assert len(cal) >= 400 and len(ev) >= 100
    for sentences in (cal, ev):
        assert all(s == s.strip() and s for s in sentences)
        assert len({_key(s) for s in sentences}) == len(sentences)


def test_calibration_evaluation_and_samples_are_disjoint() -> None:
    cal = {_key(s) for s in calibration_sentences()}
    ev = {_key(s) for s in evaluation_sentences()}
    samples = {_key(s) for s in minilm.SAMPLE_SENTENCES}
    assert not cal & ev
    assert not cal & samples
    assert not ev & samples


def test_calibration_set_varies_in_length_punctuation_and_numbers() -> None:
    cal = calibration_sentences()
    lengths = [len(minilm.tokenize(s)) for s in cal]  # with [CLS] and [SEP]
    assert min(lengths) <= 4 and max(lengths) >= 40
    assert sum(lengths) > 7000  # enough tokens for the 1536-wide FFN input (Calibration's warning bar)
    for mark in ("?", "!", ";", ":", '"', "(", "%", "-"):
        assert sum(mark in s for s in cal) >= 5, mark
    assert sum(bool(re.search(r"\d", s)) for s in cal) >= 80
