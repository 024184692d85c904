"""GPT and its parts (seed 000 §2.5, §5, §6.2): KV-cache decoding against full recomputes, packed
and padded batches against each sequence alone, MoE against a slow loop, norms against
transformers/torch, clear errors, config JSON round-trips, and overfitting one batch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import left_padded
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from glassformer.config import PRESETS, ConfigError, ModelConfig
from glassformer.models.gpt import GPT
from glassformer.nn.attention import AttentionMask
from glassformer.nn.block import Block
from glassformer.nn.ffn import GatedMLP, MoE, make_dense_ffn
from glassformer.nn.norm import LayerNorm, RMSNorm

ATOL = 1e-5
VOCAB = 50


def _cfg(**overrides) -> ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    return ModelConfig(**(base | overrides))


def _model(**overrides) -> GPT:
    return GPT(_cfg(**overrides)).eval()


# --- KV cache: every decode step equals a full recompute ----------------------------------------

CACHE_CASES = {
    "learned": dict(position="learned"),
    "sinusoidal": dict(position="sinusoidal"),
    "rope": dict(position="rope"),
    "rope_linear": dict(position="rope", rope_scaling={"type": "linear", "factor": 4.0}),
    # dynamic NTK keeps the trained base while the text fits the trained length; past it the base
    # grows with the length, so keys cached earlier were rotated with an older base
    "rope_dynamic": dict(
        position="rope", rope_scaling={"type": "dynamic", "factor": 4.0, "original_max_seq_len": 32}
    ),
    "rope_yarn": dict(
        position="rope", rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 8}
    ),
    "rope_llama3": dict(
        position="rope",
        rope_theta=500000.0,
        rope_scaling={"type": "llama3", "factor": 8.0, "original_max_seq_len": 8},
    ),
    "alibi": dict(position="alibi"),
    "none": dict(position="none"),
    "rms_pre": dict(position="rope", norm="rms"),
    "layer_post": dict(norm_position="post"),
    "rms_post": dict(position="rope", norm="rms", norm_position="post"),
    "swiglu": dict(position="rope", norm="rms", ffn="swiglu"),
    "moe": dict(position="rope", ffn="moe", n_experts=4, n_experts_per_token=2),
    "gqa": dict(position="rope", n_heads=8, n_kv_heads=2),
    "mqa": dict(position="rope", n_kv_heads=1),
    "sliding_window": dict(position="rope", sliding_window=4),
    "sliding_window_alibi_gqa": dict(position="alibi", sliding_window=3, n_kv_heads=2),
    "eager_rope": dict(position="rope", attention_backend="eager"),
    "eager_alibi": dict(position="alibi", attention_backend="eager"),
    "bias_qkv": dict(bias=True, qkv_bias=True, tie_embeddings=False),
}


@pytest.mark.parametrize("case", list(CACHE_CASES))
def test_cached_decode_equals_full_recompute(case: str) -> None:
    model = _model(**CACHE_CASES[case])
    prompt_len, n_new, B = 6, 8, 2
    ids = torch.randint(0, VOCAB, (B, prompt_len + n_new))
    cache = model.new_cache(B)
    with torch.no_grad():
        logits = model(ids[:, :prompt_len], torch.arange(prompt_len), cache=cache)
        torch.testing.assert_close(logits, model(ids[:, :prompt_len]), atol=ATOL, rtol=0)
        for t in range(prompt_len, prompt_len + n_new):
            step = model(ids[:, t : t + 1], torch.arange(t, t + 1), cache=cache)  # (B, 1, V)
            full = model(ids[:, : t + 1])[:, -1:]  # no cache, the whole prefix again
            torch.testing.assert_close(step, full, atol=ATOL, rtol=0, msg=f"step {t}")


def test_cached_decode_in_chunks_equals_full_recompute() -> None:
    """Several new tokens per step: a causal mask with fewer queries than keys."""
    model = _model(position="rope", n_kv_heads=2, sliding_window=5)
    ids = torch.randint(0, VOCAB, (2, 15))
    cache = model.new_cache(2)
    with torch.no_grad():
        full = model(ids)
        spans = ((0, 4), (4, 7), (7, 8), (8, 15))
        chunks = [model(ids[:, a:b], torch.arange(a, b), cache=cache) for a, b in spans]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full, atol=ATOL, rtol=0)


def test_last_token_only_equals_last_row_of_full_logits() -> None:
    model = _model(position="rope")
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, last_token_only=True), model(ids)[:, -1:], atol=ATOL, rtol=0
        )


# --- packed documents and padding ---------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("position", ["rope", "learned", "alibi"])
def test_packed_documents_equal_each_document_alone(position: str, backend: str) -> None:
    model = _model(position=position, attention_backend=backend, n_kv_heads=2)
    rows = [[5, 4, 3], [7, 5]]  # document lengths per packed row of 12 tokens
    docs = [[torch.randint(0, VOCAB, (1, n)) for n in lengths] for lengths in rows]
    input_ids = torch.stack([torch.cat(d, dim=1)[0] for d in docs])  # (2, 12)
    document_ids = torch.tensor([[i for i, n in enumerate(r) for _ in range(n)] for r in rows])
    position_ids = torch.tensor([[p for n in r for p in range(n)] for r in rows])
    with torch.no_grad():
        packed = model(input_ids, position_ids=position_ids, document_ids=document_ids)
        for b, row in enumerate(docs):
            start = 0
            for doc in row:
                alone = model(doc)[0]
                got = packed[b, start : start + doc.shape[1]]
                torch.testing.assert_close(got, alone, atol=ATOL, rtol=0)
                start += doc.shape[1]


@pytest.mark.parametrize("backend", ["sdpa", "eager"])
@pytest.mark.parametrize("position", ["learned", "rope", "alibi", "none"])
def test_right_padded_row_equals_unpadded_row(position: str, backend: str) -> None:
    model = _model(position=position, attention_backend=backend)
    lengths = [10, 6]
    ids = torch.randint(1, VOCAB, (2, 10))
    padding_mask = torch.arange(10)[None] < torch.tensor(lengths)[:, None]
    ids[~padding_mask] = 0
    with torch.no_grad():
        batch = model(ids, padding_mask=padding_mask)
        assert not torch.isnan(batch).any()
        for b, n in enumerate(lengths):
            alone = model(ids[b : b + 1, :n])[0]
            torch.testing.assert_close(batch[b, :n], alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("position", ["learned", "rope", "alibi"])
def test_left_padded_prefill_and_decode_equal_each_row_alone(position: str) -> None:
    """Batched generation: left padding, positions counted from each row's first real token."""
    model = _model(position=position, n_kv_heads=2)
    lengths, width, n_new = [7, 3], 7, 4
    prompts = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    continuations = torch.randint(1, VOCAB, (2, n_new))
    ids, padding_mask, position_ids = left_padded(prompts, width)
    cache = model.new_cache(2)
    with torch.no_grad():
        prefill = model(
            ids,
            torch.arange(width),
            position_ids=position_ids,
            padding_mask=padding_mask,
            cache=cache,
        )
        assert not torch.isnan(prefill).any()
        steps = []
        for t in range(n_new):
            padding_mask = torch.cat([padding_mask, torch.ones(2, 1, dtype=torch.bool)], dim=1)
            step_positions = position_ids[:, -1:] + 1
            position_ids = torch.cat([position_ids, step_positions], dim=1)
            steps.append(
                model(
                    continuations[:, t : t + 1],
                    torch.arange(width + t, width + t + 1),
                    position_ids=step_positions,
                    padding_mask=padding_mask,
                    cache=cache,
                )
            )
        for b, p in enumerate(prompts):
            alone = model(torch.cat([p, continuations[b]])[None])[0]  # (n + n_new, V)
            n = len(p)
            torch.testing.assert_close(prefill[b, width - n :], alone[:n], atol=ATOL, rtol=0)
            decoded = torch.cat([s[b] for s in steps])
            torch.testing.assert_close(decoded, alone[n:], atol=ATOL, rtol=0)


