"""Attention capture, plots and `glassformer inspect attention` (issue 6; seed 000 §3.3, §4.2).

References: the softmax(QK^T/sqrt(D)) written out by hand from the module's weights, the
un-captured forward, a single full forward for a KV-cache generation, transformers'
output_attentions (a tiny Llama built offline; the real all-MiniLM-L6-v2), and the PNG format.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_llama_config

import glassformer as gf
from glassformer.cli import main
from glassformer.inspect import capture, find_token, plots, token_texts, top_attended
from glassformer.nn.position import apply_rope
from glassformer.tokenizers import CharTokenizer
from glassformer.train.checkpoint import save_checkpoint

PNG = b"\x89PNG\r\n\x1a\n"
VOCAB = 40


def _gpt(**kw) -> torch.nn.Module:
    base = dict(
        family="gpt", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
        max_seq_len=64, position="rope", norm="rms", ffn="swiglu", init_std=0.2,
        attention_backend="sdpa",
    )  # fmt: skip
    return gf.build_model(gf.ModelConfig(**(base | kw))).eval()


def _bert(**kw) -> torch.nn.Module:
    base = dict(
        family="bert", vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64,
        init_std=0.2,
    )  # fmt: skip
    return gf.build_model(gf.ModelConfig(**(base | kw))).eval()


def _seq2seq() -> torch.nn.Module:
    cfg = gf.ModelConfig(
        family="seq2seq", vocab_size=VOCAB, d_model=32, n_layers=2, n_encoder_layers=3,
        n_heads=4, max_seq_len=32, bos_token_id=1, eos_token_id=2, init_std=0.2,
    )  # fmt: skip
    return gf.build_model(cfg).eval()


def _by_hand(attn, x: torch.Tensor, rope) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + causal mask) from the module's fused weight, (B, H, T, T)."""
    B, T, _ = x.shape
    H, Hkv, D = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w = attn.qkv_proj.weight  # (H*D + 2*Hkv*D, C)
    q = (x @ w[: H * D].T).view(B, T, H, D).transpose(1, 2)
    k = (x @ w[H * D : (H + Hkv) * D].T).view(B, T, Hkv, D).transpose(1, 2)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k = k.repeat_interleave(H // Hkv, dim=1)  # GQA: each kv head serves H/Hkv query heads
    scores = q @ k.transpose(-2, -1) / math.sqrt(D)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    return scores.masked_fill(future, float("-inf")).softmax(dim=-1)


def test_gpt_capture_matches_hand_written_attention_and_is_causal():
    model = _gpt()
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad(), capture(model) as cap:
        model(ids)
    assert len(cap.attention) == 2
    rope = model.rope(torch.arange(9)[None])
    stream = model.tok_emb(ids)  # (B, T, C): the input of block 0
    for layer, block in enumerate(model.blocks):
        weights = cap.attention[layer]
        assert weights.shape == (2, 4, 9, 9)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 9))
        assert weights.triu(diagonal=1).abs().max() == 0  # nothing above the diagonal
        with torch.no_grad():
            expected = _by_hand(block.attn, block.attn_norm(stream), rope)
        torch.testing.assert_close(weights, expected, atol=1e-5, rtol=1e-5)
        assert cap.residual[layer].shape == (2, 9, 32)
        stream = cap.residual[layer]  # the next block reads this block's output
    with torch.no_grad():  # the last residual, normed, is what the lm_head reads
        torch.testing.assert_close(model.lm_head(model.final_norm(stream)), model(ids))


def test_capture_leaves_outputs_and_model_untouched_also_on_errors():
    model = _gpt()
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        plain = model(ids)
        with capture(model):
            captured = model(ids)
    torch.testing.assert_close(captured, plain, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="boom"), capture(model):
        raise RuntimeError("boom")
    for block in model.blocks:
        assert block.attn.weights_sink is None
        assert not block._forward_hooks
    with capture(model), pytest.raises(ValueError, match="captures do not nest"), capture(model):
        pass


