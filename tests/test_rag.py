"""RAG (glassformer/rag/): chunks that are the documents' own text, vectors equal to `embed`'s,
a real vector database whose dense search equals exact cosine search, fusion by its formula,
and one-line errors and clean recovery for the faults a user meets."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import DEADLINE_S

from glassformer.data.corpus import shakespeare_works
from glassformer.infer.embed import embed
from glassformer.rag import (
    Document,
    Encoder,
    Store,
    StoreError,
    StoreInfo,
    chunk_document,
    fuse,
    index_sources,
    read_sources,
    search,
)
from glassformer.rag.documents import token_spans

FACTS = {
    "zorbania.txt": "The capital of Zorbania is Quillmoor, a city of glass towers.",
    "vessel.md": "# Ships\n\nThe fastest vessel of the Marrow fleet is the Saltwhistle.",
}


@pytest.fixture(scope="module")
def encoder() -> Encoder:
    torch.set_num_threads(1)
    return Encoder.load("minilm")


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """A folder of documents: two facts and a few thousand characters of Hamlet."""
    docs = tmp_path / "docs"
    (docs / "plays").mkdir(parents=True)
    for name, text in FACTS.items():
        (docs / name).write_text(text)
    hamlet = shakespeare_works("modern")["hamlet"]
    (docs / "plays" / "hamlet.txt").write_text(hamlet[20_000:26_000])
    return docs


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUST_LOG": "error", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "glassformer", *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=env,
        cwd=cwd,
    )


# --- chunks ---------------------------------------------------------------------------------


def test_chunks_are_the_documents_own_text_whole_words_and_overlap_as_asked(encoder):
    text = shakespeare_works("modern")["sonnets"][:6000]
    chunks = chunk_document(Document("sonnets", text), encoder.tokenizer, 40, 10)
    assert len(chunks) > 5
    hf = encoder.tokenizer.hf  # the Hugging Face tokenizer, read here as the reference
    for before, chunk in itertools.pairwise(chunks):
        assert chunk.text == text[chunk.start : chunk.end]
        assert len(hf.encode(chunk.text, add_special_tokens=False).ids) == chunk.tokens
        assert 40 <= chunk.tokens <= 48  # widened to whole words by a few pieces at most
        cuts = [text[at - 1 : at + 1] for at in (chunk.start, chunk.end)]
        assert not any(len(c) == 2 and c.isalnum() for c in cuts), cuts  # never mid-word
        shared = text[chunk.start : before.end]  # the characters both chunks cover
        assert len(hf.encode(shared, add_special_tokens=False).ids) >= 10
    body = text.strip()  # the first token starts, and the last ends, at non-space characters
    assert chunks[0].start == len(text) - len(text.lstrip())
    assert chunks[-1].end == len(text.rstrip())
    stitched = "".join(text[max(b.end, c.start) : c.end] for b, c in itertools.pairwise(chunks))
    assert chunks[0].text + stitched == body
    assert len({c.id for c in chunks}) == len(chunks)
    again = chunk_document(Document("sonnets", text), encoder.tokenizer, 40, 10)
    assert [c.id for c in again] == [c.id for c in chunks]


def test_sources_read_files_folders_and_corpora_and_name_what_they_skip(corpus):
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (corpus / "image.png").write_bytes(b"\x89PNG")
    skipped = []
    docs = list(read_sources([str(corpus)], skipped))
    assert sorted(Path(d.source).name for d in docs) == ["hamlet.txt", "vessel.md", "zorbania.txt"]
    assert [Path(s.source).name for s in skipped] == ["latin1.txt"]
    assert "not UTF-8" in skipped[0].reason
    works = list(read_sources(["shakespeare:folio"]))
    assert len(works) > 30 and works[0].source.startswith("shakespeare:folio/")
    with pytest.raises(ValueError, match="no-such-file is not a file, a folder or an installed"):
        list(read_sources(["no-such-file"]))


@pytest.mark.parametrize("chunk_tokens, overlap", [(0, 0), (16, 16), (16, -1)])
def test_bad_chunking_is_an_error_naming_the_flag(encoder, chunk_tokens, overlap):
    with pytest.raises(ValueError, match=r"--chunk-tokens|--overlap"):
        chunk_document(Document("d", "some text"), encoder.tokenizer, chunk_tokens, overlap)


# --- vectors --------------------------------------------------------------------------------


def test_encoder_vectors_equal_embed_one_sequence_at_a_time(encoder):
    texts = ["a", "The capital of Zorbania is Quillmoor.", "word " * 600, "to be or not to be"]
    vectors = encoder.encode(texts, batch_size=3)  # sorted by length, padded, then put back
    for text, vector in zip(texts, vectors, strict=True):
        ids = encoder.tokenizer.encode(text)
        if len(ids) > encoder.model.cfg.max_seq_len:  # embed's cut: keep the closing [SEP]
            ids = ids[: encoder.model.cfg.max_seq_len - 1] + ids[-1:]
        alone = embed(encoder.model, [ids])[0].numpy()
        np.testing.assert_allclose(vector, alone, atol=2e-5)
        assert abs(np.linalg.norm(vector) - 1) < 1e-5


# --- the store ------------------------------------------------------------------------------


def test_dense_search_equals_exact_cosine_search_over_the_stored_vectors(corpus, tmp_path, encoder):
    report = index_sources([str(corpus)], str(tmp_path / "kb"), encoder, chunk_tokens=24, overlap=6)
    assert report.added == report.chunks == report.total > 30
    store = Store.open(str(tmp_path / "kb"))
    rows = store.table.to_arrow().to_pylist()
    vectors = np.array([r["vector"] for r in rows], dtype=np.float32)
    for question in ["Who is the capital of Zorbania?", "the ghost walks at midnight"]:
        q = encoder.encode([question])[0]
        exact = np.argsort(-(vectors @ q))[:5]  # numpy: the reference
        hits = search(store, encoder, question, 5, "dense")
        assert [h.chunk["id"] for h in hits] == [rows[i]["id"] for i in exact]
        np.testing.assert_allclose([h.score for h in hits], (vectors @ q)[exact], atol=1e-5)
    best = search(store, encoder, "capital of Zorbania", 1, "bm25")[0]
    assert "Quillmoor" in best.chunk["text"]
    fused = search(store, encoder, "fastest vessel of the Marrow fleet", 3, "fused")
    assert "Saltwhistle" in fused[0].chunk["text"] and set(fused[0].ranks) == {"dense", "bm25"}


def test_fusion_is_the_sum_of_reciprocal_ranks():
    a, b, c = ({"id": x} for x in "abc")
    hits = fuse({"dense": [(a, 0.9), (b, 0.8)], "bm25": [(b, 7.0), (c, 3.0), (a, 1.0)]})
    scores = {h.chunk["id"]: h.score for h in hits}
    assert scores == pytest.approx({"a": 1 / 61 + 1 / 63, "b": 1 / 62 + 1 / 61, "c": 1 / 62})
    assert [h.chunk["id"] for h in hits] == ["b", "a", "c"]
    assert hits[0].ranks == {"dense": 2, "bm25": 1}


def test_indexing_again_adds_only_new_chunks(corpus, tmp_path, encoder):
    store = str(tmp_path / "kb")
    first = index_sources([str(corpus)], store, encoder, chunk_tokens=32, overlap=8)
    again = index_sources([str(corpus)], store, encoder, chunk_tokens=32, overlap=8)
    assert again.added == 0 and again.total == first.total
    reader = Store.open(store, refresh_s=0)  # open before the new chunk is written
    (corpus / "more.txt").write_text("Quillmoor's glass towers were built in the year 1312.")
    more = index_sources([str(corpus)], store, encoder, chunk_tokens=32, overlap=8)
    assert reader.count() == first.total + 1  # a reader that stays open sees the new version
    assert (more.added, more.total) == (1, first.total + 1)
    ids = Store.open(store).table.to_arrow()["id"].to_pylist()
    assert len(ids) == len(set(ids))


def test_a_store_of_another_encoder_or_chunking_is_refused_naming_both(corpus, tmp_path, encoder):
    other = StoreInfo("other-encoder", 8, 32, 8)
    Store.create_or_open(str(tmp_path / "kb"), other).add([], np.zeros((0, 8)))
    with pytest.raises(
        StoreError,
        match=r"built with --embed-model other-encoder \(8 dims\).*"
        r"minilm \(384 dims\)",
    ):
        index_sources([str(corpus)], str(tmp_path / "kb"), encoder, chunk_tokens=32, overlap=8)
    index_sources([str(corpus)], str(tmp_path / "kb2"), encoder, chunk_tokens=32, overlap=8)
    with pytest.raises(StoreError, match="--chunk-tokens 32 --overlap 8, this run asks for"):
        index_sources([str(corpus)], str(tmp_path / "kb2"), encoder, chunk_tokens=64, overlap=8)


def test_stores_that_cannot_answer_are_one_line_errors(corpus, tmp_path):
    model_folder = tmp_path / "model"
    model_folder.mkdir()
    (model_folder / "model.safetensors").write_bytes(b"x")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["rag", "search", "--store", str(tmp_path / "nope"), "q"], "does not exist: build it"),
        (["rag", "search", "--store", str(empty), "q"], "holds no chunks table"),
        (["rag", "index", str(corpus), "--store", str(model_folder)], "not a glassformer store"),
        (["rag", "index", str(corpus), "--store", str(corpus / "kb")], "which this command reads"),
        (
            ["rag", "index", str(tmp_path / "missing.txt"), "--store", str(tmp_path / "kb")],
            "missing.txt is not a file, a folder or an installed corpus",
        ),
    ]
    for argv, message in cases:
        done = cli(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert message in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in model_folder.iterdir()) == ["model.safetensors"]
    assert not (corpus / "kb").exists()


def test_a_reader_during_index_and_a_kill_9_then_a_rerun_that_finishes_it(corpus, tmp_path):
    hamlet = shakespeare_works("modern")["hamlet"]
    (corpus / "plays" / "hamlet.txt").write_text(hamlet[:60_000])
    store = tmp_path / "kb"
    argv = [
        "rag",
        "index",
        str(corpus),
        "--store",
        str(store),
        "--chunk-tokens",
        "16",
        "--overlap",
        "4",
        "--write-batch",
        "64",
        "--threads",
        "1",
        "--quiet",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RUST_LOG": "error"}
    child = subprocess.Popen([sys.executable, "-m", "glassformer", *argv], env=env)
    data = store / "chunks.lance" / "data"
    deadline = time.monotonic() + DEADLINE_S
    while not (data.is_dir() and len(list(data.iterdir())) >= 2):  # two writes landed
        assert child.poll() is None and time.monotonic() < deadline, "index ended too early"
        time.sleep(0.05)
    reader = cli("rag", "search", "--store", str(store), "capital of Zorbania", "--json")
    assert reader.returncode == 0, reader.stderr  # a second process reads while one writes
    assert child.poll() is None, "index ended before the reader finished: grow the corpus"
    child.send_signal(signal.SIGKILL)
    child.wait()
    partial = Store.open(str(store)).count()
    assert partial >= 128
    done = cli(*argv)
    assert done.returncode == 0, done.stderr
    ids = Store.open(str(store)).table.to_arrow()["id"].to_pylist()
    encoder = Encoder.load("minilm")
    expected = {
        c.id
        for d in read_sources([str(corpus)])
        for c in chunk_document(d, encoder.tokenizer, 16, 4)
    }
    assert len(ids) == len(set(ids)) and set(ids) == expected and partial < len(ids)
    assert f"{partial} chunks already in" in done.stderr


def test_search_json_and_token_spans_name_the_source(corpus, tmp_path, encoder):
    index_sources([str(corpus)], str(tmp_path / "kb"), encoder, chunk_tokens=32, overlap=8)
    done = cli("rag", "search", "--store", str(tmp_path / "kb"), "capital of Zorbania", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    top = out["sources"][0]
    assert top["source"].endswith("zorbania.txt") and "Quillmoor" in top["text"]
    text = FACTS["zorbania.txt"]
    assert text[top["span"][0] : top["span"][1]] == top["text"]
    assert token_spans(encoder.tokenizer, "ab cd")[-1] == (3, 5)


# --- answering -------------------------------------------------------------------------------


def test_ask_cites_the_retrieved_fact_and_reports_what_the_model_saw(corpus, tmp_path, encoder):
    from glassformer.interop.pretrained import from_pretrained

    index_sources([str(corpus)], str(tmp_path / "kb"), encoder, chunk_tokens=64, overlap=16)
    question = "What is the capital of Zorbania?"
    base = [
        "rag",
        "ask",
        "--store",
        str(tmp_path / "kb"),
        question,
        "--model",
        "smollm2",
        "--max-new-tokens",
        "12",
        "--threads",
        "1",
        "--context-tokens",
        "300",
    ]
    done = cli(*base, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "Quillmoor" in out["answer"]
    assert out["sources"][0]["source"].endswith("zorbania.txt")
    _, tokenizer = from_pretrained("smollm2")
    context = (
        "Sources:\n\n"
        + "".join(f"[{s['n']}] ({s['source']})\n{s['text']}\n\n" for s in out["sources"])
        + f"Question: {question}"
    )
    assert len(tokenizer.encode(context, add_special_tokens=False)) <= 300
    from glassformer.rag.answer import SYSTEM

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": context}]
    prompt = tokenizer.encode_chat(messages, add_generation_prompt=True)
    assert out["usage"]["prompt_tokens"] == len(prompt)
    assert 0 < out["usage"]["completion_tokens"] <= 12
    assert 0 < out["time_to_first_token_s"] < out["total_s"]
    shown = cli(*base, "--show-context")
    assert shown.returncode == 0, shown.stderr
    assert context in shown.stdout
    stuffed = json.loads(cli(*base, "--stuff", "--json").stdout)
    assert stuffed["sources"] == [] and stuffed["usage"]["prompt_tokens"] > 250


def test_a_question_longer_than_the_budget_is_one_line(corpus, tmp_path, encoder):
    index_sources([str(corpus)], str(tmp_path / "kb"), encoder, chunk_tokens=32, overlap=8)
    done = cli(
        "rag",
        "ask",
        "--store",
        str(tmp_path / "kb"),
        "why " * 400,
        "--model",
        "smollm2",
        "--context-tokens",
        "100",
        "--threads",
        "1",
    )
    assert done.returncode == 2
    assert "leaves no room for sources in --context-tokens 100" in done.stderr
    assert "Traceback" not in done.stderr


# --- the evaluation (rag/evaluate.py) --------------------------------------------------------


def test_the_evaluation_hides_invented_facts_whole_and_nothing_else_changes():
    from glassformer.data.corpus import shakespeare_plays
    from glassformer.rag.evaluate import build_corpus, invent_facts

    facts = invent_facts(24, seed=0)
    assert facts == invent_facts(24, seed=0) and len({f.question for f in facts}) == 24
    everything = " ".join(shakespeare_works("modern").values()).lower()
    for fact in facts:
        assert fact.answered_by(f"It is {fact.answer.upper()}!") and fact.answer in fact.sentence
        invented = [w for w in fact.sentence.split() if w[0].isupper() and w not in ("The",)]
        assert invented and all(w.strip(".").lower() not in everything for w in invented[:1])
    corpus = build_corpus(facts, 200_000)
    plays = list(shakespeare_plays("modern").values())
    original = "".join(plays)[:200_000]
    stripped = "".join(d.text for d in corpus.documents)
    for fact in facts:
        stripped = stripped.replace(fact.sentence + "\n", "", 1)
    assert stripped == original
    for fact, (doc, offset) in zip(facts, corpus.places, strict=True):
        assert corpus.documents[doc].text[offset:].startswith(fact.sentence + "\n")


def test_windows_around_a_fact_hold_it_and_decoder_vectors_ignore_padding():
    import random

    from glassformer.rag.evaluate import mean_pooled_vectors, window_around

    text = "word " * 500 + "The capital of Vapysk is Thaimix. " + "word " * 500
    spans = [(i, i + 4) for i in range(0, len(text), 5)]  # a stand-in tokenizer: 5 chars each
    at = text.index("The capital")
    for seed in range(20):
        first, last = window_around(list(range(len(spans))), spans, at, 100, random.Random(seed))
        assert last - first == 100 and spans[first][0] <= at < spans[last - 1][1]
    torch.manual_seed(0)
    from glassformer.config import ModelConfig
    from glassformer.models import build_model

    model = build_model(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4)).eval()
    sequences = [[1, 2, 3, 4, 5, 6], [7, 8]]
    together = mean_pooled_vectors(model, sequences, batch=2)
    for row, ids in enumerate(sequences):
        with torch.no_grad():
            alone = model.hidden_states(torch.tensor([ids]))[0].mean(dim=0)
        np.testing.assert_allclose(together[row], (alone / alone.norm()).numpy(), atol=1e-5)
