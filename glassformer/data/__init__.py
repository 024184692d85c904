"""Training data: corpora from installed packages, chunking to a context window, batching.

Seed 000 §2.4: text → tokens → truncate | sliding window | pack → LM examples → batches.
"""

from glassformer.data.batching import (
    CHUNKINGS,
    IGNORE_INDEX,
    LMExamples,
    batch_indices,
    get_batch,
    lm_targets,
    make_lm_examples,
    train_val_split,
)
from glassformer.data.chunking import (
    PAD_DOCUMENT_ID,
    PackedBlock,
    pack,
    sliding_windows,
    truncate,
    window_starts,
)
from glassformer.data.corpus import (
    POEMS,
    SPELLINGS,
    corpus_text,
    shakespeare_dir,
    shakespeare_plays,
    shakespeare_works,
    split_paragraphs,
)

__all__ = [
    "CHUNKINGS",
    "IGNORE_INDEX",
    "PAD_DOCUMENT_ID",
    "POEMS",
    "SPELLINGS",
    "LMExamples",
    "PackedBlock",
    "batch_indices",
    "corpus_text",
    "get_batch",
    "lm_targets",
    "make_lm_examples",
    "pack",
    "shakespeare_dir",
    "shakespeare_plays",
    "shakespeare_works",
    "sliding_windows",
    "split_paragraphs",
    "train_val_split",
    "truncate",
    "window_starts",
]
