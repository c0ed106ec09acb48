"""``benchmarks/sentences.py``: real English sentences from the Python reference CPython ships,
the inputs of the retrieval tests and of ``benchmarks/embed.py``."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sentences  # noqa: E402


def test_sentences_are_deterministic_varied_prose():
    got = sentences.sentences(1024)
    assert got == sentences.sentences(1024)  # the same ones each time
    assert len(set(got)) == 1024
    lengths = [len(s.split()) for s in got]
    assert min(lengths) >= sentences.MIN_WORDS and max(lengths) <= sentences.MAX_WORDS
    assert max(lengths) >= 40 and min(lengths) <= 8  # short and long ones
    for s in got:
        assert s[-1] in ".!?" and "  " not in s, s
        assert not re.search(r"\[\d+\]|::=|>>>|\*\*\w+\*\*", s), s  # no markup left
    assert sentences.sentences(64) != list(sentences.all_sentences()[:64])  # spread out
    with pytest.raises(ValueError, match="pydoc_data.topics"):
        sentences.sentences(len(sentences.all_sentences()) + 1)
