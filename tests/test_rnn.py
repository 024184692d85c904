"""The RNN family (seed 000 §1): the tutorial's cell equals its formula, LSTM/GRU layers equal
their gate equations, generation from the hidden state equals recomputing from the start, and
an RNN trains and resumes with the same trainer as GPT."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import char_run

from glassformer import ModelConfig, build_model
from glassformer.config import ConfigError
from glassformer.infer.engine import Engine
from glassformer.infer.sampling import SamplingParams, sample
from glassformer.models.rnn import RNNLM, RNNCell
from glassformer.train.config import RunConfig, load_run_config
from glassformer.train.trainer import Trainer

CELLS = ("rnn", "lstm", "gru")
REPO = Path(__file__).resolve().parents[1]


def tiny_rnn(cell: str, **overrides) -> RNNLM:
    # d_model=7: an RNN has no heads, so nothing asks n_heads (default 6) to divide it
    fields = dict(family="rnn", cell=cell, vocab_size=13, d_model=7, n_layers=2)
    fields.update(max_seq_len=64, **overrides)
    model = build_model(ModelConfig(**fields))
    assert isinstance(model, RNNLM)
    return model.eval()


def np_params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().double().numpy() for name, p in module.named_parameters()}


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# --- the cells against their formulas ------------------------------------------------------------


def test_rnn_cell_is_the_tutorial_formula():
    cell = RNNCell(5, 7)
    x, h = torch.randn(3, 5), torch.randn(3, 7)
    p = np_params(cell)
    W_xh, b_xh, W_hh, b_hh = p["W_xh.weight"], p["W_xh.bias"], p["W_hh.weight"], p["W_hh.bias"]
    expected = np.tanh(x.double().numpy() @ W_xh.T + h.double().numpy() @ W_hh.T + b_xh + b_hh)
    np.testing.assert_allclose(cell(x, h).detach().numpy(), expected, atol=1e-6)


def test_rnn_lm_is_the_tutorial_recurrence():
    """One layer, no norm, untied: h_t = tanh(W_xh x_t + W_hh h_{t-1} + b), o_t = W_ho h_t."""
    model = tiny_rnn("rnn", n_layers=1, norm_position="post", tie_embeddings=False)
    ids = torch.randint(13, (2, 6))
    p = np_params(model)
    E, W_ho = p["tok_emb.weight"], p["lm_head.weight"]
    W_xh, W_hh = p["rnn_layers.0.cell.W_xh.weight"], p["rnn_layers.0.cell.W_hh.weight"]
    b = p["rnn_layers.0.cell.W_xh.bias"] + p["rnn_layers.0.cell.W_hh.bias"]
    h = np.zeros((2, 7))
    expected = []
    for t in range(6):
        x_t = E[ids[:, t].numpy()]  # (B, C)
        h = np.tanh(x_t @ W_xh.T + h @ W_hh.T + b)
        expected.append(h @ W_ho.T)
    logits = model(ids).detach().numpy()  # (B, T, V)
    np.testing.assert_allclose(logits, np.stack(expected, axis=1), atol=1e-6)


def lstm_step(p: dict, x: np.ndarray, h: np.ndarray, c: np.ndarray) -> tuple:
    """torch.nn.LSTM's equations (gate order i, f, g, o), written out."""
    gates = x @ p["weight_ih_l0"].T + p["bias_ih_l0"] + h @ p["weight_hh_l0"].T + p["bias_hh_l0"]
    i, f, g, o = np.split(gates, 4, axis=-1)
    c = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    return sigmoid(o) * np.tanh(c), c


