"""Head ablation (glassformer.inspect.ablate) against independent references: W_O's columns of a
head zeroed on a copy, a layer's attention output replaced by zeros, the untouched model."""

from __future__ import annotations

import copy

import pytest
import torch

from glassformer.config import ModelConfig
from glassformer.inspect.ablate import ablate_heads, all_heads, as_spec
from glassformer.models import build_model

H, HKV, D = 4, 2, 8  # GQA: 4 query heads share 2 key/value heads


def _gpt(bias: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=11, d_model=H * D, n_layers=2, n_heads=H, n_kv_heads=HKV,
                      max_seq_len=16, bias=bias, position="rope")  # fmt: skip
    return build_model(cfg).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 11, (2, 9), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def test_ablating_a_head_equals_zeroing_its_columns_of_w_o() -> None:
    model, ids = _gpt(), _ids()
    reference = copy.deepcopy(model)
    for layer, head in [(0, 1), (1, 3)]:  # head 3 shares key/value head 1 with head 2
        reference.blocks[layer].attn.out_proj.weight[:, head * D : (head + 1) * D] = 0.0
    with ablate_heads(model, {0: [1], 1: [3]}):
        ablated = model(ids)
    torch.testing.assert_close(ablated, reference(ids))
    assert not torch.allclose(ablated, model(ids))  # and it did change something


@torch.no_grad()
def test_nothing_ablated_changes_nothing_and_exit_restores() -> None:
    model, ids = _gpt(), _ids()
    before = model(ids)
    with ablate_heads(model, {}):
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    with ablate_heads(model, {0: []}):
        torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="boom"), ablate_heads(model, {0: [0, 1]}):
        raise RuntimeError("boom")
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    assert all(not attn.out_proj._forward_pre_hooks for attn in (b.attn for b in model.blocks))


@torch.no_grad()
def test_all_heads_of_a_layer_is_a_zero_attention_output() -> None:
    model, ids = _gpt(bias=False), _ids()
    reference = copy.deepcopy(model)
    reference.blocks[1].attn.register_forward_hook(lambda m, args, out: torch.zeros_like(out))
    with ablate_heads(model, {1: list(range(H))}):
        torch.testing.assert_close(model(ids), reference(ids))


def test_gradients_still_flow_through_the_other_heads() -> None:
    model, ids = _gpt(), _ids()
    with ablate_heads(model, {0: [0]}):
        model.loss(ids, ids).loss.backward()
    grad = model.blocks[0].attn.out_proj.weight.grad  # (C, H*D)
    assert torch.all(grad[:, :D] == 0) and grad[:, D:].abs().sum() > 0


def test_bad_layers_and_heads_are_named() -> None:
    model = _gpt()
    with (
        pytest.raises(ValueError, match=r"layer 2 does not exist.*0\.\.1"),
        ablate_heads(model, {2: [0]}),
    ):
        pass
    with (
        pytest.raises(ValueError, match=r"head 4 of layer 0 does not exist.*0\.\.3"),
        ablate_heads(model, {0: [4]}),
    ):
        pass
    with pytest.raises(TypeError, match="dict"), ablate_heads(model, [(0, 1)]):
        pass
    with (
        pytest.raises(ValueError, match="kind='cross'"),
        ablate_heads(model, {0: [0]}, kind="cross"),
    ):
        pass


def test_pairs_and_specs() -> None:
    model = _gpt()
    pairs = all_heads(model)
    assert pairs == [(layer, head) for layer in range(2) for head in range(H)]
    assert as_spec([(1, 2), (0, 1), (1, 0)]) == {1: [2, 0], 0: [1]}
