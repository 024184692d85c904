"""Addition problems with exact answers and graded difficulty, for a model that can think
before it answers (seed 000 §2.5.2).

A problem is two numbers of `digits` digits each (difficulty = digits). Its worked steps add
the columns from the right, the way it is done on paper, one column per step with the carry:

    4785+3396=<think>5+6=11,8+9+1=18,7+3+1=11,4+3+1=8</think>8181

and the direct form answers at once after an empty segment:

    4785+3396=<think></think>8181

One model learns both (a share `think_fraction` of the examples shows its steps), so the
same weights answer with a thinking budget of 0, a few tokens, or no limit.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from glassformer.templates import THINK_END, THINK_START

END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, THINK_START, THINK_END)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    digits: int

    @property
    def question(self) -> str:
        return f"{self.a}+{self.b}="

    @property
    def answer(self) -> str:
        return str(self.a + self.b)


def make_problem(rng: random.Random, digits: int) -> Problem:
    """Two numbers of exactly `digits` digits (1 digit: 0-9)."""
    low = 0 if digits == 1 else 10 ** (digits - 1)
    high = 10**digits - 1
    return Problem(rng.randint(low, high), rng.randint(low, high), digits)


def worked_steps(problem: Problem) -> str:
    """Column by column from the right: "a+b(+carry)=sum", comma-separated."""
    a, b = str(problem.a).zfill(problem.digits), str(problem.b).zfill(problem.digits)
    steps, carry = [], 0
    for x, y in zip(reversed(a), reversed(b), strict=True):
        total = int(x) + int(y) + carry
        steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={total}")
        carry = total // 10
    return ",".join(steps)


def completion(problem: Problem, think: bool) -> str:
    """What follows the question: the thinking segment (worked or empty), the answer, the end."""
    steps = worked_steps(problem) if think else ""
    return f"{THINK_START}{steps}{THINK_END}{problem.answer}{END_OF_TEXT}"
