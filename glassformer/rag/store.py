"""The vector database behind RAG: LanceDB, embedded in a folder by default, or any URI LanceDB
connects to (s3://..., gs://... object storage that many machines share; db://... a LanceDB
Cloud or Enterprise cluster) with the same code.

Why LanceDB (docs/rag.md has the measurements): an embedded store that concurrent readers can
open while it is written (a `serve --rag-store` and a `rag search` at once), whose every write
is an atomic new version (a kill -9 mid-write leaves the last version whole), with BM25
keyword search in the same table, and the same client for a distributed deployment. Milvus
Lite, the other embedded candidate, holds an exclusive lock on its folder: a second process
cannot open it at all.

One table, `chunks`: a row per chunk (id, source, index, span, text, tokens, vector). The
embedding model's name and dimension and the chunking are recorded in the table's schema, so
a store is never searched with vectors of another model.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from glassformer.files import check_destination
from glassformer.rag.documents import Chunk

TABLE = "chunks"
# Below this many chunks a search scans every vector (exact, and a few ms at this size); from
# here on the table gets an approximate index (IVF partitions of HNSW graphs over 8-bit
# vectors) whose candidates are re-ranked with the full vectors (REFINE x k of them).
ANN_MIN_ROWS = 10_000
NPROBES, REFINE = 20, 10
CHUNK_COLUMNS = ("id", "source", "chunk", "start", "end", "text", "tokens")  # a hit's fields
_META = "glassformer."


class StoreError(ValueError):
    """A store that cannot serve this request; the message names the store and the fix."""


@dataclass(frozen=True)
class StoreInfo:
    embed_model: str
    dim: int
    chunk_tokens: int
    overlap: int

    def metadata(self) -> dict[bytes, bytes]:
        return {f"{_META}{k}".encode(): str(v).encode() for k, v in vars(self).items()}

    @classmethod
    def from_metadata(cls, metadata: dict[bytes, bytes] | None) -> StoreInfo | None:
        fields = {
            k.decode()[len(_META) :]: v.decode()
            for k, v in (metadata or {}).items()
            if k.decode().startswith(_META)
        }
        if set(fields) != {"embed_model", "dim", "chunk_tokens", "overlap"}:
            return None
        return cls(
            fields["embed_model"],
            int(fields["dim"]),
            int(fields["chunk_tokens"]),
            int(fields["overlap"]),
        )


def is_uri(location: str) -> bool:
    return "://" in location


def _schema(info: StoreInfo):
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("id", pa.string()),
            pa.field("source", pa.string()),
            pa.field("chunk", pa.int32()),
            pa.field("start", pa.int64()),
            pa.field("end", pa.int64()),
            pa.field("text", pa.string()),
            pa.field("tokens", pa.int32()),
            pa.field("vector", pa.list_(pa.float32(), info.dim)),
        ],
        metadata=info.metadata(),
    )


class Store:
    """A connected store. `Store.open` for reading, `Store.create_or_open` for indexing."""

    def __init__(self, location: str, table, info: StoreInfo) -> None:
        self.location, self.table, self.info = location, table, info

    # --- opening ------------------------------------------------------------------------

    @classmethod
    def open(cls, location: str, refresh_s: float = 5.0) -> Store:
        """An existing store with at least one chunk, else a StoreError saying how to build it.
        A reader that stays open (a server) sees what another process writes within refresh_s
        seconds: LanceDB checks for a newer version of the table at most that often."""
        from datetime import timedelta

        import lancedb

        build = f"build it with `glassformer rag index FILES --store {location}`"
        if not is_uri(location) and not Path(location).is_dir():
            raise StoreError(f"--store {location} does not exist: {build}")
        db = lancedb.connect(location, read_consistency_interval=timedelta(seconds=refresh_s))
        if TABLE not in db.list_tables().tables:
            raise StoreError(f"--store {location} holds no chunks table: {build}")
        table = db.open_table(TABLE)
        info = StoreInfo.from_metadata(table.schema.metadata)
        if info is None:
            raise StoreError(
                f"--store {location} has a chunks table that glassformer did not write (no "
                f"embedding model recorded): {build} in a new folder"
            )
        store = cls(location, table, info)
        if store.count() == 0:
            raise StoreError(f"--store {location} has no chunks yet: {build}")
        return store

    @classmethod
    def create_or_open(cls, location: str, info: StoreInfo, sources: Sequence[str] = ()) -> Store:
        """The store to index into: created when missing; when it exists, it must have been
        built with the same embedding model (name and dimension) and chunking. A local store
        is never a source being indexed, inside one or holding one, and never a folder that
        holds something other than a store (a model, a run, documents)."""
        import lancedb

        if not is_uri(location):
            files = [s for s in sources if os.path.exists(s)]
            check_destination(location, files, flag="--store")
            folder = Path(location)
            is_store = (folder / f"{TABLE}.lance").is_dir()
            if folder.is_dir() and any(folder.iterdir()) and not is_store:
                raise StoreError(
                    f"--store {location} is a folder that is not a glassformer store (no "
                    f"{TABLE} table in it): name a new folder, e.g. {folder}-store"
                )
        db = lancedb.connect(location)
        if TABLE in db.list_tables().tables:
            table = db.open_table(TABLE)
        else:
            table = db.create_table(TABLE, schema=_schema(info), exist_ok=True)
        found = StoreInfo.from_metadata(table.schema.metadata)
        if found is None:
            raise StoreError(
                f"--store {location} has a chunks table that glassformer did not write: name a "
                "new store"
            )
        store = cls(location, table, found)
        store.check_encoder(info.embed_model, info.dim)
        if (found.chunk_tokens, found.overlap) != (info.chunk_tokens, info.overlap):
            raise StoreError(
                f"--store {location} was chunked with --chunk-tokens {found.chunk_tokens} "
                f"--overlap {found.overlap}, this run asks for --chunk-tokens "
                f"{info.chunk_tokens} --overlap {info.overlap}: use the store's settings or "
                "a new store"
            )
        return store

    def check_encoder(self, name: str, dim: int) -> None:
        """StoreError unless the store's vectors come from the encoder `name` of `dim` dims."""
        found = self.info
        if (found.embed_model, found.dim) != (name, dim):
            raise StoreError(
                f"--store {self.location} was built with --embed-model {found.embed_model} "
                f"({found.dim} dims), this run embeds with {name} ({dim} dims): pass "
                f"--embed-model {found.embed_model}, or index into a new store"
            )

    # --- writing ------------------------------------------------------------------------

    def known_ids(self) -> set[str]:
        n = self.count()
        if n == 0:
            return set()
        rows = self.table.search().select(["id"]).limit(n).to_arrow()
        return set(rows["id"].to_pylist())

    def add(self, chunks: Sequence[Chunk], vectors: np.ndarray) -> None:
        """Insert chunks whose id the store does not hold yet (a chunk already there is left
        as it is): running an interrupted index again finishes it without duplicates. Each
        call is one atomic version of the table."""
        import pyarrow as pa

        if len(chunks) != len(vectors):
            raise ValueError(f"{len(chunks)} chunks but {len(vectors)} vectors")
        if not chunks:
            return
        columns = {
            "id": [c.id for c in chunks],
            "source": [c.source for c in chunks],
            "chunk": [c.index for c in chunks],
            "start": [c.start for c in chunks],
            "end": [c.end for c in chunks],
            "text": [c.text for c in chunks],
            "tokens": [c.tokens for c in chunks],
        }
        schema = _schema(self.info)
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).ravel())
        arrays = [pa.array(v, type=schema.field(k).type) for k, v in columns.items()]
        arrays.append(pa.FixedSizeListArray.from_arrays(flat, self.info.dim))
        data = pa.Table.from_arrays(arrays, schema=schema)
        self.table.merge_insert("id").when_not_matched_insert_all().execute(data)

    def build_indexes(self) -> None:
        """BM25 keyword index over the text, and the vector index once the table is large
        (ANN_MIN_ROWS). Rebuilt whole, so they cover every chunk."""
        from lancedb.index import IvfHnswSq

        self.build_keyword_index()
        if self.count() >= ANN_MIN_ROWS:
            self.table.create_index(
                "vector", config=IvfHnswSq(distance_type="cosine"), replace=True
            )

    def build_keyword_index(self) -> None:
        from lancedb.index import FTS

        self.table.create_index("text", config=FTS(), replace=True)

    # --- reading ------------------------------------------------------------------------

    def count(self) -> int:
        return self.table.count_rows()

    def has_vector_index(self) -> bool:
        return any(ix.columns == ["vector"] for ix in self.table.list_indices())

    def dense(self, vector: np.ndarray, k: int) -> list[tuple[dict, float]]:
        """The k chunks nearest to a unit `vector` by cosine similarity, best first."""
        query = self.table.search(vector.astype(np.float32), vector_column_name="vector")
        # no vectors; the distance named, as LanceDB will want (else it warns on every search)
        query = query.distance_type("cosine").limit(k).select([*CHUNK_COLUMNS, "_distance"])
        if self.has_vector_index():
            query = query.nprobes(NPROBES).refine_factor(REFINE)
        rows = query.to_arrow().to_pylist()
        return [(_chunk(r), 1.0 - r["_distance"]) for r in rows]

    def has_keyword_index(self) -> bool:
        return any(ix.columns == ["text"] for ix in self.table.list_indices())

    def keyword(self, text: str, k: int) -> list[tuple[dict, float]]:
        """The k chunks with the highest BM25 score for `text`, best first."""
        if not self.has_keyword_index():
            raise StoreError(
                f"--store {self.location} has no keyword index (its indexing was cut short): "
                f"run the same `glassformer rag index ... --store {self.location}` again"
            )
        rows = self.table.search(text, query_type="fts", fts_columns="text").limit(k)
        rows = rows.select([*CHUNK_COLUMNS, "_score"])
        return [(_chunk(r), r["_score"]) for r in rows.to_arrow().to_pylist()]


def _chunk(row: dict) -> dict:
    return {k: row[k] for k in CHUNK_COLUMNS}
