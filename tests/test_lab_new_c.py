"""The computing pieces of claims 32-36 (ffn-knowledge, embedding-distances, polysemy,
exercise-match-key, exercise-temperature), each against an independent reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import GPT2, tiny_model

from glassformer import numpy_ref
from glassformer.lab import exp_embedding_distances as emb
from glassformer.lab import exp_exercise_match_key as match_key
from glassformer.lab import exp_exercise_temperature as temp
from glassformer.lab import exp_ffn_knowledge as ffn
from glassformer.lab import exp_polysemy as poly

MODEL = dict(GPT2, vocab_size=50, n_layers=3, n_heads=2, max_seq_len=64, scale=1)


# --- exercise-match-key ---------------------------------------------------------------------


def test_seed_code_gives_the_libraries_worked_example() -> None:
    q, K, V = match_key.seed_q_k_v()
    _, weights, output = match_key.seed_attention(q, K, V)
    ref = numpy_ref.worked_example()
    np.testing.assert_allclose(weights, ref.weights, atol=1e-12)
    np.testing.assert_allclose(output, ref.output, atol=1e-12)


def test_suggested_key_leaves_cat_on_top_by_hand() -> None:
    # Dot products by hand: 猫 1.1+0.2+0.06+0.72 = 2.08, the suggested key 1+0.25+0.04+0.64 = 1.93.
    q, K, V = match_key.seed_q_k_v()
    _, weights, _ = match_key.seed_attention(
        q, match_key.with_key(K, 1, match_key.SUGGESTED_KEY), V
    )
    by_hand = np.exp([2.08 / 2, 1.93 / 2, 0.76 / 2])
    np.testing.assert_allclose(weights, by_hand / by_hand.sum(), atol=1e-12)
    assert weights[0] > weights[1]
    assert K[1].tolist() == [0.1, 0.9, 0.1, 0.0]  # with_key copies


def test_flip_scale_is_where_the_scores_tie() -> None:
    q, K, V = match_key.seed_q_k_v()
    direction = np.array(match_key.SUGGESTED_KEY)
    s = match_key.flip_scale(q, K, 1, direction, 0)
    assert s == pytest.approx(2.08 / 1.93)
    _, weights, _ = match_key.seed_attention(q, match_key.with_key(K, 1, s * direction), V)
    assert weights[1] == pytest.approx(weights[0])


# --- exercise-temperature -------------------------------------------------------------------


def test_temperature_probs_against_torch_softmax() -> None:
    logits = np.array([2.0, 1.0, -0.5, 0.0])
    expected = torch.softmax(torch.tensor(logits) / 1.2, -1).numpy()
    np.testing.assert_allclose(temp.temperature_probs(logits, 1.2), expected, atol=1e-12)
    assert temp.temperature_probs(logits, 0.0).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert temp.entropy_nats(np.full(8, 1 / 8)) == pytest.approx(math.log(8))


def test_hand_sampler_at_zero_is_the_greedy_loop_without_cache() -> None:
    model = tiny_model(**MODEL, init_std=1.0)
    prompt = [3, 7, 1, 4]
    _, rows = temp.hand_sample(model, prompt, [0.0, 0.0], n_new=5, seed=0, eos=None)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(5):  # the reference: rerun the whole sequence, take the argmax
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert rows[0]["ids"] == rows[1]["ids"] == ids[len(prompt) :]


def test_surprisals_equal_one_sequence_at_a_time() -> None:
    model = tiny_model(**MODEL)
    prompt, continuations = [1, 2, 3], [[4, 5], [6, 7, 8, 9]]
    got = temp.surprisals(model, prompt, continuations)
    for c, values in zip(continuations, got, strict=True):
        seq = torch.tensor([prompt + c])
        with torch.no_grad():
            log_p = torch.log_softmax(model(seq)[0].double(), -1)
        expected = [-float(log_p[len(prompt) - 1 + j, t]) for j, t in enumerate(c)]
        np.testing.assert_allclose(values, expected, atol=1e-5)


# --- embedding-distances ----------------------------------------------------------------------


def test_cosine_matrix_and_pairs_against_numpy() -> None:
    vectors = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, -2.0]])
    sims = emb.cosine_matrix(vectors)
    assert sims[0, 1] == pytest.approx(1 / math.sqrt(2))
    assert sims[0, 2] == pytest.approx(0.0)
    assert sims[1, 2] == pytest.approx(-1 / math.sqrt(2))
    assert sorted(emb.pair_similarities(sims).round(6)) == sorted(
        [round(1 / math.sqrt(2), 6), 0.0, round(-1 / math.sqrt(2), 6)]
    )


class _FakeTokenizer:
    def __init__(self) -> None:
        self.texts = {0: "[UNK]", 1: "cat", 2: "\ufffd"}

    def token_to_id(self, token: str) -> int | None:
        return 0 if token == "[UNK]" else None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.texts[i] for i in ids)


def test_unreadable_tokens_are_unknowns_and_byte_pieces() -> None:
    tok = _FakeTokenizer()
    assert emb.unreadable_tokens(tok, [1]) == []
    assert emb.unreadable_tokens(tok, [0, 1, 2]) == ["[UNK]", "<byte piece 2>"]


# --- polysemy -------------------------------------------------------------------------------


def test_sense_scores_on_hand_made_vectors() -> None:
    fruit, company = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    apples = torch.stack([fruit, fruit, company, company])
    near = {"fruit": torch.stack([fruit, fruit]), "company": torch.stack([company, company])}
    scores = poly.sense_scores(apples, near)
    assert scores["within"] == pytest.approx([1.0, 1.0])
    assert scores["cross"] == pytest.approx([0.0] * 4)
    assert scores["fruit: own"] == pytest.approx([1.0] * 4)
    assert scores["company: other"] == pytest.approx([0.0] * 4)


# --- ffn-knowledge ----------------------------------------------------------------------------


def test_zeroed_ffn_equals_a_block_without_its_ffn() -> None:
    model = tiny_model(**MODEL)
    ids = torch.tensor([[1, 2, 3, 4]])
    block = model.blocks[1]
    with torch.no_grad():
        x = model.tok_emb(ids)
        rope = model.rope(torch.arange(4)[None]) if model.rope is not None else None
        mask = model._attention_mask(torch.arange(4), torch.arange(4), None, None)
        # pre-norm by hand: x + attn(norm(x)), and no FFN term
        expected = x + block.attn(block.attn_norm(x), mask, rope)
        with ffn.zeroed([block.ffn]):
            got = block(x, mask, rope)
        restored = block(x, mask, rope)
    torch.testing.assert_close(got, expected)
    assert not torch.allclose(restored, expected)  # the hook is gone on exit


def test_answer_logprobs_in_a_padded_batch_equal_one_prompt_at_a_time() -> None:
    model = tiny_model(**MODEL)
    prompts, answers = [[1, 2], [3, 4, 5, 6]], [7, 8]
    got = ffn.answer_logprobs(model, prompts, answers)
    for p, a, value in zip(prompts, answers, got, strict=True):
        with torch.no_grad():
            log_p = torch.log_softmax(model(torch.tensor([p]))[0, -1].double(), -1)
        assert value == pytest.approx(float(log_p[a]), abs=1e-5)


def test_bands_cover_the_layers_once() -> None:
    windows = ffn.bands(30)
    assert [list(w) for w in windows][2] == list(range(12, 18))
    assert [i for w in ffn.bands(32) for i in w] == list(range(32))
