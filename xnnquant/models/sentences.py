"""English sentences the project owns, for calibration and for held-out evaluation.

Both sets were written for xnnquant (no outside source; the project's Apache-2.0 licence
applies) and are kept apart: no sentence of one is in the other or in
``minilm.SAMPLE_SENTENCES`` (a test checks it).  One sentence per line, UTF-8:

===============================  =========  =========================================
file (``xnnquant/models/text/``)  sentences  use
===============================  =========  =========================================
``calibration.txt``              509        activation statistics for ``Calibration``
                                            (7,622 MiniLM tokens with [CLS]/[SEP])
``evaluation.txt``               116        held-out text to measure what calibration
                                            buys (1,652 tokens)
===============================  =========  =========================================

They vary in topic (science, cooking, travel, finance, sport, law, software, everyday
talk), length (one word to 48 tokens), form (statements, questions, instructions,
exclamations, lists, quotations) and content (numbers, dates, units, prices, code and
error messages).
"""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def _read(name: str) -> tuple[str, ...]:
    text = resources.files(__package__).joinpath("text").joinpath(name).read_text(encoding="utf-8")
    return tuple(line for line in text.split("\n") if line)


def calibration_sentences() -> tuple[str, ...]:
    """The 509 calibration sentences, in file order."""
    return _read("calibration.txt")


def evaluation_sentences() -> tuple[str, ...]:
    """The 116 held-out evaluation sentences, in file order (disjoint from calibration)."""
    return _read("evaluation.txt")
