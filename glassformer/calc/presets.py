"""The calculators' presets: every ModelConfig preset (buildable) and the architectures
glassformer counts but cannot build, such as DeepSeek-V3 (Multi-head Latent Attention).
"""

from __future__ import annotations

from glassformer.calc.parameters import AnyConfig, MLAMoEConfig
from glassformer.config import PRESETS, ConfigError, ModelConfig

DEEPSEEK_V3 = MLAMoEConfig(
    name="deepseek-v3", vocab_size=129280, d_model=7168, n_layers=61, n_heads=128,
    q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
    v_head_dim=128, d_ff=18432, moe_d_ff=2048, n_routed_experts=256, n_shared_experts=1,
    n_experts_per_token=8, n_dense_layers=3, max_seq_len=163840,
    published="671B total, 37B activated per token (DeepSeek-V3 technical report)",
)  # fmt: skip

# Presets glassformer cannot build (ModelConfig has no MLA): counted with the closed-form formulas.
COUNT_ONLY_PRESETS: dict[str, MLAMoEConfig] = {"deepseek-v3": DEEPSEEK_V3}


def preset_names() -> list[str]:
    """Every name `calc` knows: ModelConfig presets (buildable) and count-only ones."""
    return sorted([*PRESETS, *COUNT_ONLY_PRESETS])


def resolve_preset(name: str) -> AnyConfig:
    """A ModelConfig preset, or a count-only architecture such as deepseek-v3."""
    if name in COUNT_ONLY_PRESETS:
        return COUNT_ONLY_PRESETS[name]
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: pick one of {', '.join(preset_names())}")
    return ModelConfig.preset(name)
