"""The generation engine (seed 000 §2.5.1): prefill a prompt in one parallel pass into a
preallocated KV cache, then decode one token at a time, sampling each from the logits. (A few
tokens, prefill.py's FUSED_PREFILL at most, go through the fused C step instead, as a run of
positions whose weights are read once: a short prompt, or the rest of one after a cached
prefix.)

The engine owns a cache of R row slots. `add` puts a prompt into a free slot (its prefill runs
at once, its first token is sampled); `step` decodes one token for every active row in one
batched forward, each row at its own position with its own SamplingParams and generator; a
row that stops (eos, stop token or string, max_new_tokens, full context, cancel) leaves and
its slot is free for the next `add`. With a prefill_chunk budget (infer/prefill.py) `add`
only takes the slot: each `step` then decodes the live rows and prefills at most that many
prompt tokens, so a long prompt, or many at once, never stalls the rows already decoding.
This is continuous batching (vLLM's scheduler in miniature): a row that joins while others
are mid-generation gets the logits it gets alone. Through the fused C step (infer/fused.py:
one row, or a batch of rows each at its own position of its own slot, every weight read once
for all of them) exactly, the same dot products in the same order; through the batched torch
forward (models the step does not take) up to float rounding, |difference| ~1e-6 of the
logits' scale, so the same tokens unless two candidates lie within rounding of each other.
`generate`, `stream` and `generate_batch` are thin loops over add and step (infer/loops.py);
CompiledDecoder
(infer/compiled.py) is this engine with a compiled decode forward, and SpeculativeDecoder
(infer/speculative.py) with a speculative round as its step.

Live rows always fill the first slots, so a step reads one contiguous block of the cache; rows
still prefilling come next, parked rows last. A row added with keep_cache=True is parked when
it finishes (its slot keeps its keys/values) and the next turn of a conversation continues
it, prefilling only the new tokens. A new prompt that starts like a row's keys/values (a shared
system prompt, a few-shot header) copies them into its own slot (add's prefix_from) and
prefills only the rest: a position's keys depend on the tokens up to it, nothing else.

The engine knows token ids, not text: given a tokenizer it also follows each row's text, for
stop strings. Every row reports time to first token, decode tokens/s and KV-cache bytes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from glassformer import kernels
from glassformer.infer.constrain import Grammars, RowGrammar
from glassformer.infer.fused import FusedStep
from glassformer.infer.huge_pages import advise_in_place, to_huge_pages
from glassformer.infer.loops import Loops
from glassformer.infer.prefill import Pending, Prefills, check_budget
from glassformer.infer.reuse import Reuse, SavedPrefix
from glassformer.infer.rows import (
    GenerationResult,
    GenerationStats,
    Row,
    TokenStream,
    argmax_picks,
    check_integer_ids,
    checked_prompt,
    prompt_tensor,
)
from glassformer.infer.sampling import SamplingParams, check_logit_bias_ids, resolve_eos
from glassformer.nn.kv_cache import KVCache

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "Row",
    "TokenStream",
    "check_integer_ids",
    "prompt_tensor",
]

ON_FULL_CONTEXT = ("stop", "shift")


class Engine(Loops, Prefills, Reuse):
    """Generates from any model that offers `new_cache(batch_size, max_seq_len, dtype)` (a cache
    with rows/swap_rows/row_bytes) and `model(ids, positions, cache=cache, last_token_only=True)`.

    max_rows: the row slots; None lets generate/generate_batch size the cache to each call.
    max_seq_len: positions per slot (default: the model's context window).
    tokenizer: lets rows stop at stop strings and follow their text (row.text).
    fast: decode one row's steps with the fused C step (infer/fused.py) where the model allows
        it (a GPT-family model on the CPU), and prefills of FUSED_PREFILL tokens or fewer;
        longer prefills' fp32 matmuls on oneDNN or MKL (FastLinears); False
        runs everything through the torch modules, the reference the fast path is tested against.
        The fused step follows later changes to the model: new or edited weights are read
        again, and hooks, attention captures and adapters send its steps through the modules.
    prefill_chunk: the most prompt tokens one step prefills (vLLM's max_num_batched_tokens,
        llama.cpp's n_batch); then add/add_many only take slots and the prompts are prefilled,
        oldest first, across the next steps, beside the live rows' decoding. None (the
        default): each prompt is prefilled whole in add/add_many, its first token sampled there.
    huge_pages: first move the model's parameters and buffers (16 KB or more) into 2 MB pages
        (infer/huge_pages.py: the same values, modules and ties; fused decode steps 1.00-1.31x
        faster), and ask for the KV cache's. Off by default: the caller's tensors move.
    kv_dtype: the keys/values' dtype (None: the model's); torch.bfloat16 or torch.float16 halve
        the cache's bytes per token (llama.cpp stores f16 by default), rounding each key and
        value once when it is written (benchmarks/kv_dtype.py measures what that costs).
    """

    def __init__(
        self,
        model: nn.Module,
        max_rows: int | None = None,
        max_seq_len: int | None = None,
        tokenizer=None,
        fast: bool = True,
        prefill_chunk: int | None = None,
        huge_pages: bool = False,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model.eval()
        self.kv_dtype, self.huge_pages = kv_dtype, huge_pages
        if huge_pages:
            to_huge_pages(model)  # before the fused step takes the weights' addresses
        # the fused step takes up to max_rows rows at once (its scratch is per row: kilobytes)
        rows = max(8, max_rows) if isinstance(max_rows, int) else 8
        self.fused = FusedStep.for_model(model, rows) if fast else None
        use_linears = fast and kernels.FastLinears.applies(model)
        self._linears = kernels.FastLinears if use_linears else contextlib.nullcontext
        self.max_seq_len: int = model.cfg.max_seq_len
        for name, value in (("max_rows", max_rows), ("max_seq_len", max_seq_len)):
            whole = isinstance(value, int) and not isinstance(value, bool)
            if value is not None and not (whole and value >= 1):
                raise ValueError(f"{name}={value!r} must be a whole number >= 1 (or None)")
        self.max_rows = max_rows
        self.slot_len = min(max_seq_len or self.max_seq_len, self.max_seq_len)
        self.tokenizer = tokenizer
        self.grammars: Grammars | None = None  # constrained rows' compiler, made on first use
        self.cache = None
        self.rows: list[Row] = []  # by slot: live rows, then pending ones, then parked ones
        self.n_live = 0
        self.pending: list[Pending] = []  # rows still prefilling, oldest first
        self.prefill_chunk = prefill_chunk

    @property
    def prefill_chunk(self) -> int | None:
        return self._prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, value: int | None) -> None:
        self._prefill_chunk = check_budget(value)

    @property
    def n_held(self) -> int:
        """Slots of rows not parked: live ones, then those still prefilling."""
        return self.n_live + len(self.pending)

    # --- slots --------------------------------------------------------------------------------

    def reserve(self, n_rows: int, n_positions: int) -> None:
        """Make sure the cache has n_rows slots of n_positions; a larger cache is allocated only
        while no row holds a slot (one that is large enough is reused)."""
        cache = self.cache
        if cache is not None and cache.batch_size >= n_rows and cache.max_seq_len >= n_positions:
            return
        if self.rows:
            raise ValueError(
                f"the Engine's cache ({cache.batch_size} rows x {cache.max_seq_len} positions) "
                f"cannot grow to {n_rows} x {n_positions} while {len(self.rows)} rows hold "
                "slots: finish or release them first, or create the Engine with larger "
                "max_rows/max_seq_len"
            )
        self.cache = self.model.new_cache(
            batch_size=n_rows, max_seq_len=n_positions, dtype=self.kv_dtype
        )
        if self.huge_pages and isinstance(self.cache, KVCache):  # read every step, as weights
            advise_in_place(self.cache.k), advise_in_place(self.cache.v)

    def _place(self, row: Row, slot: int) -> None:
        self.rows[slot], row.slot = row, slot

    def _swap(self, a: int, b: int) -> None:
        """Exchange two slots' rows and their keys/values: len(context) positions, one more than
        a live row holds, as a row whose prompt was just prefilled holds all of it."""
        if a == b:
            return
        row_a, row_b = self.rows[a], self.rows[b]
        self.cache.swap_rows(a, b, max(len(row_a.context), len(row_b.context)))
        self._place(row_a, b)
        self._place(row_b, a)

    def _leave(self, row: Row) -> None:
        """A finished row leaves the live slots: parked (keep_cache) or freed."""
        last_live = self.n_live - 1
        self._swap(row.slot, last_live)  # now the last live slot; live rows stay contiguous
        self.n_live -= 1
        self._swap(row.slot, self.n_held)  # behind the rows still prefilling
        if not row.keep_cache:
            self.release(row)

    def release(self, row: Row) -> None:
        """Free a parked row's slot (a conversation that will not continue)."""
        if row not in self.rows[self.n_held :]:
            return
        last = len(self.rows) - 1
        self._swap(row.slot, last)
        self.rows.pop()
        row.slot = -1

    # --- rows ---------------------------------------------------------------------------------

    def add(
        self,
        prompt_ids: Sequence[int] | Tensor,
        params: SamplingParams | None = None,
        *,
        on_full_context: str = "stop",
        keep_cache: bool = False,
        continues: Row | None = None,
        prefix_from: Row | None = None,
        prefix_saved: SavedPrefix | None = None,
    ) -> Row:
        """Prefill a prompt into a free slot and sample its first token; returns its Row. With
        a prefill_chunk budget the row only takes its slot: step() prefills it.

        keep_cache: when the row finishes, park its slot with its keys/values for a next turn.
        continues: such a parked Row whose conversation the prompt continues: only the
            tokens after the prefix they share are prefilled.
        prefix_from: a row holding a slot (running, prefilling or parked) whose keys/values
            begin like the prompt: the prefix they share (held_tokens) is copied into the new
            row's slot and only the rest is prefilled; the source row goes on unchanged.
        prefix_saved: keys/values a row left behind (save_prefix): the prefix they share with
            the prompt is copied into the new row's slot, as prefix_from's.
        on_full_context: when a row fills its slot, "stop", or "shift" (keep the window's
            second half as context and go on).
        """
        row = self._new_row(prompt_ids, params, on_full_context, keep_cache)
        if sum(source is not None for source in (continues, prefix_from, prefix_saved)) > 1:
            raise ValueError("give one of continues=, prefix_from= and prefix_saved=")
        if continues is not None:
            cached = self._resume(row, continues)
        elif prefix_from is not None or prefix_saved is not None:
            cached = self._copy_prefix(row, prefix_from if prefix_saved is None else prefix_saved)
        else:
            self._take_slot(row, len(row.prompt) + row.params.max_new_tokens)
            cached = 0
        row.stats.cached_prompt_tokens = cached
        self.pending.append(Pending(row, cached))
        if self.prefill_chunk is None:
            self._prefill_pending()
        return row

    def add_many(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        params: Sequence[SamplingParams],
        *,
        on_full_context: str = "stop",
        keep_cache: bool = False,
    ) -> list[Row]:
        """Several new rows whose prompts are prefilled together, in one batched forward (vLLM
        batches the waiting prompts likewise): each gets its first token after one pass for
        all of them, not after a queue of passes. The prompts are right-padded to the longest
        and each row samples from the logits at its own last prompt token. The padding writes
        keys/values past a row's end, which the causal mask hides and the row's own decode
        steps overwrite; caches that could not hide them (a sliding window's ring overwrites
        keys still in the window, a recurrent state folds every token in) prefill one row at
        a time instead. Rows continuing a conversation go through add(continues=...). With a
        prefill_chunk budget the rows only take their slots: step() prefills them, several
        short prompts still in one forward."""
        if len(prompts) != len(params):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams: one each")
        rows = [
            self._new_row(p, q, on_full_context, keep_cache)
            for p, q in zip(prompts, params, strict=True)
        ]
        if not rows:
            return []
        wanted = max(len(row.prompt) + row.params.max_new_tokens for row in rows)
        if self.max_rows is not None:
            self.reserve(self.max_rows, self.slot_len)
        elif not self.rows:
            self.reserve(len(rows), min(self.slot_len, wanted))
        free = self.cache.batch_size - len(self.rows)
        if len(rows) > free:
            raise ValueError(
                f"{len(rows)} prompts but {free} free row slots: add fewer, step() until rows "
                "finish, or create the Engine with a larger max_rows"
            )
        for row in rows:
            self._take_slot(row, len(row.prompt) + row.params.max_new_tokens)
            self.pending.append(Pending(row, 0))
        if self.prefill_chunk is None:
            self._prefill_pending()
        return rows

    def _new_row(
        self,
        prompt_ids: Sequence[int] | Tensor,
        params: SamplingParams | None,
        on_full_context: str,
        keep_cache: bool,
    ) -> Row:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if on_full_context not in ON_FULL_CONTEXT:
            raise ValueError(f"on_full_context={on_full_context!r}: pick 'stop' or 'shift'")
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"stop={list(params.stop)!r} needs the text: create the Engine with "
                "tokenizer=..., or stop at token ids with stop_token_ids"
            )
        prompt = checked_prompt(self.model, prompt_ids)
        eos = resolve_eos(params.eos_token_id, self.model.cfg)
        check_logit_bias_ids(params.logit_bias, self.model.cfg.vocab_size)  # before a slot
        grammar = self._grammar(params)
        row = Row(prompt, params, eos, self.model.device, self.tokenizer, on_full_context, grammar)
        row.stats = self.new_stats(len(prompt))
        row.keep_cache = keep_cache
        return row

    def _grammar(self, params: SamplingParams) -> RowGrammar | None:
        """The row's own matcher for its constraint (json_schema, regex or grammar), compiled
        over this engine's vocabulary once per constraint (infer/constrain.py)."""
        constraint = params.constraint
        if constraint is None:
            return None
        if self.tokenizer is None:
            raise ValueError(
                f"{constraint.kind}= needs the vocabulary's text: create the Engine with "
                "tokenizer=..."
            )
        if self.grammars is None:
            eos = self.tokenizer.eos_token_id
            self.grammars = Grammars(self.tokenizer, self.model.cfg.vocab_size, eos)
        return self.grammars.matcher(constraint)

    def _first_token(self, row: Row, logits: Tensor) -> None:
        """Sample a prefilled row's first token from its logits (1, V)."""
        row.stats.kv_cache_capacity_bytes = self.cache.nbytes // self.cache.batch_size
        with torch.inference_mode():
            row.accept(row.sample(logits), rows_in_step=1)
        self._update_bytes(row)
        if row.finished:
            self._leave(row)

    def new_stats(self, prompt_tokens: int) -> GenerationStats:
        """A new row's statistics (an engine with another step may keep more)."""
        return GenerationStats(prompt_tokens=prompt_tokens)

    def _take_slot(self, row: Row, wanted: int) -> None:
        """Put a new row into the first free slot (right after the live and pending ones); the
        caller queues it in self.pending."""
        if self.max_rows is not None:
            self.reserve(self.max_rows, self.slot_len)
        elif not self.rows:
            self.reserve(1, min(self.slot_len, wanted))
        cache = self.cache
        if len(self.rows) >= cache.batch_size:
            raise ValueError(
                f"all {cache.batch_size} row slots are busy ({self.n_live} generating, "
                f"{len(self.pending)} prefilling, {len(self.rows) - self.n_held} parked): "
                "step() until a row finishes, "
                "release() a parked one, or create the Engine with a larger max_rows"
            )
        if len(row.prompt) > cache.max_seq_len:
            raise ValueError(
                f"the prompt has {len(row.prompt)} tokens but a row slot holds "
                f"{cache.max_seq_len} positions: shorten the prompt, or create the Engine "
                "with a larger max_seq_len"
            )
        self.rows.append(row)
        row.slot = len(self.rows) - 1
        self._swap(row.slot, self.n_held)  # the first parked row (if any) moves behind it

    def step(self) -> list[Row]:
        """Decode one token for every live row, then prefill this step's chunks of the pending
        prompts (a row whose prompt is then whole gets its first token and decodes from the
        next step). Returns the rows that got a token (rows that finish leave their slots
        before step returns)."""
        decoded = self._decode_live()
        return decoded + (self._prefill_pending() if self.pending else [])

    def _decode_live(self) -> list[Row]:
        for row in self.rows[: self.n_live]:
            if row.length >= self.cache.max_seq_len and row.on_full_context == "stop":
                row.stop("context_full")
        for row in [r for r in self.rows[: self.n_live] if r.finished]:
            self._leave(row)
        live = self.rows[: self.n_live]
        if not live:
            return []
        with torch.inference_mode():
            for row in live:
                if row.length >= self.cache.max_seq_len:
                    self._shift(row)
            logits, found = self._decode(live)  # (n, V), the C step's greedy picks or None
            picks = argmax_picks(live, logits, found)
            for i, row in enumerate(live):
                token = row.sample(logits[i : i + 1]) if picks[i] is None else picks[i]
                row.accept(token, rows_in_step=len(live))
        for row in live:
            self._update_bytes(row)
            if row.finished:
                self._leave(row)
        return live

    def _decode(self, live: list[Row]) -> tuple[Tensor, list[int] | None]:
        """One batched forward, each live row's last token at its own position (the fused step
        where it takes this model, cache and rows) -> logits (n, V), the step's picks or None."""
        fused = self.fused
        if fused is not None and fused.supports(self.cache) and len(live) <= fused.max_tokens:
            if len(live) == 1:
                (row,) = live
                return fused(row.context[-1], row.length, self.cache, row.slot), fused.picks
            tokens = [row.context[-1] for row in live]
            positions = [row.length for row in live]
            logits = fused.rows(tokens, positions, [row.slot for row in live], self.cache)
            if logits is not None:
                return logits, fused.picks
        device = self.model.device
        ids = torch.tensor([[row.context[-1]] for row in live], device=device)  # (n, 1)
        lengths = [row.length for row in live]
        if len(set(lengths)) == 1:  # one position for every row: plain slices and masks
            positions = torch.tensor(lengths[:1], device=device)  # (1,)
        else:
            positions = torch.tensor(lengths, device=device)[:, None]  # (n, 1)
        cache = self.cache.rows(0, len(live))
        return self.model(ids, positions, cache=cache, last_token_only=True)[:, -1], None

    def _shift(self, row: Row) -> None:
        """The row's slot is full: keep the window's second half and prefill it again, so the
        model keeps seeing positions it was trained on (nanoGPT crops likewise)."""
        del row.context[: len(row.context) - self.cache.max_seq_len // 2]
        row.stats.context_shifts += 1
        if len(row.context) > 1:
            self._prefill(row, row.context[:-1], 0)
        else:
            self.cache.rows(row.slot, row.slot + 1).reset()

    def _update_bytes(self, row: Row) -> None:
        row.stats.kv_cache_bytes = self.cache.row_bytes(row.length)

    def cancel(self, row: Row) -> None:
        """Stop a live or pending row now (a client went away); its slot is free at once (a
        pending row's is freed, never parked: its prompt is only partly in it)."""
        if row.finished:
            return
        if row in self.rows[: self.n_live]:
            row.stop("cancelled")
            self._leave(row)
        elif any(waiting.row is row for waiting in self.pending):
            row.stop("cancelled")
            self.pending = [waiting for waiting in self.pending if waiting.row is not row]
            self._swap(row.slot, self.n_held)  # behind the pending rows: among the parked
            self.release(row)

    def clear(self) -> None:
        """Forget every row and free every slot (after a forward failed midway, no slot's
        keys/values can be trusted)."""
        self.rows, self.n_live, self.pending = [], 0, []