# --- MoE ----------------------------------------------------------------------------------------


def _swiglu_by_hand(x: torch.Tensor, expert: GatedMLP) -> torch.Tensor:
    w = expert.gate_up.weight.double()
    gate, up = x @ w[: expert.d_ff].T, x @ w[expert.d_ff :].T
    return (gate * torch.sigmoid(gate) * up) @ expert.down.weight.double().T


def _moe_cfg(**overrides) -> ModelConfig:
    base = dict(ffn="moe", n_experts=5, n_experts_per_token=2, moe_expert_ffn="swiglu", d_ff=24)
    return _cfg(**(base | overrides))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_equals_slow_token_loop(top_k: int) -> None:
    moe = MoE(_moe_cfg(n_experts_per_token=top_k))
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out = moe(x)
        router_w = moe.router.weight.double()
        tokens = x.reshape(-1, 32).double()
        expected = torch.zeros_like(tokens)
        counts = [0] * moe.n_experts
        for n in range(tokens.shape[0]):
            probs = torch.softmax(tokens[n] @ router_w.T, dim=-1).tolist()
            chosen = sorted(range(moe.n_experts), key=lambda e: -probs[e])[:top_k]
            total = sum(probs[e] for e in chosen)
            for e in chosen:
                expected[n] += probs[e] / total * _swiglu_by_hand(tokens[n], moe.experts[e])
                counts[e] += 1
    torch.testing.assert_close(out.reshape(-1, 32), expected.float(), atol=ATOL, rtol=0)
    assert moe.expert_counts.tolist() == counts
    assert int(moe.expert_counts.sum()) == tokens.shape[0] * top_k


