"""Parity with Hugging Face transformers for every causal architecture glassformer loads.

Each case builds a tiny random transformers model offline from a config object, saves it with
save_pretrained and loads the folder with gf.from_pretrained. Then (a) fp32 logits on a
left-padded batch (explicit position ids on both sides: a plain transformers forward does not
derive them from the attention mask) agree within 1e-4 on the real positions, and (b) greedy
32-token continuations through glassformer's Engine (KV cache) equal transformers' generate,
with every cached decode step's logits within 1e-4 of generate's.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import transformers

import glassformer as gf

ATOL = 1e-4
VOCAB = 96
N_NEW = 32
PROMPT_LEN = 8
# Larger than transformers' 0.02: logits spread like a real model's (std about 1), greedy
# continuations vary instead of repeating one token, and 1e-4 is a tight bound.
INIT_STD = 0.2


def _gpt2(**kw: Any) -> transformers.GPT2Config:
    base = dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=None, eos_token_id=None, initializer_range=INIT_STD,
    )  # fmt: skip
    return transformers.GPT2Config(**(base | kw))


def _rope(kind: str = "default", theta: float = 10000.0, **kw: Any) -> dict[str, Any]:
    return {"rope_type": kind, "rope_theta": theta, **kw}


_LLAMA_BASE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    bos_token_id=None, eos_token_id=None, rope_parameters=_rope(),
    initializer_range=INIT_STD,
)  # fmt: skip


def _llama_like(cls: type, **kw: Any) -> transformers.PretrainedConfig:
    return cls(**(_LLAMA_BASE | kw))


def _llama(**kw: Any) -> transformers.LlamaConfig:
    return _llama_like(transformers.LlamaConfig, **kw)


def _qwen2(**kw: Any) -> transformers.Qwen2Config:
    return _llama_like(transformers.Qwen2Config, **kw)


def _qwen3(**kw: Any) -> transformers.Qwen3Config:
    return _llama_like(transformers.Qwen3Config, **(dict(head_dim=8) | kw))


def _mistral(**kw: Any) -> transformers.MistralConfig:
    return _llama_like(transformers.MistralConfig, **(dict(sliding_window=None) | kw))


def _mixtral(**kw: Any) -> transformers.MixtralConfig:
    return _llama_like(transformers.MixtralConfig, **kw)


_YARN = dict(factor=4.0, original_max_position_embeddings=16)
_YARN_OPTIONS = dict(
    factor=8.0,
    original_max_position_embeddings=32,
    beta_fast=16.0,
    beta_slow=2.0,
    attention_factor=1.2,
)
_LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)

CASES: dict[str, transformers.PretrainedConfig] = {
    # GPT-2: Conv1D transposes, fused c_attn, learned positions, activations, tying
    "gpt2": _gpt2(),
    "gpt2-gelu-n_inner-2heads": _gpt2(activation_function="gelu", n_inner=48, n_head=2),
    "gpt2-relu-untied-8heads": _gpt2(
        activation_function="relu", tie_word_embeddings=False, n_head=8
    ),
    "gpt2-pytorch_tanh-eps": _gpt2(
        activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-3, n_embd=64
    ),
    "gpt2-reorder_and_upcast": _gpt2(reorder_and_upcast_attn=True, n_layer=1),
    # Llama: head counts, GQA/MQA, explicit head_dim, biases, activations, tying, rope settings
    "llama-mha-tied": _llama(tie_word_embeddings=True, rms_norm_eps=1e-5),
    "llama-gqa-untied-theta": _llama(
        num_attention_heads=8, num_key_value_heads=2, rope_parameters=_rope(theta=5e5)
    ),
    "llama-mqa-head_dim": _llama(
        hidden_size=48, num_attention_heads=4, num_key_value_heads=1, head_dim=16
    ),
    "llama-biases-gelu": _llama(
        attention_bias=True, mlp_bias=True, hidden_act="gelu", num_key_value_heads=2
    ),
    "llama-attention_bias-only": _llama(attention_bias=True, num_key_value_heads=2),
    "llama-rope-linear": _llama(rope_parameters=_rope("linear", factor=2.0)),
    # dynamic NTK: logits past max_position_embeddings (the base grows), generation inside it
    "llama-rope-dynamic": _llama(
        max_position_embeddings=48, rope_parameters=_rope("dynamic", factor=2.0)
    ),
    "llama-rope-yarn": _llama(rope_parameters=_rope("yarn", **_YARN), num_key_value_heads=2),
    "llama-rope-yarn-betas-attention_factor": _llama(
        rope_parameters=_rope("yarn", 5e5, **_YARN_OPTIONS), hidden_size=64
    ),
    "llama-rope-yarn-mscale-no-truncate": _llama(
        rope_parameters=_rope("yarn", **_YARN, mscale=0.8, mscale_all_dim=0.5, truncate=False)
    ),
    "llama-rope-llama3": _llama(
        rope_parameters=_rope("llama3", 5e5, **_LLAMA3, original_max_position_embeddings=16),
        num_attention_heads=8,
        num_key_value_heads=4,
        hidden_size=64,
    ),
    # Qwen2: q/k/v biases, a window over every layer
    "qwen2-gqa-tied": _qwen2(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2-mqa-theta": _qwen2(
        num_attention_heads=8, num_key_value_heads=1, rope_parameters=_rope(theta=1e6)
    ),
    "qwen2-sliding-window": _qwen2(use_sliding_window=True, sliding_window=6, max_window_layers=0),
    # Qwen3: per-head RMSNorm on q and k, explicit head_dim, one attention_bias for q/k/v/o
    "qwen3-gqa-tied": _qwen3(num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3-mqa-head_dim16-bias": _qwen3(
        num_key_value_heads=1, head_dim=16, attention_bias=True, rope_parameters=_rope(theta=1e6)
    ),
    "qwen3-sliding-window": _qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=0),
    # Mistral: sliding windows shorter than prompt + continuation
    "mistral-window8-gqa": _mistral(sliding_window=8, num_key_value_heads=2),
    "mistral-window5-mqa-head_dim": _mistral(sliding_window=5, num_key_value_heads=1, head_dim=16),
    "mistral-no-window-tied": _mistral(tie_word_embeddings=True),
    # Mixtral: experts and top-k
    "mixtral-4x2-gqa": _mixtral(num_local_experts=4, num_experts_per_tok=2, num_key_value_heads=2),
    "mixtral-8x1-window": _mixtral(num_local_experts=8, num_experts_per_tok=1, sliding_window=7),
    "mixtral-3x3-gelu-tied": _mixtral(
        num_local_experts=3, num_experts_per_tok=3, hidden_act="gelu", tie_word_embeddings=True
    ),
}
# Length of the padded batch: 20 by default; longer where the rope scaling acts on length.
LOGITS_LENGTH = {
    "llama-rope-dynamic": 64,  # past max_position_embeddings=48
    "llama-rope-yarn": 40,
    "llama-rope-yarn-betas-attention_factor": 40,
    "llama-rope-yarn-mscale-no-truncate": 40,
    "llama-rope-llama3": 40,
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> folder of the saved transformers model (built once per module)."""
    folders: dict[str, Any] = {}

    def get(name: str):
        if name not in folders:
            torch.manual_seed(sum(map(ord, name)))
            model = transformers.AutoModelForCausalLM.from_config(CASES[name])
            with torch.no_grad():  # norm gains start at 1: make a swapped or missing one show
                for param_name, param in model.named_parameters():
                    if param.dim() == 1 and "norm" in param_name:
                        param.normal_(1.0, 0.2)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(folder)
            folders[name] = folder
        return folders[name]

    return get


