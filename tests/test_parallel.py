"""The Folio -> modern parallel corpus: speech splitting, the monotonic alignment, long-pair
cutting, and the real corpus built from the installed plays."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from glassformer.data import shakespeare_plays
from glassformer.data.parallel import (
    DEFAULT_THRESHOLD,
    UNPAIRED_MODERN,
    align,
    align_play,
    folio_speeches,
    modern_speeches,
    normalize,
    play_pairs,
    similarity,
    split_long_pair,
)

FOLIO = """The Tragedie of Toy

Actus Primus. Scoena Prima.

Enter Barnardo and Francisco.

  Barnardo. Who's there?
  Fran. Nay answer me: Stand & vnfold
your selfe

   Bar. Long liue the King

   Fran. You come most carefully vpon your houre
Enter Horatio.

   Sir To. Giue me thy hand, good Marcellus, I loue thee well

   Hor. Heere is a speech the moderne text hath cut away entirely

   Bar. Haue you had quiet Guard?
  Fran. Not a Mouse stirring

Exeunt.
"""

MODERN = """TOY

ACT I.

[Enter Bernardo and Francisco.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

Fran.
You come most carefully upon your hour.

[Enter Horatio.]

SIR TOBY.
Give me thy hand, good Marcellus; I love thee well.

Mar.
Quite another line that an editor added here, found in no folio.

Ber.
Have you had quiet guard?

Fran.
Not a mouse stirring.
"""


def test_speeches_drop_names_and_stage_directions():
    assert folio_speeches(FOLIO) == [
        "Who's there?",
        "Nay answer me: Stand & vnfold your selfe",
        "Long liue the King",
        "You come most carefully vpon your houre",
        "Giue me thy hand, good Marcellus, I loue thee well",
        "Heere is a speech the moderne text hath cut away entirely",
        "Haue you had quiet Guard?",
        "Not a Mouse stirring",
    ]
    speeches = modern_speeches(MODERN)
    assert speeches[0] == "Who's there?"
    assert speeches[4] == "Give me thy hand, good Marcellus; I love thee well."
    assert len(speeches) == 8  # the two-line stage directions and titles are not speeches


def test_alignment_skips_omitted_and_inserted_speeches():
    pairs = align_play(FOLIO, MODERN, "toy")
    got = [(p.folio, p.modern) for p in pairs]
    assert got == [
        ("Who's there?", "Who's there?"),
        ("Nay answer me: Stand & vnfold your selfe", "Nay, answer me: stand, and unfold yourself."),
        ("Long liue the King", "Long live the king!"),
        ("You come most carefully vpon your houre", "You come most carefully upon your hour."),
        (
            "Giue me thy hand, good Marcellus, I loue thee well",
            "Give me thy hand, good Marcellus; I love thee well.",
        ),
        ("Haue you had quiet Guard?", "Have you had quiet guard?"),
        ("Not a Mouse stirring", "Not a mouse stirring."),
    ]
    assert {p.play for p in pairs} == {"toy"}


def _brute_force_best(sims: np.ndarray, threshold: float) -> float:
    """The best total (sim - threshold) over every monotonic matching, by enumeration."""
    n, m = sims.shape
    best = 0.0
    for k in range(1, min(n, m) + 1):
        for rows in itertools.combinations(range(n), k):
            for cols in itertools.combinations(range(m), k):
                total = sum(sims[r, c] - threshold for r, c in zip(rows, cols, strict=True))
                best = max(best, total)
    return best


@pytest.mark.parametrize("seed", range(5))
def test_align_is_the_best_monotonic_matching(seed):
    rng = np.random.default_rng(seed)
    sims = rng.random((4, 5))
    pairs = align(sims, threshold=0.5)
    rows, cols = [i for i, _ in pairs], [j for _, j in pairs]
    assert rows == sorted(set(rows)) and cols == sorted(set(cols))  # monotonic, one-to-one
    total = sum(sims[i, j] - 0.5 for i, j in pairs)
    assert total == pytest.approx(_brute_force_best(sims, 0.5))
    assert all(sims[i, j] > 0.5 for i, j in pairs)


def test_similarity_folds_folio_letters():
    assert normalize("Vnfold, IVSTICE!") == "unfold iustice"
    assert similarity("Long liue the King", "Long live the king!") == pytest.approx(1.0)
    assert similarity("Who's there?", "Exeunt omnes") < DEFAULT_THRESHOLD


def test_long_pairs_are_cut_at_shared_words():
    rng = random.Random(0)
    words = ["loue", "haue", "giue", "thee", "King", "vpon", "heauen", "sweet", "night,"]
    folio_words = [rng.choice(words) for _ in range(80)]
    modern_words = [w.replace("u", "v").replace("vp", "up") for w in folio_words]
    folio, modern = " ".join(folio_words), " ".join(modern_words)
    pieces = split_long_pair(folio, modern, max_chars=60)
    assert len(pieces) > 5
    assert all(0 < len(f) <= 60 and 0 < len(m) <= 60 for f, m in pieces)
    # pieces are consecutive stretches of both sides (nothing reordered or invented)
    assert " ".join(f for f, _ in pieces) in folio
    assert " ".join(m for _, m in pieces) in modern
    assert all(len(f.split()) == len(m.split()) for f, m in pieces)  # word-for-word here
    assert split_long_pair("short", "short.", max_chars=60) == [("short", "short.")]


def test_every_folio_play_has_a_modern_counterpart():
    pairs = play_pairs()
    assert len(pairs) == len(shakespeare_plays("folio")) == 35
    assert ("twelfe-night", "twelfth_night") in pairs
    paired_modern = {modern for _, modern in pairs}
    assert set(shakespeare_plays("modern")) - paired_modern == set(UNPAIRED_MODERN)


@pytest.mark.slow
def test_real_plays_give_many_plausible_pairs_deterministically():
    folio, modern = shakespeare_plays("folio"), shakespeare_plays("modern")
    # hamlet; the renamed twelfth night; the dream, whose speaker names have no period
    plays = [("hamlet", "hamlet"), ("twelfe-night", "twelfth_night")]
    plays.append(("midsummer_nights_dreame", "midsummer_nights_dream"))
    for folio_name, modern_name in plays:
        pairs = align_play(folio[folio_name], modern[modern_name], modern_name)
        assert len(pairs) > 600, modern_name  # of roughly 1,000 speeches per play
        for pair in random.Random(0).sample(pairs, 100):
            assert pair.folio and pair.modern and pair.play == modern_name
            assert len(pair.folio) <= 200 and len(pair.modern) <= 200
            assert similarity(pair.folio, pair.modern) >= DEFAULT_THRESHOLD
    hamlet = align_play(folio["hamlet"], modern["hamlet"], "hamlet")
    assert (hamlet[2].folio, hamlet[2].modern) == ("Long liue the King", "Long live the king!")
    assert align_play(folio["hamlet"], modern["hamlet"], "hamlet") == hamlet
