"""RAG at speed and scale (glassformer/rag/, docs/rag.md): indexing throughput against
sentence-transformers, and search latency and recall against exact numpy search.

1. Indexing: the same chunks of Shakespeare (--index-chunks of 128 MiniLM tokens) embedded by
   glassformer's Encoder and by sentence-transformers' SentenceTransformer on the same
   all-MiniLM-L6-v2 folder, same batch size, in alternating timed runs (median of --runs); the
   two sets of vectors are compared. Then the whole `index_documents` (chunk, embed, write to
   LanceDB, build the indexes) on the same text, chunks/s.
2. Search: real MiniLM vectors of --search-chunks chunks of 32 tokens from both spellings of
   Shakespeare (computed once, cached in --cache), in a LanceDB store of 10k and of 100k rows
   built as `rag index` builds it (exact below 10k rows, an IVF-HNSW index with 10 x k
   re-ranking from 10k on). 200 questions (single lines of the corpus, embedded): p50 and p99
   of `Store.dense(q, 10)` against exact numpy search (one matrix-vector product and a partial
   sort) over the same vectors, and recall@10 of the store against numpy's top 10. Memory: the
   store's bytes on disk per chunk, beside the 1,536 bytes of one fp32 vector.

    pip install -e '.[bench]'          # sentence-transformers, the reference
    python benchmarks/rag.py --threads 2
    python benchmarks/rag.py --index-chunks 400 --search-sizes 2000 --runs 1   # quick check
    python benchmarks/rag.py --runs 3 --json benchmarks/results/rag.json       # the docs'
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import record  # benchmarks/record.py
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RUST_LOG", "error")


def shakespeare_chunks(encoder, n: int, tokens: int, spellings=("modern",)) -> list[str]:
    from glassformer.data.corpus import shakespeare_works
    from glassformer.rag import Document, chunk_document

    texts = []
    for spelling in spellings:
        for name, text in shakespeare_works(spelling).items():
            document = Document(f"{spelling}/{name}", text)
            texts += [c.text for c in chunk_document(document, encoder.tokenizer, tokens, 8)]
            if len(texts) >= n:
                return texts[:n]
    return texts


def bench_indexing(encoder, args) -> dict:
    from sentence_transformers import SentenceTransformer

    from glassformer.interop.pretrained import resolve
    from glassformer.rag import Document, index_documents

    texts = shakespeare_chunks(encoder, args.index_chunks, 128)
    reference = SentenceTransformer(str(resolve("minilm")), device="cpu")
    ours_s, theirs_s = [], []
    for _ in range(args.runs):
        start = time.perf_counter()
        ours = encoder.encode(texts, batch_size=32)
        ours_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        theirs = reference.encode(texts, batch_size=32, normalize_embeddings=True)
        theirs_s.append(time.perf_counter() - start)
    differ = float(np.abs(ours - theirs).max())
    with tempfile.TemporaryDirectory() as folder:
        document = Document("corpus", "\n".join(texts))
        start = time.perf_counter()
        report = index_documents([document], f"{folder}/kb", encoder, chunk_tokens=128, overlap=0)
        whole = time.perf_counter() - start
    row = {
        "chunks": len(texts),
        "glassformer_chunks_per_s": len(texts) / statistics.median(ours_s),
        "sentence_transformers_chunks_per_s": len(texts) / statistics.median(theirs_s),
        "max_abs_difference": differ,
        "index_documents_chunks_per_s": report.added / whole,
    }
    row["ratio"] = row["glassformer_chunks_per_s"] / row["sentence_transformers_chunks_per_s"]
    print(
        f"indexing {row['chunks']} chunks of 128 tokens: glassformer "
        f"{row['glassformer_chunks_per_s']:.1f} chunks/s, sentence-transformers "
        f"{row['sentence_transformers_chunks_per_s']:.1f} ({row['ratio']:.2f}x); vectors differ "
        f"by at most {differ:.1e}; rag index end to end {row['index_documents_chunks_per_s']:.1f}"
        " chunks/s"
    )
    return row


def search_vectors(encoder, args) -> tuple[np.ndarray, np.ndarray]:
    """(vectors of the chunks, vectors of the questions), cached in --cache."""
    cache = Path(args.cache) / f"rag-bench-{max(args.search_sizes)}.npz"
    if cache.exists():
        saved = np.load(cache)
        return saved["vectors"], saved["questions"]
    from glassformer.data.corpus import shakespeare_works

    n = max(args.search_sizes)
    texts = shakespeare_chunks(encoder, n, 32, spellings=("modern", "folio"))
    if len(texts) < n:
        raise SystemExit(f"the corpus gives {len(texts)} chunks of 32 tokens, fewer than {n}")
    lines = [ln for t in shakespeare_works("modern").values() for ln in t.splitlines()]
    lines = [ln.strip() for ln in lines if len(ln.split()) >= 6]
    questions = random.Random(0).sample(lines, 200)
    print(f"embedding {n} chunks once (cached in {cache})")
    vectors = encoder.encode(texts, batch_size=64)
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, vectors=vectors, questions=encoder.encode(questions))
    saved = np.load(cache)
    return saved["vectors"], saved["questions"]


def bench_search(vectors: np.ndarray, questions: np.ndarray, size: int, args) -> dict:
    from glassformer.rag import Chunk, Store, StoreInfo

    subset = vectors[:size]
    folder = tempfile.mkdtemp(prefix="glassformer-rag-bench-")
    try:
        store = Store.create_or_open(f"{folder}/kb", StoreInfo("minilm", subset.shape[1], 32, 8))
        chunks = [Chunk(str(i), "bench", i, 0, 0, "", 32) for i in range(size)]
        for start in range(0, size, 20_000):
            store.add(chunks[start : start + 20_000], subset[start : start + 20_000])
        start = time.perf_counter()
        store.build_indexes()
        build_s = time.perf_counter() - start
        store = Store.open(f"{folder}/kb")
        kind = "IVF-HNSW-SQ, re-ranked" if store.has_vector_index() else "exact scan"
        disk = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
        ours, exact_s, hits = [], [], 0
        for _ in range(args.runs):
            for q in questions:
                start = time.perf_counter()
                top = np.argpartition(-(subset @ q), 10)[:10]
                exact_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                found = store.dense(q, 10)
                ours.append(time.perf_counter() - start)
                hits += len({int(c["id"]) for c, _ in found} & set(top.tolist()))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    row = {
        "chunks": size,
        "index": kind,
        "index_build_s": build_s,
        "store_p50_ms": float(np.percentile(ours, 50) * 1e3),
        "store_p99_ms": float(np.percentile(ours, 99) * 1e3),
        "numpy_p50_ms": float(np.percentile(exact_s, 50) * 1e3),
        "numpy_p99_ms": float(np.percentile(exact_s, 99) * 1e3),
        "recall_at_10": hits / (10 * len(questions) * args.runs),
        "disk_bytes_per_chunk": disk / size,
    }
    print(
        f"search at {size:,} chunks ({row['index']}): store p50 {row['store_p50_ms']:.2f} ms p99 "
        f"{row['store_p99_ms']:.2f} ms | numpy exact p50 {row['numpy_p50_ms']:.2f} ms p99 "
        f"{row['numpy_p99_ms']:.2f} ms | recall@10 {row['recall_at_10']:.3f} | "
        f"{row['disk_bytes_per_chunk']:.0f} B on disk per chunk"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--index-chunks", type=int, default=2000)
    parser.add_argument("--search-sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "glassformer"))
    parser.add_argument("--json", type=Path, help="write the run's rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from glassformer.rag import Encoder

    encoder = Encoder.load("minilm")
    indexing = bench_indexing(encoder, args)
    vectors, questions = search_vectors(encoder, args)
    search = [bench_search(vectors, questions, size, args) for size in args.search_sizes]
    if args.json:
        record.write(args.json, args.threads, {"runs": args.runs, "indexing": indexing,
                                                "search": search})  # fmt: skip


if __name__ == "__main__":
    main()
