"""Real English sentences from text every CPython ships: the Python language reference's topics
(``pydoc_data.topics``, the text ``help("assert")`` prints), cleaned of markup.

Used by the retrieval tests and ``benchmarks/embed.py`` as inputs for embedding models:
deterministic for a given CPython version, no download. Tests import it with ``benchmarks/``
on ``sys.path``, as they import the other benchmark modules.
"""

from __future__ import annotations

import functools
import re
import sys

#: Where the sentences come from, for test names and benchmark results.
SOURCE = (f"pydoc_data.topics (the Python {sys.version_info.major}.{sys.version_info.minor} "
          "language reference shipped with CPython)")

MIN_WORDS = 5
MAX_WORDS = 60

#: Paragraphs that are notes or version history rather than prose.
_SKIPPED_STARTS = ("Note:", "See also:", "Changed in version", "New in version",
                   "Added in version", "Deprecated since", "Footnotes", "Warning:")
#: Words ending in a full stop that do not end a sentence.
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "Mr.", "Dr.", "resp.", "approx.")
_HEADING_RULE = re.compile(r"^[*=\-~^\"']{3,}$")
_FOOTNOTE = re.compile(r"\[\d+\]")
#: ``*emphasis*`` and ``**strong**`` around words (not the operators of quoted code).
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([A-Za-z][^*\"]*?[A-Za-z])\*{1,2}(?![\w*])")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"(])")


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of one topic, each joined onto one line: headings, indented blocks
    (code, grammar rules, tables), notes and version remarks dropped."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = block.split("\n")
        if len(lines) > 1 and lines[1][:1].isspace() and not lines[0][:1].isspace():
            lines = lines[1:]  # a definition list: the term, then its indented definition
            lines[0] = lines[0].lstrip()
        if any(_HEADING_RULE.match(line.strip()) for line in lines):
            continue
        if lines[0][:1].isspace() or lines[0].startswith(("* ", "- ", "+")):
            continue
        joined = " ".join(line.strip() for line in lines)
        if joined.startswith(_SKIPPED_STARTS) or "::=" in joined or ">>>" in joined:
            continue
        out.append(joined)
    return out


def _clean(text: str) -> str:
    text = _FOOTNOTE.sub("", text)
    text = _EMPHASIS.sub(r"\1", text)
    return re.sub(r"\s+", " ", text).strip()


def _split(paragraph: str) -> list[str]:
    """Sentences of a paragraph (a full stop after an abbreviation does not end one)."""
    pieces = _SENTENCE_END.split(paragraph)
    out: list[str] = []
    for piece in pieces:
        if out and out[-1].endswith(_ABBREVIATIONS):
            out[-1] = f"{out[-1]} {piece}"
        else:
            out.append(piece)
    return out


def _is_prose(sentence: str) -> bool:
    """Ends like a sentence, of :data:`MIN_WORDS` to :data:`MAX_WORDS` words, most of them
    plain words (not code)."""
    words = sentence.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS or sentence[-1] not in ".!?":
        return False
    if not sentence[0].isupper() and sentence[0] != '"':
        return False
    plain = sum(1 for w in words if re.fullmatch(r"[A-Za-z][a-z'-]*[,.;:!?]?", w))
    return plain >= 0.7 * len(words)


@functools.cache
def all_sentences() -> tuple[str, ...]:
    """Every prose sentence of the topics, in the topics' name order, each once."""
    from pydoc_data.topics import topics

    seen: dict[str, None] = {}
    for name in sorted(topics):
        for paragraph in _paragraphs(topics[name]):
            for sentence in _split(_clean(paragraph)):
                if _is_prose(sentence):
                    seen.setdefault(sentence, None)
    return tuple(seen)


def sentences(n: int) -> list[str]:
    """``n`` sentences spread evenly over :func:`all_sentences` (so across all topics, of
    varied length), always the same ones for a given CPython version.

    Raises:
        ValueError: ``n`` is below 1 or above the number of sentences there are.
    """
    pool = all_sentences()
    if not 1 <= n <= len(pool):
        raise ValueError(f"asked for {n} sentences; {SOURCE} gives 1 to {len(pool)}")
    return [pool[i * len(pool) // n] for i in range(n)]


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    for line in sentences(count):
        print(line)
