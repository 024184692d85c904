"""The thinking task (seed 000 §2.5.2): a small GPT learns multi-digit addition, either with its
worked steps inside <think> ... </think> or answering at once (data/arith.py), and is then
asked with a thinking budget.

Batches are a pure function of (seed, step): each example draws its number of digits (1 to
data.arith_max_digits) and whether it shows its steps (data.think_fraction), and examples are
packed end to end into rows of max_seq_len + 1 tokens, as a GPT's pretraining packs documents
(an example never straddles two rows). The loss is on the completion only, with one
exception: in a direct example the </think> that closes the empty segment is not learned. As
in Qwen3's chat template, where enable_thinking=False writes the empty segment into the prompt,
the model never learns to close a segment it has just opened: left alone it thinks, and a
budget of 0 (the engine closes the segment) puts it in the direct mode it learned.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from glassformer.config import ModelConfig
from glassformer.data import IGNORE_INDEX
from glassformer.data.arith import SPECIAL_TOKENS, Problem, completion, make_problem
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams
from glassformer.infer.thinking import require_markers
from glassformer.tokenizers import BPETokenizer
from glassformer.train.config import RunConfig
from glassformer.train.tasks import Task, unigram_entropy

VAL_SEED = 20_261_201  # validation problems: the same at every evaluation
Example = tuple[list[int], list[bool]]  # token ids, and whether each one is learned


def arith_tokenizer() -> BPETokenizer:
    """Bytes plus <|endoftext|>, <think> and </think> (259 tokens, no merges: one token per
    character, so a digit is always one token)."""
    return BPETokenizer.train(["0123456789+=,"], vocab_size=259, special_tokens=SPECIAL_TOKENS)


class ArithTask(Task):
    name = "arith"
    baseline_name = "unigram entropy"

    def __init__(self, run: RunConfig, tokenizer=None) -> None:
        self.tokenizer = tokenizer or arith_tokenizer()
        require_markers(self.tokenizer, "the arith task's tokenizer", "data.task='arith'")
        self.max_digits = run.data.arith_max_digits
        self.think_fraction = run.data.think_fraction
        self.max_len = run.model_config(self.tokenizer.vocab_size).max_seq_len
        largest = 10**self.max_digits - 1
        longest = self.encode(Problem(largest, largest, self.max_digits), think=True)[0]
        if len(longest) - 1 > self.max_len:
            raise ValueError(
                f"a {self.max_digits}-digit problem with its steps is {len(longest)} tokens, "
                f"more than model.max_seq_len={self.max_len} + 1: raise max_seq_len to "
                f"{len(longest)} or lower data.arith_max_digits"
            )
        sample = [self._example(random.Random(i)) for i in range(512)]
        learned = [[t for t, keep in zip(*ex, strict=True) if keep] for ex in sample]
        self.baseline_loss = unigram_entropy(learned)

    def model_config(self, run: RunConfig) -> ModelConfig:
        return run.model_config(self.tokenizer.vocab_size)

    @property
    def n_train(self) -> int:
        return 10 ** (2 * self.max_digits)  # distinct problems of the largest size

    def encode(self, problem: Problem, think: bool) -> Example:
        """The question and its completion, and which tokens are learned: the completion's,
        less the </think> of a direct example's empty segment."""
        question = self.tokenizer.encode(problem.question)
        rest = self.tokenizer.encode(completion(problem, think))
        learned = [False] * len(question) + [True] * len(rest)
        if not think:
            learned[len(question) + 1] = False  # <think></think>: given, as a template would
        return question + rest, learned

    def _example(self, rng: random.Random) -> Example:
        problem = make_problem(rng, rng.randint(1, self.max_digits))
        return self.encode(problem, think=rng.random() < self.think_fraction)

    def _batch(self, rng: random.Random, batch_size: int) -> dict[str, torch.Tensor]:
        """batch_size rows, each packed with whole examples until the next one would not fit."""
        pad = self.tokenizer.eos_token_id
        inputs = torch.full((batch_size, self.max_len), pad, dtype=torch.long)
        targets = torch.full((batch_size, self.max_len), IGNORE_INDEX, dtype=torch.long)
        pending = self._example(rng)
        for i in range(batch_size):
            ids, learned = [], []
            while len(ids) + len(pending[0]) <= self.max_len + 1:
                ids, learned = ids + pending[0], learned + pending[1]
                pending = self._example(rng)
            n = len(ids) - 1
            inputs[i, :n] = torch.tensor(ids[:-1])
            wanted = [t if keep else IGNORE_INDEX for t, keep in zip(ids, learned, strict=True)]
            targets[i, :n] = torch.tensor(wanted[1:])
        return {"input_ids": inputs, "targets": targets}

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        return self._batch(random.Random(seed * 1_000_003 + step), batch_size)

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        rng = random.Random(VAL_SEED)
        for _ in range(n_batches):
            yield self._batch(rng, batch_size)


# --- asking it, with a budget --------------------------------------------------------------


@dataclass
class Answer:
    problem: Problem
    budget: int | None
    correct: bool
    thinking_tokens: int
    answer_tokens: int
    seconds: float  # wall time of the whole answer
    thinking_seconds: float  # until the end of thinking: how long the answer's start waits
    text: str

    @property
    def output_tokens(self) -> int:
        return self.thinking_tokens + self.answer_tokens


def ask(
    model: torch.nn.Module,
    tokenizer,
    problems: list[Problem],
    budget: int | None,
    max_new_tokens: int = 80,
) -> list[Answer]:
    """Greedy answers with the thinking segment opened by the prompt and `budget` tokens in it
    (0: answer at once; None: no limit), one problem at a time, so `seconds` is the wall time
    of one answer."""
    markers = require_markers(tokenizer, "this model", "ask(budget=...)")
    params = SamplingParams(
        temperature=0.0,
        max_new_tokens=max_new_tokens,
        think_ids=markers.ids,
        thinking_budget=budget,
        eos_token_id=tokenizer.eos_token_id,
    )
    engine = Engine(model, tokenizer=tokenizer)
    answers = []
    for problem in problems:
        start = time.perf_counter()
        row = engine.add([*tokenizer.encode(problem.question), markers.start_id], params)
        while not row.finished:
            engine.step()
        seconds = time.perf_counter() - start
        text = row.text.replace("<|endoftext|>", "").strip()
        stats, correct = row.stats, text == problem.answer
        answer = Answer(
            problem,
            budget,
            correct,
            stats.thinking_tokens,
            stats.answer_tokens,
            seconds,
            stats.thinking_time_s,
            text,
        )
        answers.append(answer)
    return answers
