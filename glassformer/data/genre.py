"""A real classification task from the installed plays: the First Folio genre of a speech.

The First Folio (1623) prints its plays in three groups, "Comedies, Histories, & Tragedies",
and a speech's label is the group its play belongs to. Whole plays are held out for testing
(three per genre), so a classifier must learn the genre's language, not the play's names.
Used by the BERT fine-tuning task (seed 000 §6.3, "BERT + a classification head").
"""

from __future__ import annotations

import functools
import re

from glassformer.data.corpus import shakespeare_plays, split_paragraphs

GENRES = ("comedy", "history", "tragedy")

# The Folio's own grouping, from its "Catalogue of the seuerall Comedies, Histories, and
# Tragedies contained in this Volume" (keys are the shakespeare package's folio file names).
# The catalogue lists 35 plays; Troilus and Cressida, printed late and left out of it, is not
# in the package either. Cymbeline is a tragedy there ("Cymbeline King of Britaine").
FOLIO_GENRES: dict[str, str] = {
    # Comedies
    "tempest": "comedy",
    "two_gentlemen_of_verona": "comedy",
    "merry_wives_of_windsor": "comedy",
    "measure_for_measure": "comedy",
    "comedy_of_errours": "comedy",
    "much_ado_about_nothing": "comedy",
    "loves_labour_lost": "comedy",
    "midsummer_nights_dreame": "comedy",
    "merchant_of_venice": "comedy",
    "as_you_like_it": "comedy",
    "taming_of_the_shrew": "comedy",
    "all_is_well_that_ends_well": "comedy",
    "twelfe-night": "comedy",
    "winters_tale": "comedy",
    # Histories
    "john": "history",
    "richard_ii": "history",
    "henry_iv_part_1": "history",
    "henry_iv_part_2": "history",
    "henry_v": "history",
    "henry_vi_part_1": "history",
    "henry_vi_part_2": "history",
    "henry_vi_part_3": "history",
    "richard_iii": "history",
    "henry_viii": "history",
    # Tragedies
    "coriolanus": "tragedy",
    "titus_andronicus": "tragedy",
    "romeo_and_juliet": "tragedy",
    "timon_of_athens": "tragedy",
    "julius_caesar": "tragedy",
    "macbeth": "tragedy",
    "hamlet": "tragedy",
    "lear": "tragedy",
    "othello": "tragedy",
    "anthonie_and_cleopatra": "tragedy",
    "cymbeline": "tragedy",
}

# Held out for testing: three whole plays per genre, fixed so every run scores the same set.
TEST_PLAYS = (
    "twelfe-night",
    "tempest",
    "much_ado_about_nothing",
    "richard_ii",
    "henry_v",
    "henry_vi_part_2",
    "macbeth",
    "othello",
    "julius_caesar",
)

# A speech opens with an indented speaker label ("  Macb. ", "   1. "); stage directions and
# act/scene headings are not indented. The label is dropped: it names characters, not genre.
_SPEAKER = re.compile(r"^[ \t]+[^\n.]{1,30}\.[ \t]*")
MIN_SPEECH_CHARS = 20


def speeches(text: str) -> list[str]:
    """The speeches of one folio play, speaker labels removed, very short ones dropped."""
    found = []
    for paragraph in split_paragraphs(text):
        match = _SPEAKER.match(paragraph)
        if match is None:
            continue
        speech = paragraph[match.end() :].strip()
        if len(speech) >= MIN_SPEECH_CHARS:
            found.append(speech)
    return found


Example = tuple[str, int, str]  # (speech, genre index, play)


@functools.lru_cache(maxsize=1)
def genre_split() -> tuple[tuple[Example, ...], tuple[Example, ...]]:
    """(train, test) examples (speech, genre index, play), split by whole plays."""
    plays = shakespeare_plays("folio")
    missing = sorted(set(FOLIO_GENRES) - set(plays))
    if missing:
        raise FileNotFoundError(f"folio plays {missing} are not installed: reinstall shakespeare")
    train, test = [], []
    for play, genre in FOLIO_GENRES.items():
        side = test if play in TEST_PLAYS else train
        side.extend((speech, GENRES.index(genre), play) for speech in speeches(plays[play]))
    return tuple(train), tuple(test)
