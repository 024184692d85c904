"""The lab's claims 10 (MoE) and 11 (residuals and norm placement): ModelConfig.residual against a
hand-composed block and the numpy forward, and the experiments' helpers against hand counts, hand
loops and the lab's own spread rule."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from glassformer import numpy_ref
from glassformer.config import ModelConfig
from glassformer.lab.exp_moe import (
    DENSE,
    DENSE_TOTAL,
    MOE,
    N_EXPERTS,
    TOP_K,
    expert_load,
    model_configs,
)
from glassformer.lab.exp_residuals import gradient_norms
from glassformer.lab.fit import Schedule
from glassformer.lab.timing import Timer
from glassformer.models import build_model
from glassformer.nn.attention import AttentionMask
from glassformer.nn.ffn import MoE
from glassformer.train.trainer import make_optimizer


def _tiny(**overrides) -> ModelConfig:
    base = dict(vocab_size=23, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, bias=True)
    return ModelConfig(**{**base, **overrides})


def _model(cfg: ModelConfig, seed: int = 0):
    with torch.random.fork_rng():  # leaves the global generator as it was
        torch.manual_seed(seed)
        return build_model(cfg).eval()


def _block_io(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first block's input and output during model(ids)."""
    seen = {}

    def hook(module, args, output):
        seen["x"], seen["y"] = args[0], output

    handle = model.blocks[0].register_forward_hook(hook)
    with torch.no_grad():
        model(ids)
    handle.remove()
    return seen["x"], seen["y"]


# --- ModelConfig.residual ---------------------------------------------------------------------


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_block_without_residual_is_the_hand_composition(norm_position: str) -> None:
    model = _model(_tiny(residual=False, norm_position=norm_position))
    ids = torch.randint(0, 23, (2, 7), generator=torch.Generator().manual_seed(1))
    x, y = _block_io(model, ids)
    block, mask = model.blocks[0], AttentionMask(is_causal=True)
    with torch.no_grad():
        if norm_position == "pre":  # f(norm(x)), twice, with no "x +"
            h = block.attn(block.attn_norm(x), mask)
            expected = block.ffn(block.ffn_norm(h))
        else:  # norm(f(x)), twice
            h = block.attn_norm(block.attn(x, mask))
            expected = block.ffn_norm(block.ffn(h))
        with_residual = x + block.attn(block.attn_norm(x), mask)
    torch.testing.assert_close(y, expected)
    assert (y - with_residual).abs().max() > 1e-3  # the switch changes something


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_numpy_forward_honours_residual_false(norm_position: str) -> None:
    model = _model(_tiny(residual=False, norm_position=norm_position, n_layers=2))
    ids = torch.randint(0, 23, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).numpy()
    got = numpy_ref.forward(numpy_ref.weights_from_model(model), model.cfg, ids.numpy())
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)


def test_residual_round_trips_through_json(tmp_path) -> None:
    cfg = _tiny(residual=False)
    path = tmp_path / "config.json"
    text = cfg.to_json(path)
    assert json.loads(text)["residual"] is False
    assert ModelConfig.from_json(path) == cfg
    old = json.loads(text)
    del old["residual"]  # a config saved before the field existed keeps its residuals
    assert ModelConfig.from_dict(old).residual is True


# --- claim 11's helpers -----------------------------------------------------------------------


def _batch(seed: int, length: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 23, (2, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "targets": ids[:, 1:]}


@pytest.mark.parametrize("residual", [True, False])
def test_parameter_gradient_norms_match_named_parameters(residual: bool) -> None:
    model = _model(_tiny(n_layers=3, residual=residual))
    batch = _batch(3)
    norms, _ = gradient_norms(model, batch)
    model.loss(**batch).ce_loss.backward()
    for layer, got in enumerate(norms):
        squares = sum(
            float(p.grad.double().pow(2).sum())
            for name, p in model.named_parameters()
            if name.startswith(f"blocks.{layer}.") and p.grad is not None
        )
        assert got == pytest.approx(math.sqrt(squares), rel=1e-5)


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_hidden_gradient_norms_match_a_hand_loop(norm_position: str) -> None:
    """|dloss/dh| of each block's input, against autograd.grad through the blocks run by hand."""
    model = _model(_tiny(n_layers=3, norm_position=norm_position, residual=False))
    batch = _batch(5)
    _, got = gradient_norms(model, batch)
    ids, T = batch["input_ids"], batch["input_ids"].shape[1]
    h = model.tok_emb(ids) + model.pos_emb(torch.arange(T)[None])  # (B, T, C)
    inputs = []
    for block in model.blocks:
        inputs.append(h)
        h = block(h, AttentionMask(is_causal=True))
    logits = model.lm_head(model.final_norm(h))  # (B, T, V)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
    expected = [float(g.norm()) for g in torch.autograd.grad(loss, inputs)]
    assert got == pytest.approx(expected, rel=1e-5)
    assert all(p.grad is None for p in model.parameters())  # the model is left as it was


# --- claim 10's helpers -----------------------------------------------------------------------


def test_moe_runs_as_many_ffn_weights_as_one_dense_model_and_holds_as_many_as_the_other() -> None:
    d_model, width = 32, 96
    models = {name: _model(cfg) for name, cfg in model_configs(23, d_model, 2, width, 16).items()}
    dense_ffn = sum(p.numel() for p in models[DENSE].blocks[0].ffn.parameters())
    total_ffn = sum(p.numel() for p in models[DENSE_TOTAL].blocks[0].ffn.parameters())
    moe_ffn = models[MOE].blocks[0].ffn
    one_expert = sum(p.numel() for p in moe_ffn.experts[0].parameters())
    assert dense_ffn == 3 * d_model * width  # SwiGLU: gate, up, down, no biases
    assert TOP_K * one_expert == dense_ffn  # what a token runs
    assert len(moe_ffn.experts) == N_EXPERTS
    assert total_ffn == N_EXPERTS * one_expert  # what the MoE holds, its router aside


def test_expert_load_is_each_experts_share() -> None:
    model = _model(_tiny(ffn="moe", n_experts=4, n_experts_per_token=2, d_ff=8, n_layers=2))
    ids = torch.randint(0, 23, (3, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert all(int(m.expert_counts.sum()) == 3 * 8 * 2 for m in layers)  # N tokens x k
    layers[0].expert_counts = torch.tensor([6, 0, 3, 3])  # a hand-made count
    shares, aux = expert_load(model)
    assert shares[0] == pytest.approx([0.5, 0.0, 0.25, 0.25])
    assert sum(shares[1]) == pytest.approx(1.0)
    assert aux == pytest.approx([float(m.aux_loss) for m in layers])


def test_timer_train_step_is_one_optimizer_step_and_generation_times_are_positive() -> None:
    cfg = model_configs(23, 16, 1, 32, 8)[MOE]
    model, by_hand = _model(cfg), _model(cfg)
    batch = _batch(6)
    timer = Timer(model, batch, prompt=[1, 2, 3], n_new=3)
    assert timer.train_step() > 0
    optimizer = make_optimizer(by_hand, Schedule(max_steps=1))  # the same settings, a hand loop
    by_hand.train()
    by_hand.loss(**batch).loss.backward()
    optimizer.step()
    for (name, got), expected in zip(model.named_parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(got, expected, msg=name)
    assert all(p.grad is None for p in model.parameters())
    prefill, decode = timer.generate()
    assert prefill > 0 and decode > 0 and math.isfinite(prefill + decode)
