"""The calculators (glassformer/calc/; seed 000 §2.1, §2.5.3; seed 002's KV-cache bill) against
models actually built: glassformer's own, transformers' on the meta device, a filled KV cache,
torch's FLOP counter, and the published totals."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import transformers as tf
from torch.utils.flop_counter import FlopCounterMode

from glassformer import cli
from glassformer.calc import (
    COUNT_ONLY_PRESETS,
    flops_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    parameter_counts,
    parameter_rows,
    parameter_table,
    resolve_preset,
)
from glassformer.config import PRESETS, ModelConfig
from glassformer.models import build_model


def rows_by_component(cfg) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for row in parameter_rows(cfg):
        counts[row.component] += row.count
    return {k: v for k, v in counts.items() if v}  # a tied head's row holds 0


def hf_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


def on_meta(build):
    with torch.device("meta"):  # shapes only: a 7B model costs no memory
        return build()


# --- closed-form rows == the built model ------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_rows_equal_the_model_built_on_meta_for_every_preset(name):
    cfg = ModelConfig.preset(name)
    with torch.device("meta"):
        model = build_model(cfg)
    assert rows_by_component(cfg) == parameter_table(model)
    assert parameter_counts(cfg)["total"] == sum(p.numel() for p in model.parameters())


SMALL = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=16)
KINDS = [
    dict(position="learned", norm="layer", ffn="gelu", bias=True),
    dict(position="sinusoidal", norm="layer", norm_bias=False, ffn="relu", tie_embeddings=False),
    dict(position="rope", norm="rms", ffn="swiglu", n_kv_heads=2),  # GQA
    dict(position="alibi", norm="rms", ffn="geglu", n_kv_heads=1, qkv_bias=True),  # MQA
    dict(position="none", norm_position="post", ffn="silu", attn_out_bias=True, mlp_bias=True),
    dict(position="rope", norm="rms", ffn="moe", n_experts=4, n_experts_per_token=2),
    dict(ffn="moe", moe_expert_ffn="gelu", n_experts=3, n_experts_per_token=1, bias=True),
    dict(head_dim=12, n_kv_heads=2, position="rope"),  # n_heads * head_dim != d_model
    dict(family="bert", type_vocab_size=2, embedding_norm=True, norm_position="post",
         pooler=True, mlm_head=True, tie_embeddings=False, n_classes=3, nsp_head=True, bias=True),
    dict(family="bert", pooler=True, mlm_head=True, ffn="moe", n_experts=2),
    dict(family="seq2seq", position="relative", norm="rms", n_encoder_layers=3, ffn="geglu_tanh"),
    dict(family="seq2seq", position="learned", position_offset=2, share_embeddings=False,
         tie_embeddings=False, lm_head_bias=True, embedding_norm=True, bias=True),
    dict(family="seq2seq", position="sinusoidal", norm_position="post", n_kv_heads=2),
]  # fmt: skip


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "-".join(f"{v}" for v in k.values()))
def test_rows_equal_a_real_model_across_kinds(kind):
    cfg = ModelConfig(**{**SMALL, **kind})
    model = build_model(cfg)  # real weights this time
    assert rows_by_component(cfg) == parameter_table(model)
    counts = parameter_counts(cfg)
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    if cfg.ffn == "moe":  # only k of the n experts run per token
        per_expert = experts // cfg.n_experts
        assert counts["active"] == counts["total"] - experts + cfg.n_experts_per_token * per_expert
        assert sum(r.active for r in parameter_rows(cfg)) == counts["active"]
    else:
        assert counts["active"] == counts["total"]


def test_rnn_counts_come_from_the_built_model():
    cfg = ModelConfig(family="rnn", cell="lstm", vocab_size=50, d_model=16, n_layers=2)
    assert parameter_counts(cfg)["total"] == sum(p.numel() for p in build_model(cfg).parameters())
    with pytest.raises(ValueError, match="family='rnn'"):
        parameter_rows(cfg)


# --- the same configs in transformers, built on the meta device -------------------------------


def test_gpt2_124m_matches_transformers():
    hf = on_meta(lambda: tf.GPT2LMHeadModel(tf.GPT2Config()))  # lm_head tied to wte
    assert hf_count(hf) == 124_439_808 == parameter_counts(resolve_preset("gpt2-124m"))["total"]


def test_llama_7b_matches_transformers_and_the_tutorial_table():
    hf_cfg = tf.LlamaConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, tie_word_embeddings=False,
    )  # fmt: skip
    hf = on_meta(lambda: tf.LlamaForCausalLM(hf_cfg))
    cfg = resolve_preset("llama-7b")
    assert hf_count(hf) == 6_738_415_616 == parameter_counts(cfg)["total"]
    rows = {r.name: r for r in parameter_rows(cfg)}
    # seed 000 §2.1: embedding [32000 x 4096]; attention: 4 x [4096 x 4096] per layer, x 32
    assert rows["Embedding table (token embedding)"].count == 32000 * 4096
    assert rows["Attention W_Q/W_K/W_V/W_O"].per_layer == 4 * 4096 * 4096
    assert rows["Attention W_Q/W_K/W_V/W_O"].layers == 32


def test_smollm2_matches_transformers_llama():
    hf_cfg = tf.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
    )  # fmt: skip
    hf = on_meta(lambda: tf.LlamaForCausalLM(hf_cfg))
    assert hf_count(hf) == parameter_counts(resolve_preset("smollm2-135m"))["total"]


def test_bert_base_matches_transformers_with_and_without_pooler():
    cfg = resolve_preset("bert-base")
    encoder = cfg.replace(mlm_head=False)
    assert (
        hf_count(on_meta(lambda: tf.BertModel(tf.BertConfig())))
        == (parameter_counts(encoder)["total"])
    )
    no_pooler = on_meta(lambda: tf.BertModel(tf.BertConfig(), add_pooling_layer=False))
    assert hf_count(no_pooler) == parameter_counts(encoder.replace(pooler=False))["total"]
    # BertForPreTraining = pooler + tied masked-LM head + next-sentence head
    pretraining = on_meta(lambda: tf.BertForPreTraining(tf.BertConfig()))
    assert hf_count(pretraining) == parameter_counts(cfg.replace(nsp_head=True))["total"]


def test_t5_base_matches_transformers_with_its_tied_embeddings():
    hf_cfg = tf.T5Config(
        vocab_size=32128, d_model=768, d_kv=64, d_ff=3072, num_layers=12, num_heads=12
    )
    hf = on_meta(lambda: tf.T5ForConditionalGeneration(hf_cfg))
    # one table serves encoder input, decoder input and output head (T5 v1.0)
    assert hf.lm_head.weight is hf.shared.weight is hf.encoder.embed_tokens.weight
    cfg = resolve_preset("t5-base")
    assert hf_count(hf) == parameter_counts(cfg)["total"] == 222_903_552
    untied = parameter_counts(cfg.replace(tie_embeddings=False))["total"]
    assert untied - 222_903_552 == 32128 * 768  # a separate head: one more [768 x 32128]


def test_mixtral_total_and_active_match_transformers():
    hf = on_meta(lambda: tf.MixtralForCausalLM(tf.MixtralConfig()))  # 8 experts, top-2
    total = hf_count(hf)
    experts = sum(p.numel() for n, p in hf.named_parameters() if ".experts." in n)
    counts = parameter_counts(resolve_preset("mixtral-8x7b"))
    assert counts["total"] == total
    assert counts["active"] == total - experts + experts * 2 // 8
    assert round(counts["total"] / 1e9, 1) == 46.7  # Mistral: "46.7B total"
    assert round(counts["active"] / 1e9, 1) == 12.9  # "12.9B per token"


# --- published totals ---------------------------------------------------------------------------


def test_gpt3_is_175b():
    assert parameter_counts(resolve_preset("gpt3-175b"))["total"] == pytest.approx(175e9, rel=0.01)


def test_deepseek_v3_is_671b_total_37b_active():
    counts = parameter_counts(COUNT_ONLY_PRESETS["deepseek-v3"])
    assert counts["total"] == pytest.approx(671e9, rel=0.01)
    # Counted as the issue defines it (everything but the routed experts, plus 8 of 256) active
    # is 37.55B; without the input embedding lookup, 36.63B. The published "37B" lies between
    # the two conventions, each within 1.5%.
    without_lookup = counts["active"] - counts["components"]["embedding"]
    assert without_lookup < 37e9 < counts["active"]
    assert counts["active"] == pytest.approx(37e9, rel=0.015)
    assert without_lookup == pytest.approx(37e9, rel=0.015)


# --- KV cache -----------------------------------------------------------------------------------


def test_llama_7b_kv_cache_is_half_a_megabyte_per_token():
    cfg = resolve_preset("llama-7b")
    assert kv_cache_bytes(cfg, 1, "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288  # seed 002
    assert kv_cache_bytes(cfg, 4096, "fp16") == 2 * 2**30  # "about 2 GB"
    assert kv_cache_bytes(cfg.replace(n_kv_heads=8), 4096, "fp16") == 2**30 // 2


@pytest.mark.parametrize(
    "kind",
    [dict(), dict(n_kv_heads=2), dict(n_kv_heads=1, sliding_window=5)],
    ids=["mha", "gqa", "mqa-window"],
)
def test_kv_cache_bytes_equal_a_filled_cache(kind):
    cfg = ModelConfig(**SMALL, position="rope", norm="rms", ffn="swiglu", **kind)
    model = build_model(cfg).eval()
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        model(torch.randint(0, 97, (2, 9)), torch.arange(9), cache=cache)  # prefill 9 tokens
        model(torch.randint(0, 97, (2, 1)), torch.tensor([9]), cache=cache)  # one decode step
    written = cache.k.ne(0).any(dim=-1).any(dim=2).any(dim=0)  # (B, slots): a key was written
    filled = int(written.sum()) * cache.kv_bytes_per_token
    assert filled == kv_cache_bytes(cfg, 10, "fp32", batch_size=2)
    assert kv_bytes_per_token(cfg, "fp32") * 10 * 2 >= filled


def test_deepseek_caches_the_mla_latent():
    cfg = COUNT_ONLY_PRESETS["deepseek-v3"]
    assert kv_cache_bytes(cfg, 1, "bf16") == 61 * (512 + 64) * 2


def test_kv_cache_errors_name_the_value():
    with pytest.raises(ValueError, match=r"dtype='fp13'.*fp16"):
        kv_cache_bytes(resolve_preset("llama-7b"), 10, "fp13")
    with pytest.raises(ValueError, match="encoder"):
        kv_cache_bytes(resolve_preset("bert-base"), 10)


# --- FLOPs --------------------------------------------------------------------------------------


def test_flops_of_a_tiny_model_match_the_closed_form_and_torch_flop_counter():
    cfg = ModelConfig(**SMALL, position="rope", norm="rms", ffn="swiglu", n_kv_heads=2,
                      tie_embeddings=False, attention_backend="eager")  # fmt: skip
    d, f, V, L, q, kv = 32, cfg.d_ff, 97, 2, 32, 16  # q: 4 heads x 8, kv: 2 heads x 8
    weights = L * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * V
    T = 16
    flops = flops_per_token(cfg, T)
    assert flops["matmul"] == 2 * weights
    assert flops["attention"] == 2 * 2 * L * T * (4 * 8)
    assert flops["training"] == 3 * flops["forward"]
    # torch counts every matmul of an actual forward; eager attention scores all T x T pairs
    model = build_model(cfg).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, V, (1, T)))
    assert counter.get_total_flops() == T * flops["forward"]


def test_moe_flops_count_only_the_routed_experts():
    cfg = ModelConfig(**SMALL, ffn="moe", n_experts=4, n_experts_per_token=2,
                      attention_backend="eager")  # fmt: skip
    T = 8
    model = build_model(cfg).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, 97, (1, T)))
    assert counter.get_total_flops() == T * flops_per_token(cfg, T)["forward"]


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_params_prints_the_tutorial_table(capsys):
    assert cli.main(["calc", "params", "--preset", "llama-7b"]) == 0
    out = capsys.readouterr().out
    assert "6,738,415,616 parameters" in out
    assert "[32000 x 4096]" in out and "4 x [4096 x 4096]" in out
    assert "67,108,864" in out  # one layer's W_Q/W_K/W_V/W_O


def test_cli_params_moe_prints_total_and_active(capsys):
    assert cli.main(["calc", "params", "--preset", "deepseek-v3"]) == 0
    out = capsys.readouterr().out
    assert "671,026,419,200 parameters" in out and "active per token: 37,552,297,472" in out


def test_cli_kv_cache_shows_gqa_mqa_and_window(capsys):
    argv = ["calc", "kv-cache", "--preset", "llama-7b", "--tokens", "8192", "--dtype", "fp16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "per token: 524,288 bytes" in out and "4,294,967,296 bytes" in out
    assert "n_kv_heads=8" in out and "n_kv_heads=1" in out and "sliding window of 4096" in out


def test_cli_flops(capsys):
    assert cli.main(["calc", "flops", "--preset", "gpt2-124m", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    f = flops_per_token(resolve_preset("gpt2-124m"), 1024)
    assert f"2 x {f['matmul_weights']:,} weights" in out and "training" in out


def test_cli_params_from_a_run_config(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npreset = "tiny-shakespeare"\n[data]\ntokenizer = "bpe"\n'
                    "bpe_vocab_size = 300\n")  # fmt: skip
    assert cli.main(["calc", "params", "--config", str(path)]) == 0
    expected = ModelConfig.preset("tiny-shakespeare", vocab_size=300)
    total = sum(p.numel() for p in build_model(expected).parameters())
    assert f"{total:,} parameters" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["calc", "params", "--preset", "llama-8"], "unknown preset 'llama-8': pick one of"),
        (["calc", "kv-cache", "--preset", "llama-7b", "--dtype", "fp13"], "dtype='fp13'"),
        (["calc", "flops"], "give exactly one of --preset, --config or --model"),
    ],
)
def test_cli_errors_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    if "preset" in message:
        assert "deepseek-v3" in err and "gpt3-175b" in err
