"""The lab's claims 27-31 (seq2seq bottleneck, attention dilution, in-context learning, BERT vs
GPT classification, regurgitation): their computing pieces against hand loops, closed forms and
the uncached forward, and each experiment in its tiny mode."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import tiny_model

from glassformer.config import ModelConfig
from glassformer.inspect.capture import capture
from glassformer.lab import exp_attention_dilution as dilution
from glassformer.lab import exp_bert_vs_gpt_classification as classify
from glassformer.lab import exp_in_context_learning as icl
from glassformer.lab import exp_regurgitation as regurgitation
from glassformer.lab import exp_seq2seq_bottleneck as bottleneck
from glassformer.lab import name_tagging as tagging
from glassformer.tokenizers import CharTokenizer

MODEL = dict(vocab_size=40, n_heads=2, max_seq_len=128, init_std=0.2, scale=1)


# --- 27 seq2seq bottleneck ----------------------------------------------------------------------


def test_copy_batch_feeds_the_decoder_the_target_shifted_right() -> None:
    batch = bottleneck.copy_batch(3, 5, torch.Generator().manual_seed(0))
    assert torch.equal(batch["targets"], batch["src_ids"])
    assert (batch["tgt_ids"][:, 0] == bottleneck.BOS).all()
    assert torch.equal(batch["tgt_ids"][:, 1:], batch["src_ids"][:, :-1])


def test_fixed_vector_and_attention_models_have_the_same_parameters() -> None:
    fixed, attention = bottleneck.GRUSeq2Seq(16, False), bottleneck.GRUSeq2Seq(16, True)
    assert [p.shape for p in fixed.parameters()] == [p.shape for p in attention.parameters()]


def test_contexts_by_hand() -> None:
    torch.manual_seed(0)
    enc, dec = torch.randn(2, 5, 8), torch.randn(2, 3, 8)
    fixed = bottleneck.GRUSeq2Seq(8, False).context(dec, enc)
    assert torch.equal(fixed, enc[:, -1:].expand(2, 3, 8))  # the last encoder state everywhere
    attention = bottleneck.GRUSeq2Seq(8, True).context(dec, enc)
    for b in range(2):
        for t in range(3):
            scores = [float(dec[b, t] @ enc[b, s]) / math.sqrt(8) for s in range(5)]
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            expected = sum(w * enc[b, s] for s, w in enumerate(weights)) / sum(weights)
            torch.testing.assert_close(attention[b, t], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attention", [False, True])
def test_greedy_decoding_equals_rerunning_teacher_forcing(attention: bool) -> None:
    torch.manual_seed(1)
    model = bottleneck.GRUSeq2Seq(16, attention).eval()
    src = bottleneck.copy_batch(4, 6, torch.Generator().manual_seed(3))["src_ids"]
    greedy = model.greedy(src, 6)
    tgt = torch.full((4, 1), bottleneck.BOS)
    with torch.no_grad():
        for _ in range(6):  # the whole decoder input again at every step (the fused GRU path)
            tgt = torch.cat([tgt, model(src, tgt)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(greedy, tgt[:, 1:])


# --- 28 attention dilution ----------------------------------------------------------------------


def test_fixed_score_weight_is_a_softmax_row() -> None:
    for n_keys, delta in [(2, 0.0), (10, 1.5), (1000, 4.0)]:
        row = torch.softmax(torch.tensor([delta] + [0.0] * (n_keys - 1), dtype=torch.float64), 0)
        assert dilution.fixed_score_weight(n_keys, delta) == pytest.approx(float(row[0]))
    assert dilution.fixed_score_weight(30, dilution.delta_for(0.8, 30)) == pytest.approx(0.8)
    assert dilution.fixed_score_weight(10, 0.0) == pytest.approx(0.1)  # equal scores: 1/n


def test_prompt_reading_equals_the_uncached_forward() -> None:
    text = "the quick brown fox jumps over the lazy dog. " * 40
    tokenizer = CharTokenizer.from_text(text + "The password is 0123456789.\n")
    model = tiny_model(**MODEL | {"vocab_size": tokenizer.vocab_size})
    prompt = dilution.make_prompt(tokenizer.encode, text, 30, random.Random(0))
    reading = dilution.read_prompt(model, prompt, 20)
    ids = prompt.ids(20)
    full = torch.tensor([ids + prompt.answer])
    with capture(model, residual=False) as cap, torch.no_grad():
        logits = model(full)[0]
    query = len(ids) - 1  # the query's last token predicts the first digit
    for layer in range(2):
        row = cap.attention[layer][0, :, query]  # (H, T)
        torch.testing.assert_close(reading.needle_weight[layer], row[:, prompt.digits].sum(-1))
    logp = logits[query : query + len(prompt.answer)].log_softmax(-1)
    expected = sum(float(logp[i, t]) for i, t in enumerate(prompt.answer))
    assert reading.logprob == pytest.approx(expected, abs=1e-4)
    assert reading.n_keys == len(ids)
    assert tokenizer.decode(prompt.answer).strip().isdigit()


# --- 29 in-context learning ---------------------------------------------------------------------


def test_greedy_hit_with_a_cached_prefix_equals_the_whole_prompt() -> None:
    model = tiny_model(**MODEL)
    prefix, query = [1, 2, 3, 4, 5], [6, 7]
    with torch.no_grad():
        whole = model(torch.tensor([prefix + query]))[0]
        first = int(whole[-1].argmax())
        second = int(model(torch.tensor([prefix + query + [first]]))[0, -1].argmax())
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(torch.tensor([prefix]), torch.arange(len(prefix)), cache=cache)
    assert icl.greedy_hit(model, cache, len(prefix), query, [first, second])
    # the next query is written over this one: a wrong answer after it is still judged alone
    assert not icl.greedy_hit(model, cache, len(prefix), query, [first, (second + 1) % 40])
    assert icl.greedy_hit(model, cache, len(prefix), query, [first, second])
    assert icl.greedy_hit(model, None, 0, prefix + query, [first, second])


def test_examples_and_queries_never_overlap() -> None:
    for draw in range(3):
        pool, queries = icl.split_task(icl.TASKS["antonym"], draw)
        assert len(pool) == icl.POOL and not set(pool) & set(queries)
    assert icl.format_examples([("hot", "cold"), ("up", "down")]) == "hot -> cold\nup -> down\n"


def test_parameter_digest_sees_a_changed_weight() -> None:
    model = tiny_model(**MODEL)
    before = icl.parameter_digest(model)
    assert icl.parameter_digest(model) == before
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    assert icl.parameter_digest(model) != before


# --- 30 BERT vs GPT -----------------------------------------------------------------------------


def test_twins_differ_only_in_the_mask() -> None:
    cfg = ModelConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2, max_seq_len=9,
                      norm_position="pre")  # fmt: skip
    models = classify.twin_taggers(cfg, seed=0)
    gpt, bert = models["GPT (causal)"].eval(), models["BERT (bidirectional)"].eval()
    gpt_state, bert_state = gpt.state_dict(), bert.state_dict()
    assert set(gpt_state) - {"body.lm_head.weight"} == set(bert_state)
    assert all(torch.equal(bert_state[k], gpt_state[k]) for k in bert_state)
    ids = torch.randint(0, 20, (3, 9))
    with torch.no_grad():
        # one token: no future to hide, the same network tags it the same
        torch.testing.assert_close(gpt(ids[:, :1]), bert(ids[:, :1]))
        # causal: GPT's tag of position 3 is the same whether later characters follow or not;
        # BERT's tag of position 0 changes when they are dropped (it reads both sides)
        torch.testing.assert_close(gpt(ids[:, :4])[:, -1], gpt(ids)[:, 3])
        assert not torch.allclose(bert(ids[:, :4])[:, 0], bert(ids)[:, 0])


def test_names_are_headers_never_written_in_lower_case() -> None:
    plays = ["HELENA.\nI love Helena and the king.\n\nKING.\nAway, [Exit HELENA.] Helena!"]
    names = tagging.speaker_names(plays)
    assert names == frozenset({"Helena"})  # "king" is written in lower case: a role
    text = tagging.dialogue(plays[0])
    assert text == "I love Helena and the king. Away, Helena!"
    expected = [0] * len(text)
    for start in (7, 34):  # "I love |Helena| and the king. Away, |Helena|!"
        expected[start : start + 6] = [1] * 6
    assert tagging.name_tags(text, names) == expected


def test_f1_and_the_three_readings_by_hand() -> None:
    gold = torch.tensor([True, True, False, False])
    assert classify.f1(torch.tensor([True, False, True, False]), gold) == 2 * 1 / (2 + 2)
    assert classify.f1(torch.zeros(4, dtype=torch.bool), gold) == 0.0
    # one window of 6 characters, words [0, 3) and [3, 6): logits favour "name" at 0 and at 5
    logits = torch.tensor([[0.0, 3], [2, 0], [2, 0], [2, 0], [2, 0], [0, 3]])
    words = torch.tensor([[0, 3], [3, 6]])
    predicted, kept = classify.readings(logits, words, length=6)
    assert kept.tolist() == words.tolist()
    assert predicted["first character"].tolist() == [True, False]
    assert predicted["last character"].tolist() == [False, True]
    # means: word 0 (3 - 4) / 3 vs 4 / 3 -> not a name; word 1 likewise
    assert predicted["mean over the word"].tolist() == [False, False]


def test_the_reading_taken_during_training_is_the_model_then_and_changes_nothing() -> None:
    # train_and_score reads the validation F1 on the way (every step here): a reading
    # is that of a model trained that far (the same twin trained only that many steps of the
    # same schedule's batches gives it), and the run's losses are those of training unwatched.
    text = "I love Helena and the king. Away, Parolles! " * 60
    names = frozenset({"Helena", "Parolles"})
    tokenizer = CharTokenizer.from_text(text)
    split = tagging.Split(torch.tensor(tokenizer.encode(text)),
                           torch.tensor(tagging.name_tags(text, names)),
                           tagging.word_spans(text))  # fmt: skip
    data = tagging.NameData(tokenizer, names, {"train": split, "val": split, "test": split})
    size = classify.Sizes(None, 24, 16, 1, 12, 8, 6)
    assert classify.plateau_steps(size) == list(range(1, 13))
    run = classify.train_and_score(data, size, seed=3)
    gpt = "GPT (causal)"
    cfg = ModelConfig(vocab_size=tokenizer.vocab_size, d_model=16, n_layers=1, n_heads=2,
                      max_seq_len=24, position="learned", norm="layer", norm_position="pre",
                      ffn="gelu")  # fmt: skip
    schedule = classify.Schedule(max_steps=12, learning_rate=2e-3, warmup_steps=3,
                                 weight_decay=0.0)  # fmt: skip
    batch = tagging.batches(split, 8, 24, seed=3)
    model, snapshot = classify.twin_taggers(cfg, seed=3)[gpt], {}

    def batch_and_copy(step: int):
        if step == 8:  # the weights after 8 steps, read only after training ends
            snapshot.update({k: v.clone() for k, v in model.state_dict().items()})
        return batch(step)

    assert classify.fit(model, batch_and_copy, schedule) == run[gpt]["losses"]
    then = classify.twin_taggers(cfg, seed=3)[gpt]
    then.load_state_dict(snapshot)
    assert run[gpt]["val_curve"][8] == classify.reading_f1(then, split, 24)
    assert run[gpt]["val"] == run[gpt]["val_curve"][12] == classify.reading_f1(model, split, 24)
    unwatched = classify.twin_taggers(cfg, seed=3)[gpt]
    assert classify.fit(unwatched, batch, schedule) == run[gpt]["losses"]


def test_name_windows_hold_a_name_and_their_tags() -> None:
    text = "I love Helena and the king. " * 40
    names = frozenset({"Helena"})
    tokenizer = CharTokenizer.from_text(text)
    split = tagging.Split(torch.tensor(tokenizer.encode(text)),
                           torch.tensor(tagging.name_tags(text, names)),
                           tagging.word_spans(text))  # fmt: skip
    batch = tagging.window_batch(split, 64, 24, torch.Generator().manual_seed(0))
    for ids, targets in zip(batch["input_ids"], batch["targets"], strict=True):
        window = tokenizer.decode(ids.tolist())
        assert window in text
        at = text.index(window)
        assert targets.tolist() == tagging.name_tags(text, names)[at : at + len(window)]
    assert (batch["targets"].sum(dim=1) > 0).float().mean() >= 0.3  # NAME_SHARE places names


# --- 31 regurgitation ---------------------------------------------------------------------------


def test_verbatim_counts_by_hand() -> None:
    assert regurgitation.verbatim_chars("Thou art more", "Thou art less") == 9
    assert regurgitation.verbatim_chars("", "abc") == 0
    reference = "that all men are created equal, that they"
    assert regurgitation.verbatim_words("That all men, are created EQUAL that we", reference) == 7
    assert regurgitation.verbatim_words("all men", reference) == 0
    assert regurgitation.words("To be,--that is") == ["to", "be", "that", "is"]


def test_famous_texts_read_from_the_plays() -> None:
    texts = {name: (opening, sentence) for name, opening, sentence in regurgitation.famous_texts()}
    assert texts["Sonnet 18"][1].startswith("Thou art more lovely and more temperate:")
    assert texts["Hamlet III.1"][1].startswith("Whether 'tis nobler in the mind to suffer")
