"""The server's prefix cache (vLLM's automatic prefix caching, llama.cpp's slot prompt cache):
which row's keys/values a new prompt reuses, and the parked rows kept for that.

Every row the engine holds, running, still prefilling or parked after it finished, is a source.
A prompt that extends a parked row's prompt (a chat's next turn re-renders the history, then
adds a message) continues that row in its slot; one that only begins like a row's tokens (the
same system prompt or few-shot header, another conversation) gets a copy of the keys/values
they share in its own slot (Engine.add's prefix_from), at least `min_shared` tokens. A prompt
that shares `min_wait` tokens or more with one not yet prefilled that far waits for it, so
prompts sent together prefill their common head once. Parked rows form an LRU bounded in slots
and in bytes of keys/values; continuing or copying from a row makes it the most recently used.
A parked row evicted from its slot leaves its keys/values in the prompt store, a second LRU in
bytes outside the slots (llama-server's --cache-ram): a later prompt that begins like one of
them copies what they share into its own slot, as from a row.

Rows share only within one cache_salt (vLLM's): a prefix hit is faster, so without a salt a
client could time whether another had sent a prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from glassformer.infer.engine import Engine, Row
from glassformer.infer.prefill import MIN_SHARED_PREFIX
from glassformer.infer.reuse import SavedPrefix
from glassformer.infer.rows import common_prefix_length

# A prompt waits for a row being prefilled when it shares at least this much with it: enough
# prompt tokens that their prefill is compute-bound (a forward reads the weights once for any
# number of tokens, so waiting to share a few would cost a turn and save little).
MIN_WAIT_FOR_PREFIX = 64


class PrefixCache:
    """The parked rows of one engine and where each new prompt's keys/values come from.

    max_bytes: keys/values the parked rows may hold; max_parked: slots they may hold;
    min_shared: the fewest tokens copied from another row (0: only a conversation's next turn
    reuses its own row); the wait threshold scales with it (MIN_WAIT_FOR_PREFIX at 16);
    store_bytes: keys/values the prompt store may hold (0: none).
    """

    def __init__(
        self, engine: Engine, max_bytes: int, max_parked: int, min_shared: int, store_bytes: int = 0
    ) -> None:
        self.engine, self.max_bytes, self.max_parked = engine, max_bytes, max_parked
        self.min_shared, self.store_bytes = min_shared, store_bytes
        self.min_wait = MIN_WAIT_FOR_PREFIX * min_shared // MIN_SHARED_PREFIX
        self.parked: OrderedDict[int, Row] = OrderedDict()  # id(row) -> row, least recent first
        self.salts: dict[int, str | None] = {}  # id(row) -> its request's cache_salt
        # id(saved) -> (saved, its row's cache_salt), least recent first; and their bytes,
        # kept as they change (the gauges ask after every engine step)
        self.stored: OrderedDict[int, tuple[SavedPrefix, str | None]] = OrderedDict()
        self.stored_bytes = 0

    @property
    def copies(self) -> bool:
        """Whether prompts copy keys/values from other rows here."""
        return bool(self.min_shared) and self.engine.shares_prefixes

    def source(self, prompt: list[int], salt: str | None) -> tuple[Row | SavedPrefix | None, int]:
        """The row whose keys/values share the longest prefix with `prompt`, and how long: a
        parked row the prompt extends (its next turn) whatever the length, else any row of
        the same salt holding at least min_shared of the prompt's tokens, or the prompt
        store's entry of that salt holding more of them than any row."""
        best, best_shared, best_turn = None, 0, False
        for row in self.engine.rows:
            if self.salts.get(id(row)) != salt:
                continue
            shared = common_prefix_length(self.engine.held_tokens(row), prompt)
            turn = self.continues(prompt, row)
            if shared > best_shared or (shared == best_shared and turn and not best_turn):
                best, best_shared, best_turn = row, shared, turn
        if best_turn:
            return best, best_shared
        if self.copies:
            for saved, saved_salt in self.stored.values():
                shared = common_prefix_length(saved.tokens, prompt)
                if saved_salt == salt and shared > best_shared:
                    best, best_shared = saved, shared
        if best is None or not self.copies or min(best_shared, len(prompt) - 1) < self.min_shared:
            return None, 0
        return best, best_shared

    def continues(self, prompt: list[int], row: Row) -> bool:
        """`row` is parked and `prompt` begins with its whole prompt: that conversation's next
        turn (its reply may come back in other tokens than were sampled)."""
        if id(row) not in self.parked:  # a stored prefix is copied, never continued
            return False
        n = len(row.prompt)
        return len(prompt) > n and prompt[:n] == row.prompt

    def should_wait(
        self,
        prompt: list[int],
        salt: str | None,
        shared: int,
        starting: Sequence[tuple[list[int], str | None]],
    ) -> bool:
        """Whether `prompt` should wait for a prompt now being prefilled, or one (prompt,
        salt) starting before it this turn: it shares at least min_wait tokens with it, and
        at least min_shared more than the `shared` a slot holds now (what it would otherwise
        prefill a second time; the prefill budget goes to the oldest prompts first, so
        waiting for them costs it no prefill time)."""
        if not self.copies:
            return False
        prompts = [other for other, other_salt in starting if other_salt == salt]
        for waiting in self.engine.pending:
            if self.salts.get(id(waiting.row)) == salt:
                prompts.append(waiting.row.prompt)
        would = max((common_prefix_length(other, prompt) for other in prompts), default=0)
        would = min(would, len(prompt) - 1)
        return would >= self.min_wait and would - shared >= self.min_shared

    def started(
        self, row: Row, salt: str | None, source: Row | SavedPrefix | None, continued: bool
    ) -> None:
        """A row took a slot for a request of `salt`: continuing the parked `source`, which
        is gone, or copying from it, which is now the most recently used."""
        self.salts[id(row)] = salt
        if id(source) in self.stored:
            self.stored.move_to_end(id(source))
        if source is None or id(source) not in self.parked:
            return
        if continued:
            del self.parked[id(source)]
            self.salts.pop(id(source), None)
        else:
            self.parked.move_to_end(id(source))

    def park(self, row: Row) -> None:
        """Keep a finished row's slot, within the LRU's bytes and slots."""
        if row not in self.engine.rows[self.engine.n_held :]:
            return
        self.parked[id(row)] = row
        while self.parked and self.parked_bytes() > self.max_bytes:
            self.evict_oldest()
        while len(self.parked) > self.max_parked:
            self.evict_oldest()

    def make_room(self, n_slots: int = 1, keep: Row | SavedPrefix | None = None) -> None:
        """Release the least recently used parked rows (never `keep`, the row or stored
        prefix about to be copied from) until n_slots slots are free."""
        cache = self.engine.cache
        while cache is not None and len(self.engine.rows) + n_slots > cache.batch_size:
            if not self.evict_oldest(keep):
                return

    def evict_oldest(self, keep: Row | SavedPrefix | None = None) -> bool:
        """Release the least recently used parked row but `keep` into the prompt store; False
        when there is none."""
        for key, row in self.parked.items():
            if row is not keep:
                del self.parked[key]
                self.store(row, self.salts.pop(key, None), keep)
                self.engine.release(row)
                return True
        return False

    def store(self, row: Row, salt: str | None, keep: Row | SavedPrefix | None = None) -> None:
        """Keep a row's keys/values in the prompt store, the least recently used entries but
        `keep` making room; not where store_bytes is 0, the engine cannot share them, or
        they do not fit beside `keep`."""
        if not self.store_bytes or not self.copies:
            return
        need = self.engine.cache.row_bytes(len(self.engine.held_tokens(row)))
        kept = keep.nbytes if isinstance(keep, SavedPrefix) and id(keep) in self.stored else 0
        if need + kept > self.store_bytes:
            return
        for key in [key for key, (saved, _) in self.stored.items() if saved is not keep]:
            if self.stored_bytes + need <= self.store_bytes:
                break
            self.stored_bytes -= self.stored.pop(key)[0].nbytes
        saved = self.engine.save_prefix(row)
        if saved is not None:
            self.stored[id(saved)] = (saved, salt)
            self.stored_bytes += saved.nbytes

    def parked_bytes(self) -> int:
        return sum(self.engine.cache.row_bytes(row.length) for row in self.parked.values())

    def forget_gone(self) -> None:
        """Drop the salts of rows that left the engine (finished unparked, cancelled)."""
        self.salts = {id(row): self.salts.get(id(row)) for row in self.engine.rows}

    def clear(self) -> None:
        self.parked.clear()
        self.salts.clear()
        self.stored.clear()
        self.stored_bytes = 0
