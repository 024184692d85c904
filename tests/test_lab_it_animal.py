"""Claim 15's pieces: the sign-test count is the binomial tail by hand, a pair's preference,
shift, resolution and top word are what hand-made attention rows give, and the "it" row read
from MiniLM is the one Hugging Face transformers returns."""

from __future__ import annotations

import pytest
import torch

from glassformer.lab import exp_it_animal
from glassformer.lab.exp_it_animal import SentencePair, pair_attention, sign_test_min


def test_sign_test_min_is_the_binomial_tail() -> None:
    # n = 11: P(>= 9) = (55 + 11 + 1) / 2048 = 0.0327 <= 0.05 < P(>= 8) = 232 / 2048 = 0.113
    assert sign_test_min(11) == 9
    assert sign_test_min(5) == 5  # 1/32 = 0.031
    assert sign_test_min(4) == 5  # even 4 of 4 (1/16) is not rare enough: no count suffices
    assert sign_test_min(11, alpha=0.2) == 8


def test_pair_attention_reads_preference_shift_and_top_word(monkeypatch) -> None:
    pair = SentencePair("dog", "jump over", "fence", "tired", "high")
    words = ["[cls]", "the", "dog", "x", "fence", "it", "y", "[sep]"]

    def row(dog: float, fence: float, special: float) -> list[float]:
        rest = (1 - dog - fence - 2 * special) / 4
        return [special, rest, dog, rest, fence, rest, rest, special]

    # 1 layer x 2 heads. Head 0 flips the right way; head 1 always prefers the dog and puts
    # most of its weight on [CLS], which is not a word of the sentence.
    rows = {
        "tired": torch.tensor([[row(0.5, 0.1, 0.05), row(0.3, 0.1, 0.4)]]),
        "high": torch.tensor([[row(0.1, 0.6, 0.05), row(0.25, 0.2, 0.4)]]),
    }

    def fake(model, tokenizer, sentence: str):
        return rows[sentence.split()[-1]], words

    monkeypatch.setattr(exp_it_animal, "it_attention", fake)
    found = pair_attention(None, None, pair)
    torch.testing.assert_close(found.prefer_first, torch.tensor([[0.4, 0.2]]))
    torch.testing.assert_close(found.prefer_second, torch.tensor([[-0.5, 0.05]]))
    torch.testing.assert_close(found.shift, torch.tensor([[0.9, 0.15]]))
    assert found.resolved.tolist() == [[True, False]]
    assert found.top_first.tolist() == [[True, True]]  # [CLS]'s 0.4 does not count
    assert found.top_second.tolist() == [[True, False]]


@pytest.mark.slow
def test_it_row_equals_transformers() -> None:
    import transformers

    from glassformer.interop.pretrained import from_pretrained, resolve

    model, tokenizer = from_pretrained("minilm")
    sentence = exp_it_animal.SELECTION.sentence("tired")
    weights, words = exp_it_animal.it_attention(model, tokenizer, sentence)
    hf = transformers.BertModel.from_pretrained(resolve("minilm"), attn_implementation="eager")
    ids = torch.tensor([tokenizer.encode(sentence)])
    with torch.no_grad():
        expected = hf(ids, output_attentions=True).attentions  # L x (1, H, T, T)
    query = words.index("it")
    assert words[query - 1] == "because" and words[2] == "animal"
    for layer, attention in enumerate(expected):
        torch.testing.assert_close(weights[layer], attention[0, :, query], atol=1e-5, rtol=1e-4)
