"""`rag index`: read the sources, chunk them, embed the chunks the store does not hold yet, and
write them, a batch per atomic version of the table. A run cut short (Ctrl-C, kill -9) leaves
the store at its last whole batch; the same command run again embeds only what is missing."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from glassformer.rag.documents import Document, Skipped, chunk_document, read_sources
from glassformer.rag.encoder import Encoder
from glassformer.rag.store import Store, StoreInfo

WRITE_BATCH = 2048  # chunks per write: each write is one version of the table


@dataclass
class IndexReport:
    store: str
    documents: int
    chunks: int  # chunks of the sources, this run
    added: int  # of them, embedded and written now
    total: int  # chunks in the store afterwards
    seconds: float
    skipped: list[Skipped] = field(default_factory=list)

    @property
    def chunks_per_s(self) -> float:
        return self.added / self.seconds if self.seconds > 0 else 0.0


def index_sources(
    sources: Sequence[str],
    location: str,
    encoder: Encoder,
    *,
    chunk_tokens: int = 128,
    overlap: int = 32,
    batch_size: int = 32,
    write_batch: int = WRITE_BATCH,
    progress: Callable[[int, int], Callable[[int], object]] | None = None,
) -> IndexReport:
    """Index `sources` (files, folders, corpus names) into the store at `location`. progress(
    total, done) is called once with the number of chunks to embed (and those already stored)
    and returns a function that is told the chunks embedded after each batch (a progress bar's
    update)."""
    if not sources:
        raise ValueError("rag index needs at least one file, folder or corpus to read")
    skipped: list[Skipped] = []
    documents = list(read_sources(sources, skipped))
    if not documents:
        named = "; ".join(f"{s.source}: {s.reason}" for s in skipped) or "nothing"
        raise ValueError(f"no text to index in {', '.join(sources)} ({named})")
    report = index_documents(
        documents,
        location,
        encoder,
        chunk_tokens=chunk_tokens,
        overlap=overlap,
        batch_size=batch_size,
        write_batch=write_batch,
        progress=progress,
        sources=sources,
    )
    report.skipped = skipped
    return report


def index_documents(
    documents: Sequence[Document],
    location: str,
    encoder: Encoder,
    *,
    chunk_tokens: int = 128,
    overlap: int = 32,
    batch_size: int = 32,
    write_batch: int = WRITE_BATCH,
    progress: Callable[[int, int], Callable[[int], object]] | None = None,
    sources: Sequence[str] = (),
) -> IndexReport:
    """Index documents already read (see index_sources); `sources` are the paths they came
    from, which the store may not be or hold."""
    started = time.perf_counter()
    info = StoreInfo(encoder.name, encoder.dim, chunk_tokens, overlap)
    store = Store.create_or_open(location, info, sources)
    chunks = {}
    for document in documents:
        for chunk in chunk_document(document, encoder.tokenizer, chunk_tokens, overlap):
            chunks.setdefault(chunk.id, chunk)
    known = store.known_ids()
    todo = [c for c in chunks.values() if c.id not in known]
    update = progress(len(todo), len(chunks) - len(todo)) if progress else None
    for start in range(0, len(todo), write_batch):
        batch = todo[start : start + write_batch]
        vectors = encoder.encode([c.text for c in batch], batch_size, update)
        store.add(batch, vectors)
        if not store.has_keyword_index():  # from the first write on, readers can search it
            store.build_keyword_index()  # (rows written later are searched without it)
    if todo or not store.has_keyword_index():
        store.build_indexes()
    return IndexReport(
        location,
        len(documents),
        len(chunks),
        len(todo),
        store.count(),
        time.perf_counter() - started,
    )
