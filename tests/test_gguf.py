"""GGUF files against transformers, and the chat face built on them.

Synthetic files (fast): a tiny random transformers Llama or Qwen2 is written to GGUF the way
llama.cpp's converter writes it (q/k rows permuted for "llama", metadata keys, a small
byte-level BPE vocabulary), then glassformer's logits are compared with the transformers model
itself. That checks the un-permute for every GQA ratio independently of SmolLM2. A second file
mixes every tensor type (F16, BF16, Q4_0 ... Q8_0, K-quants) and is compared with transformers
loading the same file, whose dequantizers are its own.

SmolLM2 (slow): glassformer's tokenizer, logits and greedy continuations against transformers
loading the same Q4_1 file; then the CLI: generate, info and an interactive chat.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import regex
import torch
import transformers
from conftest import finish_gguf
from gguf import GGMLQuantizationType as Q
from processes import DEADLINE_S

from glassformer.chat import ChatSession
from glassformer.cli import main
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams
from glassformer.interop.gguf import load_gguf
from glassformer.interop.hf import InteropError
from glassformer.interop.pretrained import from_pretrained, resolve
from glassformer.tokenizers import BPETokenizer

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TEXTS = [
    "Hello world",
    "  leading and trailing spaces  ",
    "12345 and 3.14159, 2024-01-01",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "注意力机制让每个词一次性看全句。",
    "emoji 🎉🤖 and 👩‍💻!",
    "don't I'LL we've\ttabs\r\nand newlines\n\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
]
INIT_STD = 0.2  # logits spread like a real model's, so 1e-4 is a tight bound


# --- writing GGUF files the way llama.cpp's converter does ------------------------------------


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.fixture(scope="module")
def vocab() -> dict[str, Any]:
    """A small byte-level BPE, trained here, as the token/merge lists a GGUF stores."""
    corpus = [t * 3 for t in TEXTS] + ["The quick brown fox jumps over the lazy dog. " * 5]
    tokenizer = BPETokenizer.train(corpus, vocab_size=400, special_tokens=SPECIALS)
    model = json.loads(tokenizer.hf.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    return {"tokens": tokens, "merges": merges, "types": types}


def _hf_to_gguf_names(i: int) -> dict[str, str]:
    hf, blk = f"model.layers.{i}", f"blk.{i}"
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    }  # fmt: skip
    return {
        f"{hf}.{a}.{kind}": f"{blk}.{b}.{kind}"
        for a, b in names.items()
        for kind in ("weight", "bias")
    }


def write_gguf(
    path: Path,
    model: transformers.PreTrainedModel,
    vocab: dict[str, Any],
    *,
    arch: str = "llama",
    pre: str = "gpt2",
    qtypes: list[Q] | None = None,
    add_bos: bool = False,
    extra_tensors: dict[str, np.ndarray] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    if head_dim != cfg.hidden_size // cfg.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(cfg.vocab_size)
    if rope["rope_type"] in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
        if "original_max_position_embeddings" in rope:
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["tokens"].index("<|im_start|>"))
    writer.add_eos_token_id(vocab["tokens"].index("<|im_end|>"))
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHATML)

    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        names |= _hf_to_gguf_names(i)
    permute = arch == "llama"  # llama.cpp's Qwen2 rotates like HF: no permutation
    n_matrices = 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name not in names or names[hf_name] in drop:
            continue
        data = tensor.numpy().astype(np.float32)
        if permute and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_attention_heads)
        if permute and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, cfg.num_attention_heads, cfg.num_key_value_heads)
        if data.ndim == 2 and qtypes:
            _add_typed(writer, names[hf_name], data, qtypes[n_matrices % len(qtypes)])
            n_matrices += 1
        else:
            writer.add_tensor(names[hf_name], data)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    finish_gguf(writer)
    return path


# K-quant blocks: (elements, bytes, byte offsets of fp16 scales). The gguf package cannot
# quantize to these, so their blocks are random bytes with small valid scales.
K_QUANTS = {
    Q.Q2_K: (256, 84, (80, 82)),
    Q.Q3_K: (256, 110, (108,)),
    Q.Q4_K: (256, 144, (0, 2)),
    Q.Q5_K: (256, 176, (0, 2)),
    Q.Q6_K: (256, 210, (208,)),
}


def _add_typed(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: Q) -> None:
    if qtype == Q.F32:
        writer.add_tensor(name, data)
    elif qtype == Q.F16:
        writer.add_tensor(name, data.astype(np.float16))
    elif qtype in K_QUANTS:
        elements, nbytes, scale_offsets = K_QUANTS[qtype]
        rng = np.random.default_rng(len(name))
        blocks = rng.integers(0, 256, (data.shape[0], data.shape[1] // elements, nbytes))
        blocks = blocks.astype(np.uint8)
        for offset in scale_offsets:
            scale = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
            blocks[..., offset : offset + 2] = scale[..., None].view(np.uint8)
        writer.add_tensor(name, blocks.reshape(data.shape[0], -1), raw_dtype=qtype)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _randomize(model: torch.nn.Module) -> torch.nn.Module:
    # transformers initializes norms to 1 and biases to 0: random values catch swapped names.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0.0, INIT_STD)
    return model.eval()


def tiny_hf_model(kind: str = "llama", **overrides: Any) -> transformers.PreTrainedModel:
    base = dict(
        vocab_size=400, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
        rms_norm_eps=1e-5, initializer_range=INIT_STD, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    if kind == "qwen2":
        config = transformers.Qwen2Config(**(base | {"use_sliding_window": False} | overrides))
        return _randomize(transformers.Qwen2ForCausalLM(config))
    if kind == "qwen3":
        config = transformers.Qwen3Config(**(base | {"use_sliding_window": False} | overrides))
        return _randomize(transformers.Qwen3ForCausalLM(config))
    return _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**(base | overrides))))


def _ids(vocab_size: int, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, length), generator=torch.Generator().manual_seed(1))


def _max_diff(gf_model: torch.nn.Module, hf_model: torch.nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return (gf_model(ids) - hf_model(ids).logits).abs().max().item()


# --- synthetic files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, tied",
    [(4, 4, 12, False), (4, 2, 12, True), (6, 2, 8, False), (8, 1, 6, True), (4, 1, 12, False),
     (4, 2, 16, False)],  # the last: heads * head_dim != hidden_size (attention.key_length)
)  # fmt: skip
def test_llama_gguf_unpermutes_qk_for_every_gqa_ratio(
    tmp_path, vocab, heads, kv_heads, head_dim, tied
):
    hf = tiny_hf_model(
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied,
    )  # fmt: skip
    model, _ = load_gguf(write_gguf(tmp_path / "m.gguf", hf, vocab))
    cfg = model.cfg
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (
        heads, kv_heads, head_dim, tied,
    )  # fmt: skip
    assert _max_diff(model, hf, _ids(400)) <= 1e-4


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 10000.0,
        },
    ],
    ids=["theta", "linear", "yarn"],
)
def test_llama_gguf_rope_settings_match_transformers(tmp_path, vocab, rope):
    hf = tiny_hf_model(rope_parameters=rope, num_key_value_heads=2)
    model, _ = load_gguf(write_gguf(tmp_path / "m.gguf", hf, vocab))
    ids = _ids(400, batch=1, length=100)  # past the yarn model's original 32 positions
    assert _max_diff(model, hf, ids) <= 1e-4


def test_qwen2_gguf_biases_and_unpermuted_rows_match_transformers(tmp_path, vocab):
    hf = tiny_hf_model(
        "qwen2", num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True
    )
    model, _ = load_gguf(write_gguf(tmp_path / "q.gguf", hf, vocab, arch="qwen2", pre="qwen2"))
    assert model.cfg.has_bias("qkv") and not model.cfg.has_bias("attn_out")
    assert _max_diff(model, hf, _ids(400)) <= 1e-4


def test_qwen3_gguf_qk_norms_match_transformers(tmp_path, vocab):
    hf = tiny_hf_model("qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model, _ = load_gguf(write_gguf(tmp_path / "q3.gguf", hf, vocab, arch="qwen3", pre="qwen2"))
    assert model.cfg.qk_norm and model.cfg.head_dim == 16
    assert _max_diff(model, hf, _ids(400)) <= 1e-4


def test_every_tensor_type_dequantizes_like_transformers(tmp_path, vocab):
    """Each weight matrix in its own type; transformers dequantizes the same file with its own
    torch kernels. Rows of 256 elements, the K-quants' block size."""
    hf = tiny_hf_model(
        hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2
    )
    qtypes = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, *K_QUANTS]
    path = write_gguf(tmp_path / "mixed.gguf", hf, vocab, qtypes=qtypes)
    types = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert set(qtypes) <= types
    model, _ = load_gguf(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="mixed.gguf"
    ).eval()
    assert _max_diff(model, reference, _ids(400)) <= 1e-4