def _load_both(folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    model, _ = gf.from_pretrained(folder)
    return hf, model.eval()


def _left_padded_batch(length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask and position ids of three left-padded sequences."""
    lengths = [length, length - 5, length // 3]
    ids = torch.randint(0, VOCAB, (len(lengths), length))
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, length - n :] = 1
        ids[row, : length - n] = 0  # padding id: anything in the vocabulary
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


@pytest.mark.parametrize("name", list(CASES))
def test_logits_on_left_padded_batch_equal_transformers(name: str, saved) -> None:
    hf, model = _load_both(saved(name))
    ids, mask, positions = _left_padded_batch(LOGITS_LENGTH.get(name, 20))
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, padding_mask=mask.bool(), position_ids=positions)
    real = mask.bool()
    difference = (got[real] - expected[real]).abs().max().item()
    assert difference <= ATOL, f"{name}: max |logit difference| {difference:.2e}"


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_generation_equals_transformers(name: str, saved) -> None:
    hf, model = _load_both(saved(name))
    prompt = torch.randint(0, VOCAB, (1, PROMPT_LEN))
    with torch.no_grad():
        out = hf.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=N_NEW,
            min_new_tokens=N_NEW,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, PROMPT_LEN:].tolist()
    result = gf.Engine(model).generate(prompt[0].tolist(), max_new_tokens=N_NEW, temperature=0.0)
    assert result.token_ids == expected, name
    assert result.stats.stop_reason == "max_new_tokens"

    # The same continuation step by step through glassformer's KV cache: every step's logits
    # equal the ones generate chose from.
    cache = model.new_cache(1, PROMPT_LEN + N_NEW)
    steps = [prompt, *out.sequences[:, PROMPT_LEN:-1].split(1, dim=1)]
    with torch.no_grad():
        starts = [0, *range(PROMPT_LEN, PROMPT_LEN + len(steps) - 1)]
        logits = [
            model(step, torch.arange(p, p + step.shape[1]), cache=cache, last_token_only=True)
            for step, p in zip(steps, starts, strict=True)
        ]
        logits = [step_logits[:, -1] for step_logits in logits]
    difference = (torch.cat(logits) - torch.cat(out.logits)).abs().max().item()
    assert difference <= ATOL, f"{name}: max |cached logit difference| {difference:.2e}"


def test_gpt2_model_checkpoint_without_prefix_loads_with_tied_head(tmp_path) -> None:
    """GPT2Model (and OpenAI's original export) store h.0... without `transformer.`."""
    hf = transformers.GPT2Model(_gpt2()).eval()
    hf.save_pretrained(tmp_path)
    model, _ = gf.from_pretrained(tmp_path)
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        expected = hf(ids).last_hidden_state
        hidden = model.hidden_states(ids)
        logits = model(ids)
    assert (hidden - expected).abs().max().item() <= ATOL
    assert (logits - expected @ hf.wte.weight.T).abs().max().item() <= ATOL


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
        {"rope_type": "llama3", **_LLAMA3, "original_max_position_embeddings": 16},
    ],
    ids=lambda scaling: scaling.get("type") or scaling["rope_type"],
)
def test_transformers_4_rope_scaling_config_loads_the_same(rope_scaling, tmp_path) -> None:
    """config.json files written by transformers 4.x spell RoPE as rope_theta + rope_scaling."""
    config = _llama(num_key_value_heads=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    file = tmp_path / "config.json"
    data = json.loads(file.read_text())
    del data["rope_parameters"]
    file.write_text(json.dumps(data | {"rope_theta": 5e5, "rope_scaling": rope_scaling}))
    hf, model = _load_both(tmp_path)
    assert hf.config.rope_parameters["rope_theta"] == 5e5
    ids, mask, positions = _left_padded_batch(40)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=positions).logits
        got = model(ids, padding_mask=mask.bool(), position_ids=positions)
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= ATOL