def test_padded_keys_get_zero_weight_in_bert():
    model = _bert()
    ids = torch.randint(0, VOCAB, (2, 7))
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, 4:] = False
    with torch.no_grad(), capture(model) as cap:
        model(ids, padding_mask=padding)
    for layer in range(2):
        weights = cap.attention[layer]  # (2, H, 7, 7), both directions
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))
        assert weights[1, :, :, 4:].abs().max() == 0
        assert weights[0].triu(diagonal=1).abs().max() > 0  # BERT sees the future


def test_seq2seq_captures_encoder_decoder_and_cross_attention():
    model = _seq2seq()
    src, tgt = torch.randint(3, VOCAB, (1, 6)), torch.randint(3, VOCAB, (1, 4))
    with torch.no_grad(), capture(model) as cap:
        model(src, tgt)
    kinds = cap.attention_by_kind
    assert set(kinds) == {"encoder", "decoder", "cross"}
    assert [len(kinds[k]) for k in ("encoder", "decoder", "cross")] == [3, 2, 2]
    assert kinds["encoder"][0].shape == (1, 4, 6, 6)
    assert kinds["decoder"][0].shape == (1, 4, 4, 4)
    assert kinds["cross"][1].shape == (1, 4, 4, 6)  # target queries, source keys
    assert kinds["decoder"][1].triu(diagonal=1).abs().max() == 0
    assert cap.residual_by_stack["encoder"][2].shape == (1, 6, 32)
    with pytest.raises(ValueError, match=r"use cap.attention_by_kind\[kind\]"):
        cap.attention  # noqa: B018


def test_rnn_has_no_attention_to_capture():
    rnn = gf.build_model(gf.ModelConfig(family="rnn", vocab_size=13, d_model=7, n_layers=1))
    with pytest.raises(ValueError, match="an RNN has no attention"), capture(rnn):
        pass


def test_kv_cache_generation_records_every_call_and_stitches_to_the_full_matrix():
    model = _gpt()
    prompt = [3, 7, 1, 9, 4]
    with capture(model) as cap:
        result = gf.Engine(model).generate(prompt, max_new_tokens=4, temperature=0.0)
    assert cap.attention.n_calls == 4  # prefill + 3 decode steps (the 4th token is not fed)
    assert cap.attention[1].shape == (1, 4, 1, 8)
    full_ids = torch.tensor([prompt + result.token_ids[:-1]])  # what the calls fed
    with torch.no_grad(), capture(model) as one:
        model(full_ids)
    for layer in range(2):
        torch.testing.assert_close(cap.attention.full(layer), one.attention[layer], atol=1e-5,
                                   rtol=1e-5)  # fmt: skip


def test_capture_works_on_decode_optimized_and_int8_models():
    model = _gpt()
    ids = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad(), capture(model) as ref:
        model(ids)
    fast = gf.optimize_for_decode(copy.deepcopy(model))  # DecodeLinear everywhere
    with torch.no_grad(), capture(fast) as cap:
        fast(ids)
    torch.testing.assert_close(cap.attention[1], ref.attention[1], atol=1e-5, rtol=1e-5)
    int8 = gf.quantize_int8(copy.deepcopy(model))  # Int8Linear: close, not equal
    with torch.no_grad(), capture(int8) as cap:
        int8(ids)
    torch.testing.assert_close(cap.attention[1].sum(-1), torch.ones(1, 4, 10))
    assert (cap.attention[1] - ref.attention[1]).abs().max() < 0.05


def _assert_capture_equals_hf(model, hf, ids, n_layers: int, rtol: float) -> None:
    """capture() records, layer by layer, the weights transformers returns as attentions."""
    with torch.no_grad():
        expected = hf(ids, output_attentions=True).attentions
        with capture(model) as cap:
            model(ids)
    for layer in range(n_layers):
        torch.testing.assert_close(cap.attention[layer], expected[layer], atol=1e-5, rtol=rtol)


def test_capture_equals_transformers_output_attentions(tmp_path):
    config = tiny_llama_config(VOCAB, bos_token_id=None, eos_token_id=None, initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    model, _ = gf.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (1, 11))
    hf.config._attn_implementation = "eager"  # the only HF path that returns weights
    _assert_capture_equals_hf(model, hf, ids, n_layers=2, rtol=1e-5)