def reference_ids(reference, text: str, pre: str) -> list[int]:
    """transformers' ids; for "smollm", llama.cpp's split first.

    llama.cpp's smollm pre-tokenizer isolates every digit (regex "\\p{N}") before GPT-2's
    split, as SmolLM2's own tokenizer.json does with Digits(individual_digits=True).
    transformers 5's GGUF loader knows no "smollm" entry and skips that step, so the digit
    split is applied here and transformers encodes the pieces."""
    if pre != "smollm":
        return reference(text)["input_ids"]
    pieces = [p for p in regex.split(r"(\p{N})", text) if p]
    ids = [i for p in pieces for i in reference(p, add_special_tokens=False)["input_ids"]]
    return reference("")["input_ids"] + ids  # the BOS, when the file asks for one


@pytest.mark.parametrize("pre, add_bos", [("gpt2", False), ("smollm", True), ("llama-bpe", False),
                                          ("qwen2", False)])  # fmt: skip
def test_tokenizer_from_metadata_matches_transformers(tmp_path, vocab, pre, add_bos):
    hf = tiny_hf_model(num_hidden_layers=1)
    write_gguf(tmp_path / "t.gguf", hf, vocab, pre=pre, add_bos=add_bos)
    _, tokenizer = load_gguf(tmp_path / "t.gguf")
    reference = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in TEXTS:
        assert tokenizer.encode(text) == reference_ids(reference, text, pre), text
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text == reference.decode(ids)
    plain = tokenizer.encode("x", add_special_tokens=False)
    assert tokenizer.encode("x") == ([tokenizer.bos_token_id] if add_bos else []) + plain