def test_moe_router_weights_are_renormalized_over_top_k() -> None:
    """With identical experts, a convex combination of their outputs is that one output."""
    moe = MoE(_moe_cfg(n_experts_per_token=3))
    with torch.no_grad():
        for expert in moe.experts[1:]:
            expert.load_state_dict(moe.experts[0].state_dict())
        torch.nn.init.normal_(moe.router.weight, std=1.0)
    x = torch.randn(3, 4, 32)
    with torch.no_grad():
        expected = _swiglu_by_hand(x.double(), moe.experts[0]).float()
        torch.testing.assert_close(moe(x), expected, atol=ATOL, rtol=0)


def test_moe_aux_loss_closed_form() -> None:
    moe = MoE(_moe_cfg(n_experts=4, n_experts_per_token=2))
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        moe(x)
    tokens = x.reshape(-1, 32).double().numpy()
    logits = tokens @ moe.router.weight.detach().double().numpy().T  # (N, E)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    n_tokens, n_experts, k = probs.shape[0], 4, 2
    top = np.argsort(-probs, axis=-1)[:, :k]
    # f_e: share of the N*k token-to-expert assignments that went to e; P_e: mean router prob
    f = np.array([(top == e).sum() for e in range(n_experts)]) / (n_tokens * k)
    p = probs.mean(axis=0)
    expected = n_experts * float((f * p).sum())
    assert float(moe.aux_loss) == pytest.approx(expected, rel=1e-5)
    # balanced routing gives exactly 1: f_e = P_e = 1/E
    assert n_experts * sum((1 / n_experts) ** 2 for _ in range(n_experts)) == pytest.approx(1.0)


def test_gpt_loss_adds_moe_aux_loss() -> None:
    model = GPT(_moe_cfg(n_experts=4, moe_aux_loss_coef=0.1))
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        out = model.loss(ids, ids.roll(-1, dims=1))
    aux = sum(float(m.aux_loss) for m in model.modules() if isinstance(m, MoE))
    assert float(out.aux_loss) == pytest.approx(aux, rel=1e-6)
    with torch.no_grad():
        ce = F.cross_entropy(model(ids).view(-1, VOCAB), ids.roll(-1, dims=1).reshape(-1))
    assert float(out.ce_loss) == pytest.approx(float(ce), rel=1e-5)
    assert float(out.loss) == pytest.approx(float(ce) + 0.1 * aux, rel=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_loss_on_learned_positions_equals_loss_on_all_logits(tied: bool) -> None:
    """The loss runs the head only where targets are not -100 (a chat fine-tune's replies):
    the value and every gradient equal cross-entropy over the full (B, T, V) logits."""
    torch.manual_seed(0)
    model = GPT(_cfg(tie_embeddings=tied, position="rope", norm="rms")).train()
    ids = torch.randint(0, VOCAB, (3, 12))
    targets = ids.roll(-1, dims=1)
    targets[0, :7] = -100  # a prompt
    targets[1, 4:] = -100  # right padding
    targets[2, ::3] = -100  # scattered
    documents = torch.tensor([[0] * 12, [0] * 12, [0] * 5 + [1] * 7])

    model.zero_grad()
    out = model.loss(ids, targets, document_ids=documents)
    out.loss.backward()
    ours = {name: p.grad.clone() for name, p in model.named_parameters()}

    model.zero_grad()
    logits = model(ids, document_ids=documents)  # (B, T, V): every position
    reference = F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1), ignore_index=-100)
    reference.backward()
    assert out.ce_loss.item() == pytest.approx(reference.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ours[name], p.grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["swiglu", "gelu"])
