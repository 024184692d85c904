"""One generated sequence (a row of the Engine's batch): its prompt, sampling parameters, own
random generator, the tokens so far, when it stops and why, and its statistics.

The Engine (infer/engine.py) decides what runs when; a Row decides what one new token means
for its sequence: `accept` appends it and applies every stop rule in one place.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from numbers import Integral

import torch
from torch import Tensor

from glassformer import kernels
from glassformer.detokenize import IncrementalDecoder, StopStringsAfter
from glassformer.infer.constrain import RowGrammar
from glassformer.infer.sampling import (
    SamplingParams,
    TokenLogprob,
    ban_tokens,
    bias_logits,
    check_finite_logits,
    check_logit_bias_ids,
    make_generator,
    penalize_counts,
    penalize_repetition,
    sample,
    token_logprobs,
)
from glassformer.infer.thinking import Segments
from glassformer.models.common import all_finite, check_token_ids


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float = 0.0  # prefill + sampling the first new token
    prefill_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0  # tokens after the first, per second of decoding
    total_time_s: float = 0.0
    kv_cache_bytes: int = 0  # bytes of keys/values this row holds for its final context
    kv_cache_capacity_bytes: int = 0  # bytes allocated for this row's slot
    # "eos", "stop" (a stop token id or string), "max_new_tokens", "context_full", "cancelled"
    stop_reason: str = ""
    context_shifts: int = 0  # times a full context window was cut to its second half
    batch_size: int = 1  # the most rows decoded in one step while this row was generating
    cached_prompt_tokens: int = 0  # prompt tokens reused from the previous turn's cache
    # Thinking (seed 000 §2.5.2): the generated tokens of the thinking segment, its markers
    # included, and the time from the start until its end marker; the rest is the answer.
    thinking_tokens: int = 0
    thinking_time_s: float = 0.0
    thinking_forced_end: bool = False  # the budget ran out and the row emitted the end marker

    @property
    def answer_tokens(self) -> int:
        return self.generated_tokens - self.thinking_tokens

    @property
    def answer_time_s(self) -> float:
        return self.total_time_s - self.thinking_time_s


@dataclass
class GenerationResult:
    token_ids: list[int]  # the new tokens only
    stats: GenerationStats


@dataclass
class TokenStream:
    """An iterator of new token ids; `stats` is complete once the iterator is exhausted."""

    _tokens: Iterator[int]
    stats: GenerationStats = field(default_factory=GenerationStats)

    def __iter__(self) -> Iterator[int]:
        return self._tokens

    def __next__(self) -> int:
        return next(self._tokens)


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """How many leading items two sequences (token ids, or strings) share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_integer_ids(ids: Sequence[int] | Tensor) -> None:
    """Token ids are whole numbers: 1.5 or True would otherwise be cast to 1 without a word."""
    if isinstance(ids, Tensor):
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"token ids must be an integer tensor, got dtype {ids.dtype}")
        return
    for position, token_id in enumerate(ids):
        if isinstance(token_id, Sequence):
            check_integer_ids(token_id)
        elif isinstance(token_id, bool) or not isinstance(token_id, (int, Integral)):
            raise ValueError(
                f"token id {token_id!r} at position {position} is not a whole number: token ids "
                "are integers from the tokenizer"
            )


def prompt_tensor(
    prompt_ids: Sequence[int] | Tensor, max_seq_len: int, device: torch.device | None = None
) -> Tensor:
    """One prompt as a (1, T) long tensor, with one-line errors for a batch, an empty prompt or
    one longer than the context window. Shared by every generation loop."""
    check_integer_ids(prompt_ids)
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"prompt_ids must be one sequence of token ids, got shape {tuple(ids.shape)}"
        )
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: give at least one token id")
    if ids.numel() > max_seq_len:
        raise ValueError(
            f"the prompt has {ids.numel()} tokens but the context window is "
            f"max_seq_len={max_seq_len}: shorten the prompt"
        )
    return ids[None]  # (1, T)


def checked_prompt(model, prompt_ids: Sequence[int] | Tensor) -> list[int]:
    """A prompt for `model` as a list of ids, its length and every id checked."""
    ids = prompt_tensor(prompt_ids, model.cfg.max_seq_len, model.device)  # (1, T)
    check_token_ids(ids, model.cfg.vocab_size)
    return ids[0].tolist()


