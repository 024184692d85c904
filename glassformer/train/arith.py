"""The thinking task (seed 000 §2.5.2): a small GPT learns multi-digit addition, either with its
worked steps inside <think> ... </think> or answering at once (data/arith.py), and is then
asked with a thinking budget.

Batches are a pure function of (seed, step): each row draws its number of digits (1 to
data.arith_max_digits) and whether it shows its steps (data.think_fraction). The loss is on the
completion only (the thinking segment, the answer and the end of text), not on the question.
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
from glassformer.train.tasks import TASKS, Task, unigram_entropy

VAL_SEED = 20_261_201  # validation problems: the same at every evaluation


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
        longest = self._encode(Problem(10**self.max_digits - 1, 10**self.max_digits - 1,
                                       self.max_digits), think=True)[0]  # fmt: skip
        if len(longest) - 1 > self.max_len:
            raise ValueError(
                f"a {self.max_digits}-digit problem with its steps is {len(longest)} tokens, "
                f"more than model.max_seq_len={self.max_len} + 1: raise max_seq_len to "
                f"{len(longest)} or lower data.arith_max_digits"
            )
        sample = self._rows(random.Random(0), 512)
        self.baseline_loss = unigram_entropy([ids[start:] for ids, start in sample])

    def model_config(self, run: RunConfig) -> ModelConfig:
        return run.model_config(self.tokenizer.vocab_size)

    @property
    def n_train(self) -> int:
        return 10 ** (2 * self.max_digits)  # distinct problems of the largest size

    def _encode(self, problem: Problem, think: bool) -> tuple[list[int], int]:
        question = self.tokenizer.encode(problem.question)
        return question + self.tokenizer.encode(completion(problem, think)), len(question)

    def _rows(self, rng: random.Random, n: int) -> list[tuple[list[int], int]]:
        rows = []
        for _ in range(n):
            problem = make_problem(rng, rng.randint(1, self.max_digits))
            rows.append(self._encode(problem, think=rng.random() < self.think_fraction))
        return rows

    def _batch(self, rows: list[tuple[list[int], int]]) -> dict[str, torch.Tensor]:
        pad = self.tokenizer.eos_token_id
        inputs = torch.full((len(rows), self.max_len), pad, dtype=torch.long)
        targets = torch.full((len(rows), self.max_len), IGNORE_INDEX, dtype=torch.long)
        for i, (ids, start) in enumerate(rows):
            n = len(ids) - 1
            inputs[i, :n] = torch.tensor(ids[:-1])
            targets[i, start - 1 : n] = torch.tensor(ids[start:])  # the completion only
        return {"input_ids": inputs, "targets": targets}

    def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
        rng = random.Random(seed * 1_000_003 + step)
        return self._batch(self._rows(rng, batch_size))

    def val_batches(self, batch_size: int, n_batches: int) -> Iterator[dict[str, torch.Tensor]]:
        rng = random.Random(VAL_SEED)
        for _ in range(n_batches):
            yield self._batch(self._rows(rng, batch_size))


TASKS[ArithTask.name] = ArithTask


# --- asking it, with a budget --------------------------------------------------------------


@dataclass
class Answer:
    problem: Problem
    budget: int | None
    correct: bool
    thinking_tokens: int
    answer_tokens: int
    seconds: float
    text: str


def ask(
    model: torch.nn.Module,
    tokenizer,
    problems: list[Problem],
    budget: int | None,
    max_new_tokens: int = 80,
) -> list[Answer]:
    """Greedy answers with the thinking segment opened by the prompt and `budget` tokens in it
    (0: answer at once; None: no limit), one engine row per problem, in batches."""
    markers = require_markers(tokenizer, "this model", "ask(budget=...)")
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                            think_ids=markers.ids, thinking_budget=budget,
                            eos_token_id=tokenizer.eos_token_id)  # fmt: skip
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
        answer = Answer(problem, budget, correct, stats.thinking_tokens, stats.answer_tokens,
                        seconds, text)  # fmt: skip
        answers.append(answer)
    return answers
