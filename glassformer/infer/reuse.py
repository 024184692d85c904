"""How a new row of the Engine reuses keys/values a slot already holds (seed 000 §2.5.1: the
KV cache): a conversation's next turn continues its parked row in that slot (add's continues=),
and a prompt that begins like another row's tokens copies the keys/values they share into its
own slot (add's prefix_from=: a shared system prompt, a few-shot header), since a position's
keys depend only on the tokens up to it. Either way only the rest of the prompt is prefilled.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from glassformer.infer.prefill import Pending
from glassformer.infer.rows import Row, common_prefix_length


@dataclass
class SavedPrefix:
    """Keys/values of `tokens`, position by position, out of any slot (Engine.save_prefix):
    a row that gave up its slot, kept for later prompts that begin like it (add's
    prefix_saved=)."""

    tokens: list[int]
    tensors: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


class Reuse:
    """The Engine's prefix reuse: continues=, prefix_from= and prefix_saved= of add, over its
    rows and slots (rows, pending, n_held, cache; _swap, _place, _take_slot)."""

    rows: list[Row]
    pending: list[Pending]

    def _resume(self, row: Row, parked: Row) -> int:
        """Hand a parked row's slot to the row continuing it; returns how many of its prompt's
        positions the slot already holds: the longest prefix the two share (a chat template
        may render the last reply in other tokens than were sampled), always leaving one
        token to prefill. A ring or recurrent cache cannot forget its newest positions, so
        it keeps them only when the prompt continues all of them."""
        if parked not in self.rows[self.n_held :]:
            raise ValueError(
                "continues= must be a finished row added with keep_cache=True whose slot is "
                "still parked: add the whole conversation as a new row instead"
            )
        held = parked.context[: parked.length]
        shared = min(common_prefix_length(held, row.prompt), len(row.prompt) - 1)
        if shared < len(held) and not self.cache.rewinds:
            shared = 0
        if len(row.prompt) > self.cache.max_seq_len:
            raise ValueError(
                f"the prompt has {len(row.prompt)} tokens but a row slot holds "
                f"{self.cache.max_seq_len} positions: shorten the prompt"
            )
        self._swap(parked.slot, self.n_held)  # the first parked slot, behind the pending rows
        self._place(row, self.n_held)
        parked.slot = -1
        return shared

    def save_prefix(self, row: Row) -> SavedPrefix | None:
        """What the row's slot holds (held_tokens and their keys/values), copied out of it;
        None where keys/values cannot be shared (shares_prefixes) or the slot holds none."""
        tokens = self.held_tokens(row)
        if not self.shares_prefixes or not tokens:
            return None
        return SavedPrefix(tokens, self.cache.save_positions(row.slot, len(tokens)))

    @property
    def shares_prefixes(self) -> bool:
        """Whether a row's keys/values can be copied into another's slot (add's prefix_from):
        caches where position p lives in slot p (not a ring, not a recurrent state)."""
        return (
            self.cache is not None and self.cache.rewinds and hasattr(self.cache, "copy_positions")
        )

    def held_tokens(self, row: Row) -> list[int]:
        """The tokens whose keys/values the row's slot holds, position by position: a pending
        row's prompt as far as its prefill got, a live or parked row's context but the last
        token (sampled, not yet run); nothing for a row without a slot."""
        if row.slot < 0 or row not in self.rows:
            return []
        for waiting in self.pending:
            if waiting.row is row:
                return row.prompt[: waiting.done]
        return row.context[: row.length]

    def _copy_prefix(self, row: Row, source: Row | SavedPrefix) -> int:
        """Give a new row a slot holding the keys/values it shares with `source`: a row
        (copied from its slot) or a SavedPrefix (add's prefix_saved=); returns how many
        positions: the longest common prefix of the prompt and what the source holds, always
        leaving one token to prefill."""
        saved = isinstance(source, SavedPrefix)
        name = "prefix_saved=" if saved else "prefix_from="
        if not self.shares_prefixes:
            raise ValueError(
                f"{name} needs a cache that holds position p in slot p; "
                f"{type(self.cache).__name__} does not: add the prompt without it"
            )
        if not saved and source.slot < 0:
            raise ValueError("prefix_from= must be a row that holds a slot (running or parked)")
        held = source.tokens if saved else self.held_tokens(source)
        self._take_slot(row, len(row.prompt) + row.params.max_new_tokens)
        shared = min(common_prefix_length(held, row.prompt), len(row.prompt) - 1)
        if shared > 0 and saved:
            self.cache.load_positions(source.tensors, row.slot, shared)
        elif shared > 0:  # _take_slot may have moved the source: read its slot now
            self.cache.copy_positions(source.slot, row.slot, shared)
        return shared
