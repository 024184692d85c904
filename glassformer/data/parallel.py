"""A parallel corpus from the installed plays: First Folio spelling -> modern spelling.

Seed 000 §6.1 (the encoder–decoder was made for translation): each play ships in both spellings,
so aligning the speeches of the two versions gives (folio, modern) pairs for a "translation"
task that is historical spelling normalization. Speeches are aligned in order by a monotonic
maximum-similarity alignment (Needleman–Wunsch without gap costs); pairs that do not look alike
(omitted, added or reordered passages) fall out. Long speeches are cut at shared words.
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from glassformer.data.corpus import shakespeare_plays

# Folio file name -> modern file name, where they differ; other plays share the name.
FOLIO_TO_MODERN = {
    "all_is_well_that_ends_well": "alls_well_that_ends_well",
    "anthonie_and_cleopatra": "antony_and_cleopatra",
    "comedy_of_errours": "comedy_of_errors",
    "loves_labour_lost": "loves_labours_lost",
    "midsummer_nights_dreame": "midsummer_nights_dream",
    "titus_andronicus": "tragedy_of_titus_andronicus",
    "twelfe-night": "twelfth_night",
}
# Modern plays the First Folio does not hold (so they have no pair): Pericles was left out of
# it and the package ships no Folio Troilus.
UNPAIRED_MODERN = ("pericles", "troilus_and_cressida")

DEFAULT_THRESHOLD = 0.5  # trigram cosine below this: not the same speech
DEFAULT_MAX_CHARS = 200


@dataclass(frozen=True)
class ParallelPair:
    folio: str
    modern: str
    play: str  # the modern file name, e.g. "twelfth_night"


# --- speeches ---------------------------------------------------------------------------------

# A Folio speech opens on an indented line "  Speaker. words"; the name may have two words
# ("Sir To.") and the words may be empty (the speech starts on the next line).
_FOLIO_SPEAKER = re.compile(r"^[ \t]+((?:[A-Z0-9][\w'&-]*\.? ){0,2}?[A-Z0-9][\w'&-]*)\.[ \t]*(.*)$")
_FOLIO_DIRECTION = re.compile(
    r"^(Enter|Exit|Exeunt|Manet|Flourish|Alarum|Alarums|Sennet|Trumpets|Musicke|Actus|Scena|"
    r"Scoena|Scaena|Scene|Finis|FINIS)\b"
)
# "MIRANDA." or "Ber.", or (A Midsummer Night's Dream) "THESEUS" in capitals without a period
_MODERN_SPEAKER = re.compile(r"^(?:[A-Z][A-Za-z0-9 '&.,-]{0,40}\.|[A-Z][A-Z0-9 '&-]{1,40})$")
_BRACKETS = re.compile(r"\[[^\]]*\]")


def _squash(text: str) -> str:
    return " ".join(text.split())


def folio_speeches(text: str) -> list[str]:
    """The speeches of a Folio play, speaker names and stage directions removed, whitespace
    collapsed. A speech runs from its speaker line to the next one (blank lines and stage
    directions inside it, e.g. "Enter the Ghost.", are skipped)."""
    speeches: list[list[str]] = []
    for line in text.split("\n"):
        match = _FOLIO_SPEAKER.match(line)
        if match:
            speeches.append([match.group(2)])
        elif speeches and line.strip() and not _FOLIO_DIRECTION.match(line):
            speeches[-1].append(line)
    return [s for s in (_squash(" ".join(lines)) for lines in speeches) if s]


def modern_speeches(text: str) -> list[str]:
    """The speeches of a modern-spelling play: paragraphs whose first line is a speaker name
    ("MIRANDA." or "Ber."); the name and [bracketed] stage directions are removed."""
    from glassformer.data.corpus import split_paragraphs

    speeches = []
    for paragraph in split_paragraphs(text):
        first, _, rest = paragraph.strip().partition("\n")
        if rest and _MODERN_SPEAKER.match(first.strip()):
            speech = _squash(_BRACKETS.sub(" ", rest))
            if speech:
                speeches.append(speech)
    return speeches


# --- similarity and alignment -----------------------------------------------------------------

_NOT_LETTER = re.compile(r"[^a-z ]+")
_SPELLING_FOLD = str.maketrans({"v": "u", "j": "i", "y": "i"})


def normalize(text: str) -> str:
    """Lowercase letters and single spaces, with the Folio's interchangeable letters folded
    (u/v, i/j/y), so 'vnfold' and 'unfold' compare equal."""
    return " ".join(_NOT_LETTER.sub(" ", text.lower()).translate(_SPELLING_FOLD).split())


@functools.lru_cache(maxsize=1 << 16)
def _normalize_word(word: str) -> str:
    return normalize(word)


_N_BUCKETS = 1024


@functools.lru_cache(maxsize=1 << 16)
def _bucket(trigram: str) -> int:
    return zlib.crc32(trigram.encode()) % _N_BUCKETS  # crc32, not hash(): the same every run


def _trigram_counts(text: str) -> Counter[str]:
    padded = f" {normalize(text)} "
    return Counter(map("".join, zip(padded, padded[1:], padded[2:], strict=False)))


def _trigram_vectors(texts: list[str]) -> np.ndarray:
    """Unit-length hashed character-trigram counts, one row per text (N, 1024)."""
    rows, buckets, counts = [], [], []
    for row, text in enumerate(texts):
        for trigram, count in _trigram_counts(text).items():
            rows.append(row)
            buckets.append(_bucket(trigram))
            counts.append(count)
    vectors = np.zeros((len(texts), _N_BUCKETS), dtype=np.float32)
    np.add.at(vectors, (np.array(rows, dtype=np.int64), np.array(buckets, dtype=np.int64)), counts)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


def similarity(a: str, b: str) -> float:
    """Cosine similarity of the two texts' normalized character-trigram counts, in [0, 1]."""
    ca, cb = _trigram_counts(a), _trigram_counts(b)
    dot = sum(count * cb[t] for t, count in ca.items() if t in cb)
    norms = math.sqrt(sum(c * c for c in ca.values()) * sum(c * c for c in cb.values()))
    return dot / norms if norms else 0.0