def test_top_attended_closed_form():
    row = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.0, 0.8]])  # (H=2, Tk=3)
    found = top_attended(row, k=2)
    assert [(a.key, a.best_head) for a in found] == [(2, 1), (0, 0)]
    assert found[0].mean_weight == pytest.approx(0.45)
    assert found[0].best_head_weight == pytest.approx(0.8)


def test_find_token_strips_markers_notes_repeats_and_lists_tokens():
    bpe = gf.BPETokenizer.train(["the animal was tired because it was it"] * 20, vocab_size=300)
    ids = bpe.encode("the animal was tired because it was it")
    position, note = find_token(bpe, ids, "it")
    assert token_texts(bpe, ids)[position] == "it"
    assert bpe.id_to_token(ids[position]).startswith("Ġ")  # matched through the marker
    assert "occurs 2 times" in note
    with pytest.raises(ValueError, match=r"token 'cat' is not one of .*animal"):
        find_token(bpe, ids, "cat")


def test_a_character_split_into_byte_pieces_is_labelled_and_matched_at_its_last_piece():
    bpe = gf.BPETokenizer.train(["the cat was tired"] * 20, vocab_size=280)
    ids = bpe.encode("cat 它 ok")
    labels = token_texts(bpe, ids)
    n_bytes = len("它".encode())  # 3: English merges never join these bytes
    assert [lab for lab in labels if lab.startswith("它")] == [
        f"它({i}/{n_bytes})" for i in range(1, n_bytes + 1)
    ]
    position, note = find_token(bpe, ids, "它")
    assert labels[position] == f"它({n_bytes}/{n_bytes})" and note is None


def test_missing_cjk_font_warns_once_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(plots, "cjk_font", lambda: None)
    plots._warn_no_cjk_font.cache_clear()
    with pytest.warns(UserWarning, match="no CJK font is installed.*fonts-wqy-microhei"):
        fig = plots.attention_heatmap(torch.eye(2), ["猫", "它"], ["猫", "它"], "t")
    assert plots.save(fig, tmp_path / "boxes.png").read_bytes()[:8] == PNG
    plots._warn_no_cjk_font.cache_clear()