def gru_step(p: dict, x: np.ndarray, h: np.ndarray) -> np.ndarray:
    """torch.nn.GRU's equations (gate order r, z, n), written out."""
    gi = x @ p["weight_ih_l0"].T + p["bias_ih_l0"]
    gh = h @ p["weight_hh_l0"].T + p["bias_hh_l0"]
    (ir, iz, in_), (hr, hz, hn) = np.split(gi, 3, axis=-1), np.split(gh, 3, axis=-1)
    r, z = sigmoid(ir + hr), sigmoid(iz + hz)
    n = np.tanh(in_ + r * hn)
    return (1 - z) * n + z * h


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lstm_and_gru_layers_equal_their_equations_step_by_step(cell):
    model = tiny_rnn(cell, norm_position="post")  # no final norm: the logits are W_ho h_t
    ids = torch.randint(13, (2, 7))
    p = np_params(model)
    layers = [
        {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"rnn_layers.{i}.")}
        for i in range(2)
    ]
    states = [(np.zeros((2, 7)), np.zeros((2, 7))) for _ in layers]
    expected = []
    for t in range(7):
        x = p["tok_emb.weight"][ids[:, t].numpy()]
        for i, lp in enumerate(layers):
            h, c = states[i]
            states[i] = lstm_step(lp, x, h, c) if cell == "lstm" else (gru_step(lp, x, h), c)
            x = states[i][0]
        expected.append(x @ p["tok_emb.weight"].T)  # tied head
    np.testing.assert_allclose(model(ids).detach().numpy(), np.stack(expected, axis=1), atol=1e-6)


def test_bad_cell_name_is_a_config_error():
    with pytest.raises(ConfigError, match="cell='transformer' is not known: pick one of rnn"):
        ModelConfig(family="rnn", cell="transformer")


# --- the hidden state as the generation cache --------------------------------------------------


