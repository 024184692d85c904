"""Answering from retrieved chunks, and the baseline it is measured against.

Seed 002: 「与其把 10 万 token 全塞进 context 让注意力稀释，不如先检索出最相关的 2000 token 再喂
进去——又准又便宜」. `ask` numbers the retrieved chunks into the chat template's user turn, best
first, until `context_tokens` tokens of the generator's tokenizer are used, and asks for an
answer that cites them as [1], [2]. `ask_stuffed` fills the same turn with the corpus itself,
in document order, as far as `context_tokens` reaches: the "stuff the context" baseline.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from glassformer.chat import ChatSession
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams
from glassformer.rag.retrieve import Hit
from glassformer.rag.store import Store

SYSTEM = (
    "Answer the question using only the numbered sources. Cite every source you use as [1], "
    "[2] and so on. If the sources do not contain the answer, say that they do not."
)
STUFF_SYSTEM = "Answer the question using only the text below."


@dataclass
class Answer:
    text: str
    sources: list[Hit]  # the chunks the model saw, numbered [1], [2], ... in this order
    context: str  # the user turn exactly as the model saw it (before the chat template)
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_s: float
    total_s: float  # retrieval (or reading the store) + prefill + decode

    def as_json(self) -> dict:
        return {
            "answer": self.text,
            "sources": [{"n": n, **h.as_json()} for n, h in enumerate(self.sources, 1)],
            "usage": {
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
            },
            "time_to_first_token_s": self.time_to_first_token_s,
            "total_s": self.total_s,
        }


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def numbered_context(
    question: str, hits: Sequence[Hit], tokenizer, context_tokens: int
) -> tuple[str, list[Hit]]:
    """The user turn: as many hits as fit in context_tokens (in rank order; one that does not
    fit is passed over for a shorter one after it), numbered, then the question."""
    tail = f"Question: {question}"
    used, pieces = [], []
    spent = count_tokens(tokenizer, tail)
    check_question(spent, context_tokens)
    for hit in hits:
        piece = f"[{len(used) + 1}] ({hit.chunk['source']})\n{hit.chunk['text']}\n\n"
        cost = count_tokens(tokenizer, piece)
        if spent + cost <= context_tokens:
            used.append(hit)
            pieces.append(piece)
            spent += cost
    return "Sources:\n\n" + "".join(pieces) + tail, used


def stuffed_context(question: str, store: Store, tokenizer, context_tokens: int) -> str:
    """The user turn of the baseline: the store's text in document order (each chunk's part
    not already covered by the one before), cut at context_tokens tokens, then the question."""
    tail = f"\n\nQuestion: {question}"
    room = context_tokens - count_tokens(tokenizer, tail)
    check_question(context_tokens - room, context_tokens)
    rows = store.table.search().select(["source", "chunk", "start", "end", "text"])
    rows = sorted(rows.limit(store.count()).to_arrow().to_pylist(), key=_document_order)
    text, source, reached, spent = [], None, 0, 0
    for row in rows:
        if row["source"] != source:
            source, reached = row["source"], row["start"]
            text.append(f"\n\n({source})\n")
        text.append(row["text"][max(0, reached - row["start"]) :])
        reached = max(reached, row["end"])
        spent += count_tokens(tokenizer, text[-1])  # pieces cut mid-word: about the whole's
        if spent > room:
            break
    ids = tokenizer.encode("".join(text).lstrip("\n"), add_special_tokens=False)[:room]
    return tokenizer.decode(ids) + tail


def _document_order(row: dict) -> tuple:
    return row["source"], row["chunk"]


def check_question(question_tokens: int, context_tokens: int) -> None:
    if question_tokens >= context_tokens:
        raise ValueError(
            f"the question is {question_tokens} tokens, which leaves no room for sources in "
            f"--context-tokens {context_tokens}: shorten the question or raise --context-tokens"
        )


def generate_answer(
    engine: Engine,
    tokenizer,
    system: str,
    user: str,
    sampling: SamplingParams,
    write: Callable[[str], object],
):
    """One chat turn (system, user) streamed through `write`; the Reply. The engine's row is
    released after it, so one engine answers any number of questions."""
    session = ChatSession(engine, tokenizer, system=system, sampling=sampling)
    try:
        return session.send(user, write=write)
    finally:
        session.reset()


def ask(
    engine: Engine,
    tokenizer,
    question: str,
    hits: Sequence[Hit],
    *,
    context_tokens: int,
    sampling: SamplingParams,
    write: Callable[[str], object] = lambda _: None,
    started: float | None = None,
) -> Answer:
    """Answer from `hits` (retrieved before; `started` is when retrieval began)."""
    started = time.perf_counter() if started is None else started
    user, used = numbered_context(question, hits, tokenizer, context_tokens)
    return _answer(engine, tokenizer, SYSTEM, user, used, sampling, write, started)


def ask_stuffed(
    engine: Engine,
    tokenizer,
    question: str,
    store: Store,
    *,
    context_tokens: int,
    sampling: SamplingParams,
    write: Callable[[str], object] = lambda _: None,
) -> Answer:
    started = time.perf_counter()
    user = stuffed_context(question, store, tokenizer, context_tokens)
    return _answer(engine, tokenizer, STUFF_SYSTEM, user, [], sampling, write, started)


def ask_text(
    engine: Engine,
    tokenizer,
    question: str,
    text: str,
    *,
    sampling: SamplingParams,
    write: Callable[[str], object] = lambda _: None,
) -> Answer:
    """Answer from `text` given whole, as the stuffed baseline gives its text."""
    user = f"{text}\n\nQuestion: {question}"
    return _answer(engine, tokenizer, STUFF_SYSTEM, user, [], sampling, write, time.perf_counter())


def _answer(engine, tokenizer, system, user, used, sampling, write, started) -> Answer:
    prepared = time.perf_counter()  # retrieval and the prompt are ready: generation begins
    reply = generate_answer(engine, tokenizer, system, user, sampling, write)
    return Answer(
        text=reply.text,
        sources=list(used),
        context=user,
        prompt_tokens=reply.stats.prompt_tokens,
        completion_tokens=reply.stats.generated_tokens,
        time_to_first_token_s=prepared - started + reply.stats.time_to_first_token_s,
        total_s=time.perf_counter() - started,
    )
