"""The thinking task (issue 18): worked steps that add up, batches that learn the completion
only and repeat for a (seed, step), and a trained-for-a-moment model asked with budgets."""

from __future__ import annotations

import random
from pathlib import Path

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


def test_batches_pack_whole_examples_and_learn_the_completion_only(tmp_path):
    task = ArithTask(_run(tmp_path))
    tokenizer = task.tokenizer
    batch = task.train_batch(step=3, batch_size=8, seed=1)
    again = task.train_batch(step=3, batch_size=8, seed=1)
    assert torch.equal(batch["input_ids"], again["input_ids"])
    inputs, targets = batch["input_ids"], batch["targets"]
    learned = targets[:, :-1] != -100
    assert torch.equal(targets[:, :-1][learned], inputs[:, 1:][learned])  # the next token
    modes, packed = set(), 0
    plus = tokenizer.token_to_id("+")
    for ids, row_targets in zip(inputs, targets, strict=True):
        # The row's text is whole examples back to back; each one's learned tokens are read
        # off the targets (a "+" where nothing is learned) and checked against the problem
        # rebuilt from its question.
        text = tokenizer.decode(torch.cat([ids, row_targets[-1:].clamp(min=0)]).tolist())
        examples = [e for e in text.split("<|endoftext|>") if "=" in e]
        packed = max(packed, len(examples))
        shown = [t if t != -100 else plus for t in row_targets.tolist()]
        pieces = tokenizer.decode(shown).split("<|endoftext|>")
        for example, piece in zip(examples, pieces, strict=False):
            question, rest = example.split("=", 1)
            a, b = map(int, question.split("+"))
            if rest.startswith("<think></think>"):
                modes.add("direct")  # the closing </think> of the empty segment is not learned
                assert rest == f"<think></think>{a + b}"
                assert piece.endswith(f"+<think>+{a + b}")
            else:
                modes.add("think")
                steps = worked_steps(Problem(a, b, len(str(max(a, b)))))
                assert rest == f"<think>{steps}</think>{a + b}"
                assert piece.endswith(f"<think>{steps}</think>{a + b}")
    assert modes == {"think", "direct"}
    assert packed >= 2  # short examples share a row


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


def test_the_lab_trains_what_the_config_file_trains():
    # The lab's thinking-budget experiment restates configs/arith-think.toml's recipe (an
    # installed package has no configs/ folder); the two must not drift apart.
    from glassformer.lab import exp_thinking_budget as exp
    from glassformer.train.config import load_run_config

    run = load_run_config(Path(__file__).parent.parent / "configs" / "arith-think.toml")
    assert run.model == exp.MODEL
    assert {k: getattr(run.data, k) for k in exp.DATA} == exp.DATA
    assert {k: getattr(run.train, k) for k in exp.TRAIN} == exp.TRAIN
    assert run.train.max_steps == exp.CONFIG_STEPS
