"""BERT's masked-language-model corruption (seed 000 §6.3, the cloze task).

Of the real tokens (never [CLS], [SEP], [PAD] or other special tokens) 15% are selected; of
those 80% become [MASK], 10% a random token and 10% stay as they are, so the model cannot tell
which visible tokens it will be asked about. Targets hold the original id at the selected
positions and -100 (ignored) everywhere else. A torch.Generator seeded from (seed, step) drives
every draw, so a batch is reproducible and a resumed run masks exactly as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from glassformer.data.batching import IGNORE_INDEX

MLM_PROBABILITY = 0.15
MASK_FRACTION = 0.8  # of the selected tokens: -> [MASK]
RANDOM_FRACTION = 0.1  # of the selected tokens: -> a random token (the rest stay unchanged)


def mlm_generator(seed: int, step: int) -> torch.Generator:
    """A generator that depends on both the run's seed and the step (or validation batch)."""
    # The CPU generator (mt19937) keeps only 32 bits of its seed, so seed * 2**32 + step would
    # ignore the seed: hash the pair down to 32 well-mixed bits instead.
    digest = hashlib.blake2b(f"mlm:{seed}:{step}".encode(), digest_size=4).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little"))


def mask_tokens(
    input_ids: Tensor,
    *,
    mask_token_id: int,
    special_ids: Sequence[int],
    vocab_size: int,
    generator: torch.Generator,
    mlm_probability: float = MLM_PROBABILITY,
    mask_fraction: float = MASK_FRACTION,
    random_fraction: float = RANDOM_FRACTION,
) -> tuple[Tensor, Tensor]:
    """(B, T) ids -> (corrupted ids, targets), both (B, T).

    Selection is an independent coin per real token (as in BERT and transformers' collator), so
    a batch has about, not exactly, 15% selected. Random replacements are drawn from the
    non-special vocabulary, so a [MASK] or [PAD] never appears where the model must read text.
    """
    if not 0.0 < mlm_probability <= 1.0:
        raise ValueError(f"mlm_probability={mlm_probability} must be in (0, 1], BERT uses 0.15")
    if mask_fraction < 0 or random_fraction < 0 or mask_fraction + random_fraction > 1:
        raise ValueError(
            f"mask_fraction={mask_fraction} and random_fraction={random_fraction} must be >= 0 "
            "and sum to at most 1 (BERT: 0.8 and 0.1; the rest stays unchanged)"
        )
    special = torch.tensor(sorted(set(special_ids)), dtype=torch.long)
    if mask_token_id not in special.tolist():
        raise ValueError(f"mask_token_id={mask_token_id} must be one of special_ids")
    maskable = ~torch.isin(input_ids, special)  # (B, T) real tokens only
    draws = torch.rand(input_ids.shape, generator=generator)  # (B, T)
    selected = maskable & (draws < mlm_probability)
    # A second uniform draw splits the selected tokens 80 / 10 / 10.
    how = torch.rand(input_ids.shape, generator=generator)  # (B, T)
    to_mask = selected & (how < mask_fraction)
    to_random = selected & (how >= mask_fraction) & (how < mask_fraction + random_fraction)
    ordinary = torch.ones(vocab_size, dtype=torch.bool)
    ordinary[special[special < vocab_size]] = False
    ordinary_ids = ordinary.nonzero().squeeze(1)  # (V - n_special,)
    picks = torch.randint(len(ordinary_ids), input_ids.shape, generator=generator)  # (B, T)

    corrupted = input_ids.clone()
    corrupted[to_mask] = mask_token_id
    corrupted[to_random] = ordinary_ids[picks[to_random]]
    targets = torch.full_like(input_ids, IGNORE_INDEX)
    targets[selected] = input_ids[selected]
    return corrupted, targets