def test_moe_with_one_expert_equals_dense_ffn(kind: str) -> None:
    moe = MoE(_moe_cfg(n_experts=1, n_experts_per_token=1, moe_expert_ffn=kind, bias=True))
    dense = make_dense_ffn(kind, 32, 24, bias=True)
    dense.load_state_dict(moe.experts[0].state_dict())
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(moe(x), dense(x), atol=ATOL, rtol=0)
    assert float(moe.aux_loss) == pytest.approx(1.0)  # one expert is always balanced


# --- norms and the residual wiring --------------------------------------------------------------


def test_rmsnorm_equals_transformers_llama_rmsnorm() -> None:
    ours, hf = RMSNorm(32, eps=1e-6), LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        hf.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 32) * 4
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_equals_torch_layernorm(bias: bool) -> None:
    ours = LayerNorm(32, eps=1e-5, bias=bias)
    ref = torch.nn.LayerNorm(32, eps=1e-5, bias=bias)
    with torch.no_grad():
        ours.weight.normal_()
        ref.weight.copy_(ours.weight)
        if bias:
            ours.bias.normal_()
            ref.bias.copy_(ours.bias)
    x = torch.randn(3, 5, 32) * 3 + 1
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-6)


def _randomize_norms(block: Block) -> None:
    with torch.no_grad():
        for norm in (block.attn_norm, block.ffn_norm):
            norm.weight.normal_()


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_post_norm_block_is_norm_of_x_plus_sublayer(norm: str) -> None:
    block = Block(_cfg(norm=norm, norm_position="post", ffn="gelu")).eval()
    _randomize_norms(block)
    x = torch.randn(2, 6, 32)
    mask = AttentionMask(is_causal=True)
    with torch.no_grad():
        h = block.attn_norm(x + block.attn(x, mask))
        expected = block.ffn_norm(h + block.ffn(h))
        torch.testing.assert_close(block(x, mask), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_pre_norm_block_is_x_plus_sublayer_of_norm(norm: str) -> None:
    block = Block(_cfg(norm=norm, norm_position="pre", ffn="swiglu")).eval()
    _randomize_norms(block)
    x = torch.randn(2, 6, 32)
    mask = AttentionMask(is_causal=True)
    with torch.no_grad():
        h = x + block.attn(block.attn_norm(x), mask)
        expected = h + block.ffn(block.ffn_norm(h))
        torch.testing.assert_close(block(x, mask), expected, atol=ATOL, rtol=0)


# --- embeddings ---------------------------------------------------------------------------------


def test_tied_embeddings_share_one_tensor() -> None:
    tied, untied = _model(tie_embeddings=True), _model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.tok_emb.weight
    assert untied.lm_head.weight is not untied.tok_emb.weight
    assert untied.lm_head.weight.data_ptr() != untied.tok_emb.weight.data_ptr()
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == VOCAB * 32


def test_tied_logits_are_hidden_states_times_embedding_transpose() -> None:
    model = _model(tie_embeddings=True)
    ids = torch.randint(0, VOCAB, (1, 5))
    with torch.no_grad():
        hidden = model.hidden_states(ids)
        torch.testing.assert_close(model(ids), hidden @ model.tok_emb.weight.T, atol=ATOL, rtol=0)


# --- clear errors -------------------------------------------------------------------------------


def test_token_id_outside_vocab_is_a_clear_error() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"token id 50 is outside the vocabulary \[0, 50\)"):
        model(torch.tensor([[1, 2, 50]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside the vocabulary"):
        model(torch.tensor([[1, -1]]))


def test_d_model_not_divisible_by_n_heads_names_both_and_suggests_divisors() -> None:
    with pytest.raises(
        ConfigError,
        match=r"n_heads=7 does not divide d_model=100: pick n_heads in "
        r"\{1, 2, 4, 5, 10, 20, 25, 50\}",
    ):
        ModelConfig(d_model=100, n_heads=7)


def test_n_kv_heads_not_dividing_n_heads_is_a_clear_error() -> None:
    with pytest.raises(
        ConfigError,
        match=r"n_kv_heads=3 does not divide n_heads=8: pick n_kv_heads in \{1, 2, 4, 8\}",
    ):
        ModelConfig(d_model=64, n_heads=8, n_kv_heads=3)


@pytest.mark.parametrize(
    "field, value, names",
    [
        ("position", "rotary", "learned, sinusoidal, rope, alibi, none"),
        ("norm", "batch", "layer, rms"),
        ("ffn", "mlp", "relu, gelu, gelu_tanh, silu, swiglu, geglu, moe"),
        ("attention_backend", "flash", "sdpa, eager"),
    ],
)
def test_unknown_component_name_lists_the_known_ones(field: str, value: str, names: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field}='{value}' is not known: pick one of {names}"):
        ModelConfig(**{field: value})


def test_input_longer_than_max_seq_len_with_learned_positions_is_a_clear_error() -> None:
    model = _model(position="learned", max_seq_len=16)
    with pytest.raises(ValueError, match=r"17 tokens is longer than max_seq_len=16"):
        model(torch.randint(0, VOCAB, (1, 17)))
    cache = model.new_cache(1)
    model(torch.randint(0, VOCAB, (1, 16)), torch.arange(16), cache=cache)
    with pytest.raises(ValueError, match=r"longer than max_seq_len=16"):
        model(torch.randint(0, VOCAB, (1, 1)), torch.tensor([16]), cache=cache)


def test_a_cached_forward_without_positions_is_a_clear_error() -> None:
    model = _model(position="rope")
    with pytest.raises(ValueError, match=r"a forward with a cache needs the positions"):
        model(torch.randint(0, VOCAB, (1, 3)), cache=model.new_cache(1))


def test_a_rolled_back_row_equals_one_that_never_saw_the_rejected_tokens() -> None:
    """Speculative decoding's rollback is writing at an earlier position next time: the cache
    keeps no count, so tokens written past it and then written over leave no trace."""
    model = _model(position="rope", n_kv_heads=2)
    ids, rejected = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (1, 3))
    cache = model.new_cache(1)
    with torch.no_grad():
        model(ids[:, :5], torch.arange(5), cache=cache)
        model(rejected, torch.arange(5, 8), cache=cache)  # proposals the target rejects
        resumed = model(ids[:, 5:], torch.arange(5, 9), cache=cache)
        torch.testing.assert_close(resumed, model(ids)[:, 5:], atol=ATOL, rtol=0)


def test_full_kv_cache_is_a_clear_error() -> None:
    model = _model(position="rope")
    cache = model.new_cache(1, max_seq_len=4)
    with pytest.raises(
        ValueError, match=r"KV cache is full: 0 cached \+ 5 new positions > capacity 4"
    ):
        model(torch.randint(0, VOCAB, (1, 5)), torch.arange(5), cache=cache)


# --- config JSON ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_through_json(name: str, tmp_path) -> None:
    cfg = ModelConfig.preset(name)
    path = tmp_path / "config.json"
    text = cfg.to_json(path)
    assert json.loads(text) == json.loads(path.read_text())
    assert ModelConfig.from_json(path) == cfg
    for key, value in PRESETS[name].items():  # the preset's own values survive
        assert json.loads(text)[key] == value


def test_round_trip_keeps_rope_scaling_and_derived_sizes(tmp_path) -> None:
    cfg = _cfg(
        position="rope",
        n_kv_heads=2,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_seq_len": 16, "mscale": 0.7},
    )
    path = tmp_path / "config.json"
    cfg.to_json(path)
    again = ModelConfig.from_json(path)
    assert again == cfg
    assert (again.head_dim, again.d_ff, again.n_kv_heads) == (8, 128, 2)


def test_unknown_json_field_is_a_config_error_naming_it(tmp_path) -> None:
    data = _cfg().to_dict() | {"n_head": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"unknown ModelConfig field\(s\) \['n_head'\]"):
        ModelConfig.from_json(path)


# --- it learns ----------------------------------------------------------------------------------


def test_tiny_gpt_overfits_one_batch() -> None:
    model = GPT(
        ModelConfig(
            vocab_size=16, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, position="rope"
        )
    )
    ids = torch.randint(0, 16, (2, 16))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with torch.no_grad():
        first = float(model.loss(inputs, targets).loss)
    assert first == pytest.approx(math.log(16), abs=0.3)  # random init: near uniform
    for _step in range(200):
        loss = model.loss(inputs, targets).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if float(loss.detach()) < 0.1:
            break
    assert float(loss.detach()) < 0.1