def test_plots_crop_long_inputs_render_cjk_and_write_png(tmp_path):
    tokens = ["那", "只", "猫", "没", "跳", "上", "桌", "子", "因", "为", "它", "太", "累", "了"]
    weights = torch.softmax(torch.randn(4, 14, 14), dim=-1)  # (H, T, T)
    fig = plots.attention_heatmap(weights[0], tokens, tokens, "它 → 猫", query=10)
    assert plots.save(fig, tmp_path / "cjk.png").read_bytes()[:8] == PNG
    long_tokens = [f"t{i}" for i in range(100)]
    fig = plots.attention_heatmap(torch.rand(100, 100), long_tokens, long_tokens, "x", query=70)
    ax = fig.axes[0]
    assert "cropped: queries 46-93 of 100" in ax.get_title()
    assert [t.get_text() for t in ax.get_yticklabels()][24] == "t70"
    grid = plots.layer_grid([weights, weights], tokens, tokens, query=10)
    assert len([a for a in grid.axes if a.get_title().startswith("layer")]) == 2
    heads = plots.head_grid(weights, tokens, tokens, query=10)
    assert plots.save(heads, tmp_path / "heads.png").read_bytes()[:8] == PNG


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A char-level GPT trained 2 steps through the CLI, and a saved random seq2seq."""
    tmp = tmp_path_factory.mktemp("inspect")
    corpus = tmp / "corpus.txt"
    corpus.write_text("the animal did not cross the street because it was too tired. " * 200)
    out = tmp / "gpt"
    code = main(
        [
            "train", "--config", str(Path(__file__).parents[1] / "configs/shakespeare-char.toml"),
            "--set", f'data.corpus="{corpus}"', "--set", f'train.out_dir="{out}"',
            "--set", "train.max_steps=2", "--set", "train.eval_interval=2",
            "--set", "train.eval_batches=1", "--set", "train.batch_size=2",
            "--set", "model.n_layers=2", "--set", "train.threads=1", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    chars = CharTokenizer.from_text("the animal did not cross the street because it was tired.")
    model = gf.build_model(
        gf.ModelConfig(
            family="seq2seq", vocab_size=chars.vocab_size, d_model=32, n_layers=1,
            n_encoder_layers=2, n_heads=2, max_seq_len=48, bos_token_id=0, eos_token_id=1,
        )
    )  # fmt: skip
    save_checkpoint(tmp / "s2s", 0, model, model.cfg, chars)
    return {"gpt": out, "seq2seq": tmp / "s2s"}


def test_cli_inspects_a_trained_gpt(checkpoints, tmp_path, capsys):
    out = tmp_path / "att.png"
    argv = ["inspect", "attention", "--model", str(checkpoints["gpt"]), "the street",
            "--position", "4", "--out", str(out), "--head", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "query 's' at position 4" in printed
    assert printed.count("  layer ") == 2 + 1  # two layers, then the chosen head's line
    assert out.read_bytes()[:8] == PNG
    assert (tmp_path / "att-layer1-head1.png").read_bytes()[:8] == PNG
    # the char tokenizer's 't' occurs twice: the first is used and the user is told
    assert main(["inspect", "attention", "--model", str(checkpoints["gpt"]), "the street",
                 "--token", "t", "--out", str(out)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "query 't' at position 0" in captured.out
    assert "occurs 3 times" in captured.err
    assert main(["inspect", "attention", "--model", str(checkpoints["gpt"]), "the street",
                 "--token", "z", "--out", str(out)]) == 2  # fmt: skip
    assert "error: token 'z' is not one of the input's 10 tokens" in capsys.readouterr().err
    long_text = "the animal did not cross the street " * 4  # 144 characters
    assert main(["inspect", "attention", "--model", str(checkpoints["gpt"]), long_text,
                 "--max-tokens", "100", "--out", str(out)]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert "the text has 144 tokens: using the first 100" in captured.err
    assert f"query {long_text[99]!r} at position 99" in captured.out  # the last kept token


def test_cli_inspects_seq2seq_cross_attention(checkpoints, tmp_path, capsys):
    out = tmp_path / "cross.png"
    argv = ["inspect", "attention", "--model", str(checkpoints["seq2seq"]), "it was tired",
            "--kind", "cross", "--target", "it was", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "cross attention | 7 query x 12 key tokens" in printed
    assert (tmp_path / "cross-layer0-heads.png").read_bytes()[:8] == PNG


def test_cli_rejects_rnn_and_bad_layer(tmp_path, capsys):
    rnn = gf.build_model(gf.ModelConfig(family="rnn", vocab_size=5, d_model=7, n_layers=1))
    save_checkpoint(tmp_path / "rnn", 0, rnn, rnn.cfg, CharTokenizer.from_text("abcde"))
    assert main(["inspect", "attention", "--model", str(tmp_path / "rnn"), "abc"]) == 2
    assert "error: an RNN has no attention" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_on_minilm_it_attends_to_animal(tmp_path, capsys):
    out = tmp_path / "minilm.png"
    text = "The animal didn't cross the street because it was too tired"
    argv = ["inspect", "attention", "--model", "minilm", text, "--token", "it", "--out",
            str(out), "--threads", "1"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "bert, 6 layers x 12 heads" in printed and "query 'it' at position 10" in printed
    last = next(line for line in printed.splitlines() if line.startswith("  layer  5:"))
    assert "animal@2" in last  # the tutorial's claim, seed 000 §3.1
    assert out.read_bytes()[:8] == PNG


@pytest.mark.slow
def test_minilm_capture_equals_transformers():
    from glassformer.interop.pretrained import resolve

    model, tokenizer = gf.from_pretrained("minilm")
    ids = torch.tensor([tokenizer.encode("it was too tired")])
    hf = transformers.BertModel.from_pretrained(resolve("minilm"), attn_implementation="eager")
    _assert_capture_equals_hf(model, hf, ids, n_layers=6, rtol=1e-4)
