"""The encoder-decoder (seed 000 §6.1): who sees what, cached decoding, greedy and beam search,
label smoothing, a small task that trains, and parity with Hugging Face BART and T5."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import glassformer as gf
from glassformer.config import ConfigError, ModelConfig
from glassformer.infer.seq2seq_decode import (
    beam_hypotheses,
    beam_search,
    greedy_decode,
    sequence_score,
)
from glassformer.interop.convert import convert_to_hf
from glassformer.interop.hf import InteropError, save_hf_model
from glassformer.models import build_model
from glassformer.models.seq2seq import Seq2Seq, label_smoothed_cross_entropy
from glassformer.train.checkpoint import save_checkpoint

VOCAB = 13
START, EOS = 1, 2

VARIANTS = {
    # the paper: post-norm, sinusoidal positions, scaled shared embeddings
    "paper": dict(position="sinusoidal", norm_position="post"),
    "pre-norm-separate-embeddings": dict(
        position="learned", norm_position="pre", share_embeddings=False, tie_embeddings=False
    ),
    "t5-like": dict(
        position="relative", norm="rms", ffn="geglu_tanh", attention_scale=1.0, n_kv_heads=2
    ),
    "bart-like": dict(
        position="learned", position_offset=2, norm_position="post", embedding_norm=True,
        bias=True, lm_head_bias=True, scale_embeddings=True,
    ),
    "rope": dict(position="rope"),
}  # fmt: skip


def _model(init_std: float = 0.2, **kw: Any) -> Seq2Seq:
    base = dict(
        family="seq2seq", vocab_size=VOCAB, d_model=32, n_layers=2, n_encoder_layers=3,
        n_heads=4, max_seq_len=32, bos_token_id=START, eos_token_id=EOS, init_std=init_std,
    )  # fmt: skip
    return build_model(ModelConfig(**(base | kw))).eval()


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, VOCAB, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    return src, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_encoder_sees_both_directions(variant: str) -> None:
    model = _model(**VARIANTS[variant])
    src = torch.randint(3, VOCAB, (1, 6))
    changed = src.clone()
    changed[0, -1] = 3 if src[0, -1] != 3 else 4
    with torch.no_grad():
        before, after = model.encode(src), model.encode(changed)
    # Every earlier position hears about the last token.
    assert (before[0, :-1] - after[0, :-1]).abs().amax(dim=-1).min() > 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_decoder_never_sees_the_future(variant: str) -> None:
    model = _model(**VARIANTS[variant])
    src = torch.randint(3, VOCAB, (1, 6))
    tgt = torch.randint(3, VOCAB, (1, 8))
    with torch.no_grad():
        memory = model.encode(src)
        base = model.decode(tgt, memory)
        for j in range(1, 8):
            changed = tgt.clone()
            changed[0, j] = 3 if tgt[0, j] != 3 else 4
            logits = model.decode(changed, memory)
            torch.testing.assert_close(logits[0, :j], base[0, :j], atol=1e-6, rtol=0)
            assert (logits[0, j] - base[0, j]).abs().max() > 1e-4


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_of_the_source_is_never_seen(variant: str) -> None:
    model = _model(**VARIANTS[variant])
    src, mask = _padded_batch()
    tgt = torch.randint(3, VOCAB, (2, 5))
    other_pads = src.clone()
    other_pads[1, 5:] = (src[1, 5:] + 1) % VOCAB
    with torch.no_grad():
        a = model(src, tgt, mask)
        b = model(other_pads, tgt, mask)
        unpadded = model(src[1:, :5], tgt[1:])
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    torch.testing.assert_close(a[1:], unpadded, atol=1e-5, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decoding_equals_uncached_at_every_step(variant: str) -> None:
    model = _model(**VARIANTS[variant])
    src, mask = _padded_batch()
    tgt = torch.randint(3, VOCAB, (2, 9))
    with torch.no_grad():
        full = model(src, tgt, mask)  # (B, T, V)
        memory = model.encode(src, mask)
        cache = model.new_cache(2, 16)
        prefill = model.decode(tgt[:, :3], memory, mask, cache=cache)  # a 3-token first chunk
        steps = [
            model.decode(tgt[:, t : t + 1], memory, mask, cache=cache, start=t) for t in range(3, 9)
        ]
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), full, atol=1e-5, rtol=0)


def test_cross_attention_keys_and_values_are_projected_once_per_source() -> None:
    model = _model()
    calls = []
    for block in model.decoder:
        block.cross_attn.kv_proj.register_forward_hook(lambda *_: calls.append(1))
    src, mask = _padded_batch()
    with torch.no_grad():
        memory = model.encode(src, mask)
        cache = model.new_cache(2, 16)
        for t in range(6):
            model.decode(torch.full((2, 1), START + t), memory, mask, cache=cache, start=t)
    assert len(calls) == len(model.decoder)  # once per layer, not once per step
    assert all(k is not None and k.shape == (2, 4, 7, 8) for k in cache.cross_attn.k)
    # Without a cache every decode call projects again.
    calls.clear()
    with torch.no_grad():
        model.decode(torch.full((2, 3), START), memory, mask)
        model.decode(torch.full((2, 4), START), memory, mask)
    assert len(calls) == 2 * len(model.decoder)


def test_greedy_equals_argmax_of_teacher_forced_logits_on_a_padded_batch() -> None:
    model = _model()
    src, mask = _padded_batch()
    out = greedy_decode(model, src, mask, max_new_tokens=10, eos_token_id=-1)
    for b in range(2):
        tgt = torch.tensor([[START, *out[b]]])
        length = int(mask[b].sum())
        with torch.no_grad():
            logits = model(src[b : b + 1, :length], tgt[:, :-1])
        assert logits[0].argmax(-1).tolist() == out[b]
    assert greedy_decode(model, src, mask, 10, eos_token_id=-1, use_cache=False) == out


def test_greedy_stops_each_row_at_eos() -> None:
    model = _model()
    src, mask = _padded_batch()
    free = greedy_decode(model, src, mask, max_new_tokens=6, eos_token_id=-1)
    eos = free[0][2]  # make the third token of row 0 the end token
    out = greedy_decode(model, src, mask, max_new_tokens=6, eos_token_id=eos)
    assert out[0] == free[0][: free[0].index(eos) + 1]
    cut = free[1].index(eos) + 1 if eos in free[1] else 6
    assert out[1] == free[1][:cut]


@pytest.mark.parametrize("variant", ["paper", "t5-like"])
def test_beam_size_one_equals_greedy(variant: str) -> None:
    model = _model(**VARIANTS[variant])
    for seed in range(3):
        torch.manual_seed(seed)
        src = torch.randint(3, VOCAB, (1, 6))
        greedy = greedy_decode(model, src, max_new_tokens=12, eos_token_id=5)[0]
        assert beam_search(model, src, beam_size=1, max_new_tokens=12, eos_token_id=5) == greedy


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_beam_search_with_cache_equals_without(length_penalty: float) -> None:
    model = _model()
    src = torch.randint(3, VOCAB, (1, 6))
    kw = dict(beam_size=4, length_penalty=length_penalty, max_new_tokens=10, eos_token_id=5)
    cached = beam_hypotheses(model, src, use_cache=True, **kw)
    uncached = beam_hypotheses(model, src, use_cache=False, **kw)
    assert [h.tokens for h in cached] == [h.tokens for h in uncached]
    for a, b in zip(cached, uncached, strict=True):
        assert a.score == pytest.approx(b.score, abs=1e-5)


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_scores_are_length_penalized_log_probs_and_beat_greedy(length_penalty: float) -> None:
    model = _model()
    for seed in range(3):
        torch.manual_seed(seed)
        src = torch.randint(3, VOCAB, (1, 6))
        greedy = greedy_decode(model, src, max_new_tokens=8, eos_token_id=5)[0]
        hyps = beam_hypotheses(
            model, src, beam_size=4, length_penalty=length_penalty, max_new_tokens=8,
            eos_token_id=5,
        )  # fmt: skip
        for h in hyps:  # the scores are what a teacher-forced pass says
            expected = sequence_score(model, src, h.tokens, length_penalty)
            assert h.score == pytest.approx(expected, abs=1e-4)
        assert hyps[0].score >= sequence_score(model, src, greedy, length_penalty) - 1e-6


@pytest.mark.parametrize("length_penalty", [1.0, 0.0, -0.5])
def test_wide_beam_search_equals_exhaustive_search(length_penalty: float) -> None:
    # Vocabulary of 4, at most 3 new tokens: 4 + 16 + 64 sequences, few enough to score all.
    model = _model(vocab_size=4, init_std=0.5)
    eos, n_new = 3, 3
    for seed in range(3):
        torch.manual_seed(seed)
        src = torch.randint(0, 4, (1, 5))
        candidates = [
            list(seq)
            for n in range(1, n_new + 1)
            for seq in itertools.product(range(4), repeat=n)
            if eos not in seq[:-1] and (seq[-1] == eos or n == n_new)  # ends at eos or the cap
        ]
        scores = {tuple(c): sequence_score(model, src, c, length_penalty) for c in candidates}
        best = max(scores, key=scores.get)
        found = beam_hypotheses(
            model, src, beam_size=64, length_penalty=length_penalty, max_new_tokens=n_new,
            eos_token_id=eos, early_stopping="never",
        )  # fmt: skip
        assert tuple(found[0].tokens) == best
        assert found[0].score == pytest.approx(scores[best], abs=1e-5)


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothed_loss_equals_the_closed_form(smoothing: float) -> None:
    logits = torch.randn(3, 5, 7) * 3
    targets = torch.randint(0, 7, (3, 5))
    targets[0, 3:] = -100
    loss, ce = label_smoothed_cross_entropy(logits, targets, smoothing)
    ref = F.cross_entropy(
        logits.view(-1, 7), targets.view(-1), ignore_index=-100, label_smoothing=smoothing
    )
    plain = F.cross_entropy(logits.view(-1, 7), targets.view(-1), ignore_index=-100)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(ce, plain)
    # By hand for one position: q = (1 - eps) one-hot + eps / V, loss = -sum q log p.
    p = logits[1, 2].softmax(-1)
    q = torch.full((7,), smoothing / 7)
    q[targets[1, 2]] += 1 - smoothing
    one, _ = label_smoothed_cross_entropy(logits[1:2, 2:3], targets[1:2, 2:3], smoothing)
    torch.testing.assert_close(one, -(q * p.log()).sum())


def test_model_loss_reports_smoothed_loss_and_plain_ce() -> None:
    model = _model(label_smoothing=0.1)
    src, mask = _padded_batch()
    tgt = torch.randint(3, VOCAB, (2, 6))
    targets = torch.randint(3, VOCAB, (2, 6))
    targets[1, 4:] = -100
    out = model.loss(src, tgt, targets, mask)
    logits = model(src, tgt, mask)
    flat, flat_targets = logits.view(-1, VOCAB), targets.view(-1)
    torch.testing.assert_close(
        out.loss, F.cross_entropy(flat, flat_targets, ignore_index=-100, label_smoothing=0.1)
    )
    torch.testing.assert_close(out.ce_loss, F.cross_entropy(flat, flat_targets, ignore_index=-100))


def test_shared_and_separate_embeddings() -> None:
    shared = _model()
    assert shared.dec_tok_emb is shared.tok_emb and shared.lm_head.weight is shared.tok_emb.weight
    separate = _model(share_embeddings=False, tie_embeddings=False)
    tables = {id(separate.tok_emb.weight), id(separate.dec_tok_emb.weight)}
    assert len(tables | {id(separate.lm_head.weight)}) == 3
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert n_params(separate) - n_params(shared) == 2 * VOCAB * 32


def test_sinusoidal_model_scales_embeddings_by_sqrt_d_model() -> None:
    model = _model(position="sinusoidal", norm_position="post")
    assert model.emb_scale == pytest.approx(32**0.5)
    assert _model(position="learned").emb_scale == 1.0


def test_config_errors_name_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"position='relative'.*family='seq2seq'"):
        ModelConfig(family="gpt", position="relative")
    with pytest.raises(ConfigError, match=r"label_smoothing=1.5 must be in \[0, 1\)"):
        ModelConfig(family="seq2seq", label_smoothing=1.5)
    model = _model(max_seq_len=8, position="learned")
    with pytest.raises(ValueError, match=r"more than max_seq_len=8"):
        model.encode(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match=r"beam search decodes one source at a time"):
        beam_search(model, torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.slow
def test_reverse_task_trains() -> None:
    # Reverse 6 random tokens: the decoder must read the source through cross-attention. The
    # paper's layout: post-norm, sinusoidal positions, one sqrt(d)-scaled table shared by the
    # encoder, the decoder and the output, label smoothing 0.1.
    model = _model(
        init_std=0.02, position="sinusoidal", norm_position="post", d_model=64,
        n_layers=2, n_encoder_layers=2, label_smoothing=0.1,
    )  # fmt: skip
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = torch.randint(3, VOCAB, (n, 6), generator=gen)
        tgt_in = torch.cat((torch.full((n, 1), START), src.flip(1)), dim=1)
        targets = torch.cat((src.flip(1), torch.full((n, 1), EOS)), dim=1)
        return src, tgt_in, targets

    for _ in range(200):
        out = model.loss(*batch(32))
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    model.eval()
    # Smoothed targets put 1 - eps + eps/V on the right token: the plain CE cannot go below
    # -log of that (0.097 here) however well the model has learned.
    floor = -math.log(1 - 0.1 + 0.1 / VOCAB)
    assert out.ce_loss.item() < floor + 0.05
    src, _, targets = batch(16)
    decoded = greedy_decode(model, src, max_new_tokens=10)
    assert sum(d == t for d, t in zip(decoded, targets.tolist(), strict=True)) >= 15


# --- Hugging Face parity: BART and T5 ---------------------------------------------------------

ATOL = 1e-4
HF_VOCAB = 96
N_NEW = 32


def _bart(**kw: Any) -> transformers.BartConfig:
    base = dict(
        vocab_size=HF_VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, init_std=0.2, dropout=0.0,
        forced_eos_token_id=None,
    )  # fmt: skip
    return transformers.BartConfig(**(base | kw))


def _t5(**kw: Any) -> transformers.T5Config:
    base = dict(
        vocab_size=HF_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
        relative_attention_max_distance=16, decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5Config(**(base | kw))


HF_CASES = {
    "bart": lambda: _bart(),
    "bart-scaled-embeddings": lambda: _bart(scale_embedding=True, activation_function="relu"),
    "bart-untied-head": lambda: _bart(tie_word_embeddings=False),
    "t5-relu-tied": lambda: _t5(),  # T5 v1.0: tied head, output * d_model**-0.5
    "t5-gated-gelu-untied": lambda: _t5(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
}
# transformers' T5 generate sizes its decoder cache by num_layers, so unequal depths are
# checked on the forward pass only.
FORWARD_ONLY_CASES = {
    "bart-deeper-encoder": lambda: _bart(encoder_layers=3, decoder_layers=1),
    "t5-deeper-decoder": lambda: _t5(
        num_layers=1, num_decoder_layers=3, feed_forward_proj="gated-gelu"
    ),
}


def _hf_pair(make, tmp_path) -> tuple[Any, Seq2Seq]:
    """A random transformers model saved offline, and glassformer's load of that folder."""
    hf_cfg = make()
    cls = (
        transformers.BartForConditionalGeneration
        if hf_cfg.model_type == "bart"
        else transformers.T5ForConditionalGeneration
    )
    hf = cls(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    if "lm_head.weight" not in _saved_names(tmp_path) and not _ties_head(hf):
        # transformers 5 ties T5's head whatever the config; a file with its own
        # lm_head.weight (T5 v1.1) unties it. Write one and reload the reference from the file.
        _add_tensor(tmp_path, "lm_head.weight", torch.randn(HF_VOCAB, hf_cfg.d_model))
        hf = cls.from_pretrained(tmp_path).eval()
    model, _ = gf.from_pretrained(tmp_path)
    return hf, model


def _saved_names(folder) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _ties_head(hf) -> bool:
    return hf.config.model_type == "bart" or hf.config.scale_decoder_outputs


def _add_tensor(folder, name: str, tensor: torch.Tensor) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    state[name] = tensor
    save_file(state, str(path), metadata={"format": "pt"})


def _padded_source() -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.randint(3, HF_VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    return src, mask


@pytest.mark.parametrize("case", HF_CASES | FORWARD_ONLY_CASES)
def test_hf_parity_encoder_states_and_decoder_logits(case: str, tmp_path) -> None:
    hf, model = _hf_pair((HF_CASES | FORWARD_ONLY_CASES)[case], tmp_path)
    src, mask = _padded_source()
    tgt = torch.randint(3, HF_VOCAB, (2, 7))
    tgt[:, 0] = model.decoder_start_token_id
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt)
        memory = model.encode(src, mask.bool())
        logits = model.decode(tgt, memory, mask.bool())
    torch.testing.assert_close(memory, ref.encoder_last_hidden_state, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref.logits, atol=ATOL, rtol=0)
    assert ref.logits.std() > 0.5  # not a degenerate model that any code would match


def _frequent_token(model: Seq2Seq, src: torch.Tensor) -> int:
    """A token greedy decoding produces early: as eos, it ends hypotheses at varied lengths."""
    first = greedy_decode(model, src, max_new_tokens=6, eos_token_id=-1)[0]
    return first[3]


@pytest.mark.parametrize("case", HF_CASES)
def test_hf_parity_greedy_generation(case: str, tmp_path) -> None:
    hf, model = _hf_pair(HF_CASES[case], tmp_path)
    src, mask = _padded_source()
    for eos in (None, _frequent_token(model, src[:1])):
        kw = dict(max_new_tokens=N_NEW, do_sample=False, num_beams=1)
        if eos is not None:
            kw |= dict(eos_token_id=eos, pad_token_id=eos)
        ref = hf.generate(input_ids=src, attention_mask=mask, **kw)
        ours = greedy_decode(model, src, mask.bool(), N_NEW, eos_token_id=eos)
        stop = hf.generation_config.eos_token_id if eos is None else eos
        for b in range(2):
            expected = ref[b, 1:].tolist()  # pads follow the end token of a finished row
            if stop in expected:
                expected = expected[: expected.index(stop) + 1]
            assert ours[b] == expected


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bart", "t5-relu-tied", "t5-gated-gelu-untied"])
def test_hf_parity_beam_search(case: str, tmp_path) -> None:
    # Two end tokens the model often produces, so hypotheses finish at varied lengths, and
    # every early-stopping rule of transformers (they pick different answers in some cases).
    hf, model = _hf_pair(HF_CASES[case], tmp_path)
    src, _ = _padded_source()
    src = src[:1]
    first = greedy_decode(model, src, max_new_tokens=6, eos_token_id=-1)[0]
    grid = itertools.product((first[1], first[3]), (1.0, 0.5, 0.0, 2.0), (False, True, "never"))
    for eos, length_penalty, early_stopping in grid:
        ref = hf.generate(
            input_ids=src, max_new_tokens=12, do_sample=False, num_beams=4, eos_token_id=eos,
            pad_token_id=eos, length_penalty=length_penalty, early_stopping=early_stopping,
        )  # fmt: skip
        ours = beam_search(
            model, src, beam_size=4, length_penalty=length_penalty, max_new_tokens=12,
            eos_token_id=eos, early_stopping=early_stopping,
        )  # fmt: skip
        assert ours == ref[0, 1:].tolist(), (eos, length_penalty, early_stopping)


@pytest.mark.parametrize(
    "kw",
    [
        dict(position="learned", position_offset=2, norm_position="post", embedding_norm=True,
             bias=True, scale_embeddings=True),
        dict(position="relative", norm="rms", norm_position="pre", ffn="geglu_tanh",
             attention_scale=1.0, output_scale=32**-0.5),
        dict(position="relative", norm="rms", norm_position="pre", ffn="relu",
             attention_scale=1.0, tie_embeddings=False),
        dict(position="relative", norm="rms", norm_position="pre", ffn="relu",
             attention_scale=1.0),  # tied, unscaled: written with a copy as lm_head.weight
    ],
    ids=["bart", "t5-tied-scaled", "t5-untied", "t5-tied-unscaled"],
)  # fmt: skip
def test_convert_to_hf_runs_in_transformers_with_the_same_logits(kw: dict, tmp_path) -> None:
    model = _model(vocab_size=HF_VOCAB, pad_token_id=0, **kw)
    save_hf_model(model, tmp_path)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    src, mask = _padded_source()
    tgt = torch.randint(3, HF_VOCAB, (2, 6))
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        ours = model(src, tgt, mask.bool())
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    back, _ = gf.from_pretrained(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(back(src, tgt, mask.bool()), ours, atol=1e-6, rtol=0)


def test_convert_names_what_hf_cannot_express(tmp_path) -> None:
    paper = _model(position="sinusoidal", norm_position="post")
    with pytest.raises(
        InteropError, match=r"no Hugging Face BART equivalent: position='sinusoidal'"
    ):
        save_hf_model(paper, tmp_path)


def test_checkpoint_converts_to_hf_with_zero_biases_added(tmp_path) -> None:
    # A BART-shaped model without biases: `convert --to hf` adds zero biases BART always has.
    cfg = _model(vocab_size=HF_VOCAB, position="learned", position_offset=2).cfg.replace(
        norm_position="post", embedding_norm=True, bias=False, pad_token_id=1
    )
    model = build_model(cfg).eval()
    save_checkpoint(tmp_path / "run", 1, model, cfg)
    loaded, _ = gf.from_pretrained(tmp_path / "run")
    report = convert_to_hf(tmp_path / "run", tmp_path / "hf")
    assert report.model_type == "bart"
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    src, mask = _padded_source()
    tgt = torch.randint(3, HF_VOCAB, (2, 6))
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        torch.testing.assert_close(loaded(src, tgt, mask.bool()), ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(model(src, tgt, mask.bool()), ref, atol=ATOL, rtol=0)
