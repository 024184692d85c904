"""The thinking task (issue 18): worked steps that add up, batches that learn the completion
only and repeat for a (seed, step), and a trained-for-a-moment model asked with budgets."""

from __future__ import annotations

import random

import pytest
import torch

from glassformer.data.arith import Problem, completion, make_problem, worked_steps
from glassformer.train.arith import ArithTask, arith_tokenizer, ask
from glassformer.train.config import RunConfig
from glassformer.train.trainer import Trainer


def _run(tmp_path, **train) -> RunConfig:
    return RunConfig.from_dict({
        "model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64,
                  "position": "rope", "norm": "rms", "ffn": "swiglu"},
        "data": {"task": "arith", "arith_max_digits": 4, "think_fraction": 0.5},
        "train": {"out_dir": str(tmp_path / "run"), "max_steps": 4, "batch_size": 8,
                  "warmup_steps": 1, "eval_interval": 4, "eval_batches": 1,
                  "checkpoint_interval": 4, "threads": 1, **train},
    })  # fmt: skip


def test_worked_steps_add_up_column_by_column():
    rng = random.Random(0)
    for digits in (1, 2, 3, 4, 5):
        for _ in range(50):
            problem = make_problem(rng, digits)
            assert len(str(problem.a)) == len(str(problem.b)) == digits or digits == 1
            steps = worked_steps(problem).split(",")
            assert len(steps) == digits
            # Rebuild the sum from the steps: each column's last digit, the last carry first.
            totals = [int(step.split("=")[1]) for step in steps]
            digits_out = [t % 10 for t in totals]
            rebuilt = str(totals[-1] // 10 or "") + "".join(map(str, reversed(digits_out)))
            assert int(rebuilt) == problem.a + problem.b
    assert worked_steps(Problem(47, 85, 2)) == "7+5=12,4+8+1=13"
    assert completion(Problem(47, 85, 2), think=False) == "<think></think>132<|endoftext|>"


def test_batches_learn_the_completion_only_and_repeat(tmp_path):
    task = ArithTask(_run(tmp_path))
    tokenizer = task.tokenizer
    batch = task.train_batch(step=3, batch_size=8, seed=1)
    again = task.train_batch(step=3, batch_size=8, seed=1)
    assert torch.equal(batch["input_ids"], again["input_ids"])
    start_id = tokenizer.token_to_id("<think>")
    for ids, targets in zip(batch["input_ids"], batch["targets"], strict=True):
        learned = targets[targets != -100].tolist()
        text = tokenizer.decode(learned)
        assert text.startswith("<think>") and text.endswith("<|endoftext|>")
        first = (targets != -100).nonzero()[0].item()
        assert ids[first + 1].item() == start_id  # the first learned token is <think>
        question = tokenizer.decode(ids[: first + 1].tolist())
        a, b = question.rstrip("=").split("+")
        assert text.removesuffix("<|endoftext|>").endswith(str(int(a) + int(b)))


def test_too_short_context_is_a_clear_error(tmp_path):
    run = _run(tmp_path)
    run.model["max_seq_len"] = 20
    with pytest.raises(ValueError, match="raise max_seq_len to"):
        ArithTask(run)


def test_trained_model_answers_with_a_budget(tmp_path):
    result = Trainer(_run(tmp_path), progress=False).fit()
    assert result.val_loss < result.train_losses[0]
    from glassformer.train.checkpoint import load

    model, tokenizer = load(tmp_path / "run")
    problems = [Problem(47, 85, 2), Problem(3, 4, 1)]
    for budget in (0, 3):
        for answer in ask(model, tokenizer, problems, budget, max_new_tokens=12):
            # the segment opened by the prompt: `budget` tokens, then the emitted </think>
            assert answer.thinking_tokens == budget + 1
    assert arith_tokenizer().vocab_size == 259