@pytest.mark.parametrize("cell", CELLS)
def test_cached_decoding_equals_recomputing_from_the_start(cell):
    model = tiny_rnn(cell)
    ids = torch.randint(13, (2, 12))
    with torch.no_grad():
        full = model(ids)  # (B, T, V), no cache
        cache = model.new_cache(batch_size=2)
        stepped = [model(ids[:, :4], cache=cache)]  # prefill 4, then one token at a time
        stepped += [model(ids[:, t : t + 1], cache=cache) for t in range(4, 12)]
    torch.testing.assert_close(torch.cat(stepped, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("cell", CELLS)
def test_engine_generation_equals_recomputing(cell, temperature):
    """Greedy, and seeded sampling (which visits more varied states than a random model's
    greedy loop): the Engine's state-cached tokens equal recomputing the whole prefix."""
    model = tiny_rnn(cell)
    prompt = [3, 1, 4, 1, 5]
    result = Engine(model).generate(prompt, max_new_tokens=20, temperature=temperature, seed=7)
    params = SamplingParams(temperature=temperature)
    generator = torch.Generator().manual_seed(7)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(20):  # the whole sequence recomputed at every position
            logits = model(torch.tensor([ids]))[:, -1]
            ids.append(int(sample(logits, params, generator)))
    assert result.token_ids == ids[len(prompt) :]
    if temperature:
        assert len(set(result.token_ids)) > 3  # the test exercises more than one state
    assert result.stats.kv_cache_bytes == result.stats.kv_cache_capacity_bytes


@pytest.mark.parametrize("cell", CELLS)
def test_state_bytes_do_not_grow_with_the_context(cell):
    model = tiny_rnn(cell)
    per_layer_state = 2 * 7 if cell == "lstm" else 7  # the LSTM also keeps its cell state c
    cache = model.new_cache(batch_size=3)
    assert cache.row_bytes(0) == 0  # a row holds nothing before its first token
    sizes = []
    with torch.no_grad():
        for n in (1, 10, 40):
            cache.reset()
            model(torch.zeros(3, n, dtype=torch.long), cache=cache)
            sizes.append((cache.nbytes, 3 * cache.row_bytes(n)))
    state = 2 * 3 * per_layer_state * 4  # L * B * state * fp32, at any length
    assert sizes == [(state, state)] * 3


@pytest.mark.parametrize("cell", CELLS)
def test_document_ids_restart_the_state(cell):
    """A packed row [doc A | doc B] gives the logits of A and B run separately."""
    model = tiny_rnn(cell)
    a, b = torch.randint(13, (1, 5)), torch.randint(13, (1, 4))
    packed = torch.cat([a, b], dim=1)
    document_ids = torch.tensor([[0] * 5 + [1] * 4])
    with torch.no_grad():
        got = model(packed, document_ids=document_ids, position_ids=torch.zeros_like(packed))
        expected = torch.cat([model(a), model(b)], dim=1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_only_right_padding_is_accepted():
    model = tiny_rnn("lstm")
    ids = torch.randint(13, (1, 5))
    right = torch.tensor([[True, True, True, False, False]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids, padding_mask=right)[:, :3], model(ids[:, :3]))
    with pytest.raises(ValueError, match="only right padding"):
        model(ids, padding_mask=right.flip(1))


# --- training with the shared trainer ----------------------------------------------------------


def rnn_run(out_dir, corpus: str, model: dict | None = None, **train) -> RunConfig:
    lstm = {"family": "rnn", "cell": "lstm", "d_model": 64, "n_layers": 1, "max_seq_len": 32}
    return char_run(out_dir, corpus, lstm | (model or {}), **{"learning_rate": 1e-2, **train})


@pytest.mark.slow
def test_lstm_learns_the_corpus(tmp_path, small_corpus):
    """From ln(V) = 4.2 (uniform guesses) to well below the unigram entropy in 60 steps."""
    run = rnn_run(tmp_path / "run", small_corpus, max_steps=60, batch_size=16, eval_interval=60)
    trainer = Trainer(run, progress=False)
    result = trainer.fit()
    vocab = trainer.tokenizer.vocab_size
    # unit-length embeddings tied to the head give unit-scale logits: a little above ln(V)
    assert result.train_losses[0] == pytest.approx(math.log(vocab), abs=0.6)
    assert result.baseline_loss == pytest.approx(3.3, abs=0.1)  # unigram entropy
    assert result.val_loss < 2.7, result.val_loss  # measured 2.41


def test_rnn_resume_equals_uninterrupted(tmp_path, small_corpus):
    # Dropout between two layers and gradient accumulation make RNG state and data position
    # matter, as in tests/test_train.py.
    model = dict(n_layers=2, dropout=0.1, d_model=32)
    full = Trainer(rnn_run(tmp_path / "straight", small_corpus, model, grad_accum_steps=2),
                   progress=False).fit()  # fmt: skip
    split = rnn_run(tmp_path / "split", small_corpus, model, grad_accum_steps=2)
    Trainer(split, progress=False).fit(max_steps=13)
    resumed = Trainer(split, resume=True, progress=False).fit()
    assert resumed.steps == full.steps == 20
    assert resumed.train_losses == full.train_losses
    assert resumed.val_loss == full.val_loss


def test_rnn_config_matches_the_gpt_config_size():
    """configs/rnn-shakespeare.toml is a like-for-like baseline for shakespeare-char.toml."""
    rnn_run_cfg = load_run_config(REPO / "configs" / "rnn-shakespeare.toml")
    gpt_run_cfg = load_run_config(REPO / "configs" / "shakespeare-char.toml")
    rnn = build_model(rnn_run_cfg.model_config(83))
    gpt = build_model(gpt_run_cfg.model_config(83))
    n_rnn = sum(p.numel() for p in rnn.parameters())
    n_gpt = sum(p.numel() for p in gpt.parameters())
    assert rnn.cfg.family == "rnn" and rnn.cfg.cell == "lstm"
    assert abs(n_rnn / n_gpt - 1) < 0.05, (n_rnn, n_gpt)
    assert rnn_run_cfg.data == gpt_run_cfg.data


def test_info_describes_an_rnn_without_heads(tmp_path, small_corpus, capsys):
    from glassformer.cli import main

    run = rnn_run(tmp_path / "run", small_corpus, {"d_model": 50, "cell": "gru"}, max_steps=2)
    Trainer(run, progress=False).fit()
    assert main(["info", "--model", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "cell gru" in out and "hidden size 50" in out and "recurrent" in out
    assert "heads" not in out and "d_ff" not in out and "KV cache" not in out
    # one layer of h, 50 fp32 numbers: the state does not depend on the context
    assert "fp32: 200 bytes at any context length" in out