def test_from_pretrained_reads_gguf_and_chat_stops_and_survives_ctrl_c(tmp_path, vocab):
    hf = tiny_hf_model(num_key_value_heads=2)
    model, tokenizer = from_pretrained(write_gguf(tmp_path / "c.gguf", hf, vocab))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHATML
    session = ChatSession(
        Engine(model),
        tokenizer,
        system="Be brief.",
        sampling=SamplingParams(max_new_tokens=20, temperature=0.7),
    )
    pieces: list[str] = []

    def write_then_interrupt(piece: str) -> None:
        pieces.append(piece)
        if len(pieces) == 3:
            raise KeyboardInterrupt  # what Ctrl-C raises in the middle of a reply

    reply = session.send("hi there", write=write_then_interrupt)
    assert reply.stop_reason == "interrupted" and 1 <= len(reply.token_ids) <= 3
    assert session.messages[-1] == {"role": "assistant", "content": reply.text}
    # The next turn works and sees the whole history, rendered by the template.
    second = session.send("and again", write=lambda _: None)
    assert second.stop_reason in ("end_of_turn", "max_new_tokens")
    expected = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi there"},
                {"role": "assistant", "content": reply.text},
                {"role": "user", "content": "and again"},
                {"role": "assistant", "content": second.text}]  # fmt: skip
    assert session.messages == expected
    session.reset()
    assert session.messages == [{"role": "system", "content": "Be brief."}]


