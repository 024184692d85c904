"""Retrieve, then generate (seed 002's last chapter, 「RAG 系统入门 — 绕开 n² 的正解：先检索再喂」):
documents -> chunks (documents.py) -> an encoder's vectors (encoder.py) -> a vector database
(store.py: LanceDB) -> dense, BM25 or fused retrieval (retrieve.py) -> numbered sources in the
chat template within a token budget -> the engine (answer.py). docs/rag.md is the guide.
"""

from glassformer.rag.answer import Answer, ask, ask_stuffed, ask_text
from glassformer.rag.documents import Chunk, Document, chunk_document, read_sources
from glassformer.rag.encoder import Encoder
from glassformer.rag.index import IndexReport, index_documents, index_sources
from glassformer.rag.retrieve import Hit, fuse, search
from glassformer.rag.store import Store, StoreError, StoreInfo

__all__ = [
    "Answer",
    "Chunk",
    "Document",
    "Encoder",
    "Hit",
    "IndexReport",
    "Store",
    "StoreError",
    "StoreInfo",
    "ask",
    "ask_stuffed",
    "ask_text",
    "chunk_document",
    "fuse",
    "index_documents",
    "index_sources",
    "read_sources",
    "search",
]
