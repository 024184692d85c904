"""Feed-forward networks (seed 000 §5.1) and Mixture-of-Experts (seed 000 §2.5.3).

The FFN works on each position alone: widen, apply a nonlinearity, narrow back. Gated variants
(SwiGLU, GeGLU) multiply a second projection in. MoE swaps the one FFN for n_experts of them
and a router that sends each token to its top-k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glassformer.config import ModelConfig
from glassformer.nn.norm import upcast

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
    "geglu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MLP(nn.Module):
    """fc_in -> act -> fc_out (relu, gelu, gelu_tanh, silu)."""

    def __init__(self, d_model: int, d_ff: int, kind: str, bias: bool) -> None:
        super().__init__()
        self.act = ACTIVATIONS[kind]
        self.fc_in = nn.Linear(d_model, d_ff, bias=bias)
        self.fc_out = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(self.act(self.fc_in(x)))


class GatedMLP(nn.Module):
    """act(x W_gate) * (x W_up) -> W_down (SwiGLU in Llama, GeGLU in T5 v1.1/Gemma).

    gate and up live in one fused matrix: one matmul instead of two."""

    def __init__(self, d_model: int, d_ff: int, kind: str, bias: bool) -> None:
        super().__init__()
        self.act = ACTIVATIONS[kind]
        self.d_ff = d_ff
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).split(self.d_ff, dim=-1)  # (B, T, F) each
        return self.down(self.act(gate) * up)


def make_dense_ffn(kind: str, d_model: int, d_ff: int, bias: bool) -> nn.Module:
    if kind in ("swiglu", "geglu", "geglu_tanh"):
        return GatedMLP(d_model, d_ff, kind, bias)
    return MLP(d_model, d_ff, kind, bias)


class MoE(nn.Module):
    """Top-k routed experts. Each token runs only k of n_experts FFNs (671B total / 37B active
    in DeepSeek-V3); a load-balancing loss keeps tokens from crowding onto a few experts.

    After each forward, `aux_loss` holds the Switch-Transformer balance loss
    n_experts * sum_e(f_e * P_e), f_e the share of the N*k token-to-expert assignments that went
    to e and P_e the mean router probability of e (1.0 when perfectly balanced), and
    `expert_counts` how many tokens each expert received.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.top_k = cfg.n_experts_per_token
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(
            make_dense_ffn(cfg.moe_expert_ffn, cfg.d_model, cfg.d_ff, cfg.has_bias("mlp"))
            for _ in range(cfg.n_experts)
        )
        self.aux_loss: Tensor = torch.zeros(())
        self.expert_counts: Tensor = torch.zeros(cfg.n_experts, dtype=torch.long)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C) with N = B*T tokens
        router_probs = upcast(self.router(x)).softmax(dim=-1)  # (N, E)
        top_probs, top_experts = router_probs.topk(self.top_k, dim=-1)  # (N, k)
        top_probs = top_probs / top_probs.sum(dim=-1, keepdim=True)  # renormalize over the k

        out = torch.zeros_like(x)
        counts = torch.bincount(top_experts.flatten(), minlength=self.n_experts)
        for e in counts.nonzero().flatten().tolist():
            token_idx, slot = (top_experts == e).nonzero(as_tuple=True)
            weight = top_probs[token_idx, slot, None].to(x.dtype)  # (n_e, 1)
            out.index_add_(0, token_idx, self.experts[e](x[token_idx]) * weight)

        fraction_routed = counts.float() / top_experts.numel()  # (E,)
        self.aux_loss = self.n_experts * (fraction_routed * router_probs.mean(dim=0)).sum()
        self.expert_counts = counts.detach()
        return out.reshape(shape)


def make_ffn(cfg: ModelConfig) -> nn.Module:
    if cfg.ffn == "moe":
        return MoE(cfg)
    return make_dense_ffn(cfg.ffn, cfg.d_model, cfg.d_ff, cfg.has_bias("mlp"))


def moe_aux_loss(model: nn.Module) -> Tensor:
    """The load-balancing losses of a model's last forward pass, summed over its MoE layers
    (zero for a dense model)."""
    losses = [m.aux_loss for m in model.modules() if isinstance(m, MoE)]
    if not losses:
        return torch.zeros((), device=next(model.parameters()).device)
    return torch.stack(losses).sum()