# --- bad input --------------------------------------------------------------------------------


def test_not_a_gguf_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a GGUF file at all" * 4)
    with pytest.raises(InteropError, match="not a readable GGUF file"):
        load_gguf(bad)
    with pytest.raises(InteropError, match="no GGUF file"):
        load_gguf(tmp_path / "missing.gguf")


def test_unsupported_architecture_and_tokenizer_are_named(tmp_path, vocab):
    hf = tiny_hf_model(num_hidden_layers=1)
    with pytest.raises(InteropError, match=r"architecture 'gpt2' is not supported.*llama, qwen2"):
        load_gguf(write_gguf(tmp_path / "a.gguf", hf, vocab, arch="gpt2"))
    with pytest.raises(InteropError, match=r"tokenizer.ggml.pre='tekken' is not supported"):
        load_gguf(write_gguf(tmp_path / "b.gguf", hf, vocab, pre="tekken"))


def test_missing_extra_and_rope_factor_tensors_are_refused(tmp_path, vocab):
    hf = tiny_hf_model(num_hidden_layers=1)
    with pytest.raises(InteropError, match=r"lacks tensor\(s\).*blk.0.ffn_up.weight"):
        load_gguf(write_gguf(tmp_path / "a.gguf", hf, vocab, drop=("blk.0.ffn_up.weight",)))
    extra = {"blk.0.mystery.weight": np.ones(4, dtype=np.float32)}
    with pytest.raises(InteropError, match=r"does not use: blk.0.mystery.weight"):
        load_gguf(write_gguf(tmp_path / "b.gguf", hf, vocab, extra_tensors=extra))
    factors = {"rope_freqs.weight": np.linspace(1, 8, 6).astype(np.float32)}
    with pytest.raises(InteropError, match="per-frequency factors"):
        load_gguf(write_gguf(tmp_path / "c.gguf", hf, vocab, extra_tensors=factors))
    ones = {"rope_freqs.weight": np.ones(6, dtype=np.float32)}  # no scaling: nothing lost
    load_gguf(write_gguf(tmp_path / "d.gguf", hf, vocab, extra_tensors=ones))


# --- SmolLM2: the real Q4_1 file --------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve("smollm2")


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load_gguf(smollm2_path)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2_path):
    """transformers dequantizes the same file to fp32 with its own code (module-wide: slow)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        smollm2_path.parent, gguf_file=smollm2_path.name
    )
    return model.eval(), tokenizer


SMOLLM2_TEXTS = [
    *TEXTS,
    "The year 1969: Apollo 11 landed on the Moon at 20:17 UTC.",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|endoftext|>",
    "   multiple   spaces\n\n\n",
]


@pytest.mark.slow
def test_smollm2_tokenizer_and_chat_template_match_transformers(smollm2, hf_smollm2):
    _, tokenizer = smollm2
    _, reference = hf_smollm2
    for text in SMOLLM2_TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert tokenizer.decode(ids) == text == reference.decode(ids)
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.encode("12345") == [
        33,
        34,
        35,
        36,
        37,
    ]
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ours == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert (tokenizer.bos_token, tokenizer.eos_token) == (reference.bos_token, reference.eos_token)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    reference, _ = hf_smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [
        "The capital of France is",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
        tokenizer.apply_chat_template(messages, add_generation_prompt=True),
    ]
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt, add_special_tokens=False)])
        assert _max_diff(model, reference, ids) <= 1e-3, prompt


@pytest.mark.slow
def test_smollm2_greedy_continuation_matches_transformers(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    reference, _ = hf_smollm2
    ids = tokenizer.encode("Once upon a time, in a small village,")
    ours = Engine(model).generate(ids, max_new_tokens=32, temperature=0.0).token_ids
    with torch.no_grad():
        theirs = reference.generate(
            torch.tensor([ids]), max_new_tokens=32, do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )[0, len(ids) :].tolist()  # fmt: skip
    assert len(ours) == 32 and ours == theirs


@pytest.mark.slow
def test_cli_generate_and_info_with_the_smollm2_alias(capsys, hf_smollm2):
    prompt = "The capital of France is"
    argv = ["generate", "--model", "smollm2", prompt, "--temperature", "0", "--max-new-tokens", "6"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(prompt) and "Paris" in out
    assert main(["info", "--model", "smollm2"]) == 0
    out = capsys.readouterr().out
    reference, _ = hf_smollm2
    total = sum(p.numel() for p in reference.parameters())  # tied embeddings counted once
    assert any(line.split()[:2] == ["total", f"{total:,}"] for line in out.splitlines()), out
    # keys + values: 2 x 30 layers x 3 kv heads x 64 dims x 4 bytes
    assert f"fp32: {2 * 30 * 3 * 64 * 4:,} bytes/token" in out


class _Lines:
    """Collects a subprocess's output on a thread, so the test can wait for text to appear."""

    def __init__(self, stream) -> None:
        self.text = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        while chunk := stream.read1(4096):
            with self._lock:
                self.text += chunk.decode("utf-8", errors="replace")

    def wait_for(self, needle: str, after: int = 0, timeout: float = DEADLINE_S) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                found = self.text.find(needle, after)
            if found >= 0:
                return found
            time.sleep(0.02)
        raise AssertionError(f"{needle!r} did not appear; output so far:\n{self.text}")


