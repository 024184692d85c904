"""Every training task by name: the table a run's `[data] task` picks from. The base class and
the plain language-modelling task are in tasks.py; each other task lives beside its data."""

from __future__ import annotations

from glassformer.train.arith import ArithTask
from glassformer.train.bert_tasks import GenreTask, MaskedLanguageModelingTask
from glassformer.train.config import RunConfig
from glassformer.train.tasks import LanguageModelingTask, Task
from glassformer.train.translation import TranslationTask

TASKS: dict[str, type[Task]] = {
    task.name: task
    for task in (
        LanguageModelingTask,  # "lm": GPT and RNN
        ArithTask,  # "arith": thinking, data/arith.py
        MaskedLanguageModelingTask,  # "mlm": BERT
        GenreTask,  # "genre": BERT classification
        TranslationTask,  # "translation": seq2seq
    )
}


def make_task(run: RunConfig, tokenizer=None) -> Task:
    """The task of a run: [data] task, or the family's natural one."""
    name = run.data.task
    if name not in TASKS:
        raise ValueError(f"data.task={name!r} is not known: pick one of {', '.join(TASKS)}")
    return TASKS[name](run, tokenizer)