class Row:
    """One sequence in a slot of the Engine's cache.

    context: the prompt and the tokens generated so far; the slot holds the keys/values of all
    but the last (the next step feeds it), so `length` = len(context) - 1 positions.
    """

    def __init__(
        self,
        prompt: list[int],
        params: SamplingParams,
        eos_token_id: int | None,
        device: torch.device,
        tokenizer=None,
        on_full_context: str = "stop",
        grammar: RowGrammar | None = None,
    ) -> None:
        self.prompt, self.params, self.eos_token_id = prompt, params, eos_token_id
        self.grammar = grammar  # the answer's constraint (infer/constrain.py), or None
        self.generator = make_generator(params.seed, device)
        self.on_full_context = on_full_context
        self.context = list(prompt)
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] = []  # one per token when params.logprobs is set
        self.stop_reason: str | None = None
        self.slot = -1
        self.keep_cache = False  # park the slot when finished, for a next turn to continue
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        # The answer (everything outside the thinking segment) as far as it can be shown: while
        # generating, a tail that could still begin a stop string waits in `stop_strings`.
        self.text = ""
        self.stop_strings = StopStringsAfter(params.stop, params.min_tokens)
        self.reasoning = ""  # the thinking segment's text, without its markers
        # Thinking or answer (infer/thinking.py): the prompt may open a segment (a template
        # that ends with "<think>\n", as DeepSeek-R1's does), or the reply's first token.
        think_ids = params.think_ids
        self.segments = Segments(think_ids, prompt) if think_ids is not None else None
        self.thought = 0  # tokens inside the current segment, markers not counted
        # The logits processors' fixed tensors, made once: logit_bias's ids and biases, and
        # (on the first step, when the vocabulary is known) the end ids min_tokens bans.
        bias = params.logit_bias
        self.bias_ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=device)
        self.bias_values = torch.tensor([b for _, b in bias], device=device)
        self.end_ids: Tensor | None = None
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.t_start = time.perf_counter()
        self.t_first = 0.0

    @property
    def length(self) -> int:
        return len(self.context) - 1

    @property
    def thinking(self) -> bool:
        """Inside a thinking segment now."""
        return self.segments is not None and self.segments.thinking

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def sample(self, logits: Tensor) -> int:
        """Pick this row's next token from its logits (1, V); with params.logprobs set, also
        record its log-probability and the top candidates (row.logprobs)."""
        check_finite_logits(logits, f"the model's logits at step {len(self.tokens) + 1}")
        params = self.params
        logits = self.process(logits)
        budget = params.thinking_budget
        if self.thinking and budget is not None and self.thought >= budget:
            # The budget is spent: close the segment now, the model answers from here on.
            self.stats.thinking_forced_end = True
            token = params.think_ids[1]
        else:
            token = int(sample(logits, params, self.generator))
        if params.logprobs is not None:
            # Logprobs of the processed logits (bias, ban, penalties), before temperature and
            # the cuts: the distribution a temperature-1 row draws from, so a greedy pick is
            # the top candidate and a banned end token is never listed. vLLM's default
            # (logprobs_mode="raw_logprobs") reports the logits before every processor instead.
            self.logprobs.append(token_logprobs(logits, token, params.logprobs))
        return token

    @property
    def picks_argmax(self) -> bool:
        """Whether this step's token is just the argmax of the model's logits: greedy, and no
        processor, grammar, thinking budget or logprobs to apply (what `sample` then does).
        The Engine takes such rows' tokens from one argmax over the whole batch."""
        params = self.params
        return (
            params.is_greedy
            and not params.logit_bias
            and len(self.tokens) >= params.min_tokens
            and params.repetition_penalty == 1.0
            and not (params.presence_penalty or params.frequency_penalty)
            and self.grammar is None
            and params.thinking_budget is None
            and params.logprobs is None
        )

    def process(self, logits: Tensor) -> Tensor:
        """The logits processors on logits (1, V), in vLLM's order: logit_bias and the
        min_tokens ban on the end tokens first, then the repetition, presence and frequency
        penalties (a banned -inf stays -inf under each). Sampling filters come after, in
        `sample`, so a bias moves greedy picks too."""
        params = self.params
        vocab_size = logits.shape[-1]
        if params.logit_bias:
            check_logit_bias_ids(params.logit_bias[-1:], vocab_size)  # sorted: the largest id
            logits = bias_logits(logits, self.bias_ids, self.bias_values)
        if len(self.tokens) < params.min_tokens:
            ends = self._end_ids(vocab_size, logits.device)
            if ends.numel():
                logits = ban_tokens(logits, ends)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor([self.context], device=logits.device)
            logits = penalize_repetition(logits, seen, params.repetition_penalty)
        if params.presence_penalty or params.frequency_penalty:
            generated = torch.tensor(self.tokens, dtype=torch.long, device=logits.device)
            logits = penalize_counts(
                logits, generated, params.presence_penalty, params.frequency_penalty
            )
        if self.grammar is not None and not self.thinking:
            logits = self._constrain(logits)
        return logits

    def _constrain(self, logits: Tensor) -> Tensor:
        """The grammar's mask: only tokens that keep the answer on its grammar, the row's end
        tokens once the answer is complete, and (before the answer starts) the thinking
        start marker, so a thinking model may still think first."""
        also = tuple(self._end_ids(logits.shape[-1], logits.device).tolist())
        masked = self.grammar.mask(logits, also)
        segments = self.segments
        if segments is not None and not segments.answering:
            start = segments.start
            masked[..., start] = logits[..., start]
        return masked

    def _end_ids(self, vocab_size: int, device: torch.device) -> Tensor:
        """The ids that would end this row: its end-of-sequence id and stop token ids (those
        inside the vocabulary; one outside can never be sampled anyway)."""
        if self.end_ids is None:
            ends = {self.eos_token_id, *self.params.stop_token_ids}
            ids = sorted(i for i in ends if i is not None and 0 <= i < vocab_size)
            self.end_ids = torch.tensor(ids, dtype=torch.long, device=device)
        return self.end_ids

    def accept(self, token: int, rows_in_step: int) -> None:
        """Append a sampled token, update the statistics and apply every stop rule."""
        now = time.perf_counter()
        stats = self.stats
        if not self.tokens:
            self.t_first = now
            stats.time_to_first_token_s = now - self.t_start
            new_prompt = stats.prompt_tokens - stats.cached_prompt_tokens
            stats.prefill_tokens_per_s = new_prompt / stats.time_to_first_token_s
        elif now > self.t_first:
            stats.decode_tokens_per_s = len(self.tokens) / (now - self.t_first)
        self.tokens.append(token)
        self.context.append(token)
        stats.generated_tokens = len(self.tokens)
        stats.total_time_s = now - self.t_start
        stats.batch_size = max(stats.batch_size, rows_in_step)
        params = self.params
        piece = self.decoder.push(token) if self.decoder is not None else ""
        kind = self._route(token, piece, now)
        ends = token == self.eos_token_id or token in params.stop_token_ids
        if self.grammar is not None and kind == "answer" and not ends:
            self.grammar.advance(token)
        if token == self.eos_token_id:
            self.stop("eos")
        elif ends or self.stop_strings.stopped:
            self.stop("stop")
        elif self.grammar is not None and self.grammar.stopped:
            self.stop("stop")  # the answer is complete: nothing may follow it
        elif len(self.tokens) >= params.max_new_tokens:
            self.stop("max_new_tokens")

    def _route(self, token: int, piece: str, now: float) -> str:
        """Thinking or answer: count the token and put its text where it belongs (the markers'
        own text goes to neither); returns the kind ("answer", "thinking" or "marker")."""
        kind = self.segments.push(token) if self.segments is not None else "answer"
        if kind == "answer":
            self.text += self.stop_strings.push_token(piece, len(self.tokens))
            return kind
        self.stats.thinking_tokens += 1
        self.stats.thinking_time_s = now - self.t_start
        if kind == "thinking":
            self.thought += 1
            self.reasoning += piece
        return kind

    def stop(self, reason: str) -> None:
        self.stop_reason = self.stats.stop_reason = reason
        self.text += self.stop_strings.flush()  # ended otherwise: the held tail is text

    def result(self) -> GenerationResult:
        return GenerationResult(token_ids=list(self.tokens), stats=self.stats)


def argmax_picks(
    rows: list[Row], logits: Tensor, found: list[int] | None = None
) -> list[int | None]:
    """Each row's token where it is just the argmax of its logits (Row.picks_argmax), None for
    the other rows, which sample alone. `found`: the fused step's picks (FusedStep.picks: each
    row's argmax, -1 where its logits hold a NaN or an infinity), taken as they are. Without
    them the picks come from one reduction over the batch (logits (n, V)), and every row samples
    alone when fewer than two pick the argmax or a logit is NaN/inf (each row's own sample then
    refuses it, naming the step). Sampling 32 greedy rows one by one, a check, an argmax and
    their dispatch per row, took 6% of a 32-client server's turn; batched, a 32-client burst on
    the Q8_0 SmolLM2 went from 247-251 to 257-258 tok/s."""
    plain = [row.picks_argmax for row in rows]
    if found is not None:
        pairs = zip(found, plain, strict=True)
        return [token if wanted and token >= 0 else None for token, wanted in pairs]
    if sum(plain) < 2:
        return [None] * len(rows)
    if not all_finite(logits):
        return [None] * len(rows)
    best = kernels.argmax(logits).tolist()
    return [token if wanted else None for token, wanted in zip(best, plain, strict=True)]