@pytest.mark.slow
def test_cli_chat_streams_replies_and_ctrl_c_stops_only_the_reply():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "glassformer", "chat", "--model", "smollm2", "--temperature", "0",
         "--threads", "1", "--max-new-tokens", "200"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env,
        # A shell's background job inherits SIGINT ignored, and Python then installs no
        # KeyboardInterrupt handler: give the child the default, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    out = _Lines(process.stdout)
    try:
        out.wait_for("> ")
        process.stdin.write(b"Write a long story about a dragon who learns to fly.\n")
        process.stdin.flush()
        start = out.wait_for("> ") + 2
        out.wait_for(" ", after=start + 20)  # a few words of the reply have streamed
        process.send_signal(signal.SIGINT)
        stopped = out.wait_for("stop: interrupted]", after=start)
        process.stdin.write(b"/reset\nWhat is 2+2?\n/exit\n")
        process.stdin.flush()
        stats = out.wait_for("stop: end_of_turn]", after=stopped)
        assert process.wait(timeout=DEADLINE_S) == 0
    finally:
        process.kill()
    assert "[stopped]" in out.text[start:stopped]
    answer = out.text[out.wait_for("(conversation cleared)", after=stopped) : stats]
    assert "4" in answer and "time to first token" in answer and "tok/s" in answer


def test_chat_keeps_the_conversation_cache_and_equals_a_full_prefill(tmp_path, vocab):
    """Turn N prefills only what follows the prefix it shares with turn N - 1; every reply is
    still token for token what a fresh engine prefilling the whole conversation produces."""
    hf = tiny_hf_model(num_key_value_heads=2)
    model, tokenizer = from_pretrained(write_gguf(tmp_path / "c.gguf", hf, vocab))
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    session = ChatSession(Engine(model), tokenizer, system="Be brief.", sampling=greedy)
    for turn, text in enumerate(["hi there", "and again", "one more", "a fourth"]):
        reply = session.send(text, write=lambda _: None)
        prompt = reply.prompt_ids
        fresh = Engine(model).generate(
            prompt, 8, temperature=0.0, eos_token_id=tokenizer.eos_token_id,
            stop_token_ids=sorted(session.stop_ids),
        )  # fmt: skip
        expected = [t for t in fresh.token_ids if t not in session.stop_ids]
        assert reply.token_ids == expected, f"turn {turn}"
        cached = reply.stats.cached_prompt_tokens
        assert (cached == 0) if turn == 0 else (0 < cached < len(prompt)), f"turn {turn}"
