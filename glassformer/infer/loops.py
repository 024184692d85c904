"""The Engine's thin uses (seed 000 §2.5.1): one prompt, or a batch, from start to finish, as
loops over its add and step (nanochat's generate, vLLM's LLM.generate), and `follow`, a row's
tokens as they come. They use the Engine's public rows and slots only, so every engine (the
compiled and speculative ones too, chunked prefill or not) streams and batches alike.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext

from torch import Tensor

from glassformer.infer.rows import GenerationResult, Row, TokenStream, checked_prompt
from glassformer.infer.sampling import MAX_SEED, SamplingParams


class Loops:
    """generate, stream, follow and generate_batch over an Engine's add and step."""

    def stream(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | None = None,
        on_full_context: str = "stop",
        **sampling,
    ) -> TokenStream:
        """Yield new token ids one by one as they are sampled. Further keywords are
        SamplingParams fields (min_p, repetition_penalty, stop, stop_token_ids)."""
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            max_new_tokens=max_new_tokens,
            eos_token_id=eos_token_id,
            **sampling,
        )
        row = self.add(prompt_ids, params, on_full_context=on_full_context)
        return TokenStream(self.follow(row), row.stats)

    def follow(self, row: Row) -> Iterator[int]:
        """A row's tokens as they come, stepping the engine while the row is live. Inference
        mode is entered per step, never across a yield, and an abandoned stream cancels its row
        (closing the generator runs the finally)."""
        try:
            sent = 0
            while True:
                while sent < len(row.tokens):
                    sent += 1
                    yield row.tokens[sent - 1]
                if row.finished:
                    return
                self.step()
        finally:
            self.cancel(row)

    def generate(
        self, prompt_ids: Sequence[int] | Tensor, max_new_tokens: int = 64, *args, **kwargs
    ) -> GenerationResult:
        """Generate up to max_new_tokens; temperature 0 means greedy. The other arguments are
        stream's."""
        with self.model_unchanged():  # none of the caller's code runs until it returns
            stream = self.stream(prompt_ids, max_new_tokens, *args, **kwargs)
            return GenerationResult(token_ids=list(stream), stats=stream.stats)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int = 64,
        *,
        seed: int | None = None,
        on_full_context: str = "stop",
        **kwargs,
    ) -> list[GenerationResult]:
        """Generate for several prompts at once; one result per prompt, in order.

        Every prompt is a row of its own (its own slot, positions and stop), so each produces
        what it would alone (up to float rounding: see infer/engine.py). Row i samples with
        seed + i, so the rows draw differently and a seed repeats the batch. The other keywords
        are SamplingParams fields.
        """
        rows = self._batch_prompts(prompts)
        SamplingParams(max_new_tokens=max_new_tokens, seed=seed, **kwargs)  # all checked first
        longest = max(len(row) for row in rows)
        if self.max_rows is None and not self.rows:
            self.reserve(len(rows), min(self.slot_len, longest + max_new_tokens))
        # More prompts than free slots: each waits for a row to finish (continuous batching).
        waiting, added = list(enumerate(rows)), []
        with self.model_unchanged():  # none of the caller's code runs until it returns
            while waiting or any(not row.finished for row in added):
                while waiting and (self.cache is None or len(self.rows) < self.cache.batch_size):
                    i, prompt = waiting.pop(0)
                    row_seed = None if seed is None else (seed + i) % (MAX_SEED + 1)
                    params = SamplingParams(max_new_tokens=max_new_tokens, seed=row_seed, **kwargs)
                    added.append(self.add(prompt, params, on_full_context=on_full_context))
                stepped = self.step() or self.pending
                if not stepped and waiting and len(self.rows) >= self.cache.batch_size:
                    self.add(waiting[0][1])  # no slot will free up (parked rows): the clear error
        return [row.result() for row in added]

    def model_unchanged(self) -> AbstractContextManager:
        """A block whose decode steps check the model once, not each (FusedStep.unchanged):
        for loops between whose steps nothing changes the model."""
        return self.fused.unchanged() if self.fused is not None else nullcontext()

    def recheck_model(self) -> None:
        """Inside model_unchanged(), after work that may have changed the model: the next step
        checks it again."""
        if self.fused is not None:
            self.fused.recheck()

    def _batch_prompts(self, prompts: Sequence[Sequence[int] | Tensor]) -> list[list[int]]:
        """Check every prompt like `add`; errors name the prompt's number (from 1)."""
        if isinstance(prompts, str) or (isinstance(prompts, Tensor) and prompts.dim() != 2):
            raise ValueError(
                "prompts must be a list of prompts, each a list of token ids: encode text "
                "with the tokenizer, and wrap a single prompt as [prompt_ids]"
            )
        rows = list(prompts)
        if not rows:
            raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
        if any(isinstance(row, int) for row in rows):
            raise ValueError(
                "prompts is one flat list of token ids: generate_batch takes a list of prompts, "
                "so wrap a single prompt as [prompt_ids]"
            )
        checked = []
        for number, row in enumerate(rows, start=1):
            try:
                if isinstance(row, str):
                    raise ValueError("got text: encode it with the tokenizer first")
                checked.append(checked_prompt(self.model, row))
            except ValueError as error:
                raise ValueError(f"prompt {number} of {len(rows)}: {error}") from None
        return checked