def align(similarities: np.ndarray, threshold: float) -> list[tuple[int, int]]:
    """The monotonic matching of rows to columns that maximizes the summed (similarity -
    threshold) over matched pairs: Needleman–Wunsch with free gaps, so a pair below the
    threshold is never matched and a skipped speech costs nothing.

    H[i, j] = max(H[i-1, j-1] + s[i-1, j-1], H[i-1, j], H[i, j-1]); a row is computed at once
    because its left-to-right term is a running maximum.
    """
    n, m = similarities.shape
    gain = similarities.astype(np.float64) - threshold
    score = np.zeros((n + 1, m + 1))
    for i in range(1, n + 1):
        best = np.maximum(score[i - 1, :-1] + gain[i - 1], score[i - 1, 1:])
        score[i, 1:] = np.maximum.accumulate(np.concatenate(([0.0], best)))[1:]
    pairs = []
    i, j = n, m
    while i > 0 and j > 0:
        if score[i, j] == score[i - 1, j]:
            i -= 1
        elif score[i, j] == score[i, j - 1]:
            j -= 1
        else:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    return pairs[::-1]


def align_speeches(
    folio: list[str], modern: list[str], threshold: float = DEFAULT_THRESHOLD
) -> list[tuple[int, int]]:
    """Index pairs (folio i, modern j) of aligned speeches, in order."""
    if not folio or not modern:
        return []
    sims = _trigram_vectors(folio) @ _trigram_vectors(modern).T  # (n_folio, n_modern)
    return align(sims, threshold)


# --- cutting long speeches --------------------------------------------------------------------


def split_long_pair(folio: str, modern: str, max_chars: int) -> list[tuple[str, str]]:
    """Cut a speech pair into pieces of at most max_chars per side, only between two words
    that match on both sides (difflib over normalized words), preferring cuts after modern
    punctuation. Pieces that cannot be cut short enough are dropped."""
    if len(folio) <= max_chars and len(modern) <= max_chars:
        return [(folio, modern)]
    fw, mw = folio.split(), modern.split()
    matcher = difflib.SequenceMatcher(
        None, [_normalize_word(w) for w in fw], [_normalize_word(w) for w in mw], autojunk=False
    )
    # A cut (i, j) sits after folio word i-1 and modern word j-1, inside a run of matches.
    cuts = [
        (block.a + k, block.b + k)
        for block in matcher.get_matching_blocks()
        for k in range(1, block.size)
    ]
    cuts.append((len(fw), len(mw)))
    cuts = sorted(set(cuts))
    f_ends, m_ends = _word_ends(fw), _word_ends(mw)
    pieces, start, k = [], (0, 0), 0  # cuts[k:] lie after start
    while k < len(cuts):
        fitting = []
        while k < len(cuts) and _fits(f_ends, m_ends, start, cuts[k], max_chars):
            fitting.append(cuts[k])
            k += 1
        if not fitting:  # the next stretch is too long to keep: drop it
            start, k = cuts[k], k + 1
            continue
        end = fitting[-1]
        if k < len(cuts):  # not at the end: prefer a cut after modern punctuation
            end = next((c for c in reversed(fitting) if mw[c[1] - 1][-1] in ",.;:!?"), end)
            k = cuts.index(end) + 1
        pieces.append((" ".join(fw[start[0] : end[0]]), " ".join(mw[start[1] : end[1]])))
        start = end
    return [(f, m) for f, m in pieces if f and m]


def _word_ends(words: list[str]) -> list[int]:
    """ends[i]: characters in words[:i] joined by single spaces, plus one (a trailing space)."""
    ends = [0]
    for word in words:
        ends.append(ends[-1] + len(word) + 1)
    return ends


def _fits(f_ends: list[int], m_ends: list[int], start, end, max_chars: int) -> bool:
    """Whether words start..end on both sides, joined by spaces, have at most max_chars."""
    return (
        f_ends[end[0]] - f_ends[start[0]] - 1 <= max_chars
        and m_ends[end[1]] - m_ends[start[1]] - 1 <= max_chars
    )


# --- the corpus -------------------------------------------------------------------------------


def play_pairs() -> list[tuple[str, str]]:
    """(folio name, modern name) of every play present in both spellings, sorted."""
    modern = shakespeare_plays("modern")
    pairs = []
    for folio_name in shakespeare_plays("folio"):
        modern_name = FOLIO_TO_MODERN.get(folio_name, folio_name)
        if modern_name not in modern:
            raise KeyError(f"Folio play {folio_name!r} has no modern counterpart {modern_name!r}")
        pairs.append((folio_name, modern_name))
    return pairs


def align_play(
    folio_text: str,
    modern_text: str,
    play: str,
    threshold: float = DEFAULT_THRESHOLD,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> list[ParallelPair]:
    """The aligned (folio, modern) pairs of one play, long speeches cut, each piece kept only
    if it still passes the similarity threshold."""
    folio, modern = folio_speeches(folio_text), modern_speeches(modern_text)
    pairs = []
    for i, j in align_speeches(folio, modern, threshold):
        for f, m in split_long_pair(folio[i], modern[j], max_chars):
            if similarity(f, m) >= threshold:
                pairs.append(ParallelPair(f, m, play))
    return pairs


@functools.lru_cache(maxsize=2)
def parallel_corpus(
    threshold: float = DEFAULT_THRESHOLD, max_chars: int = DEFAULT_MAX_CHARS
) -> tuple[ParallelPair, ...]:
    """Every aligned pair of every play in both spellings, plays in sorted modern-name order.
    Plays without a Folio text (UNPAIRED_MODERN) are skipped."""
    folio_plays, modern_plays = shakespeare_plays("folio"), shakespeare_plays("modern")
    pairs: list[ParallelPair] = []
    for folio_name, modern_name in sorted(play_pairs(), key=lambda p: p[1]):
        pairs += align_play(
            folio_plays[folio_name], modern_plays[modern_name], modern_name, threshold, max_chars
        )
    return pairs


# Whole plays held out (modern file names): one for validation loss during training, one for
# the final chrF/BLEU (train/translation.py, train/folio_eval.py). Every other paired play trains.
VALIDATION_PLAYS = ("twelfth_night",)
TEST_PLAYS = ("macbeth",)
SPLITS = ("train", "validation", "test")


def split_of(play: str) -> str:
    if play in VALIDATION_PLAYS:
        return "validation"
    return "test" if play in TEST_PLAYS else "train"


def _require_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known: pick one of {', '.join(SPLITS)}")


def in_split(pairs: Sequence[ParallelPair], split: str) -> list[ParallelPair]:
    """The pairs of one split: train, validation or test (whole plays)."""
    _require_split(split)
    return [pair for pair in pairs if split_of(pair.play) == split]


def corpus_split(
    split: str, threshold: float | None = None, max_chars: int | None = None
) -> list[ParallelPair]:
    """The aligned pairs of one split of the whole corpus (default alignment: DEFAULT_*)."""
    _require_split(split)  # before the alignment, which takes seconds
    return in_split(
        parallel_corpus(
            DEFAULT_THRESHOLD if threshold is None else threshold,
            DEFAULT_MAX_CHARS if max_chars is None else max_chars,
        ),
        split,
    )
