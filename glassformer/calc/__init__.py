"""Calculators from a config, no weights needed (seed 000 §2.1, §2.5.3; seed 002): parameter
tables, KV-cache bytes and FLOPs.

formulas.py  the numbers: parameter rows and counts, KV bytes, FLOPs, the count-only MLA/MoE config
presets.py   the names `glassformer calc --preset` takes (ModelConfig presets and deepseek-v3)
render.py    the printed tables and the byte/count/FLOP formatters
"""

from glassformer.calc.formulas import (
    DTYPE_BYTES,
    AnyConfig,
    MLAMoEConfig,
    Row,
    attention_width,
    component_of,
    flops_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    norm_size,
    parameter_counts,
    parameter_rows,
    parameter_table,
    rnn_state_bytes,
)
from glassformer.calc.presets import COUNT_ONLY_PRESETS, DEEPSEEK_V3, preset_names, resolve_preset
from glassformer.calc.render import (
    describe,
    format_bytes,
    format_bytes_decimal,
    format_component_table,
    format_count,
    format_flop_count,
    format_flops,
    format_kv_cache,
    format_parameter_table,
)

__all__ = [
    "COUNT_ONLY_PRESETS",
    "DEEPSEEK_V3",
    "DTYPE_BYTES",
    "AnyConfig",
    "MLAMoEConfig",
    "Row",
    "attention_width",
    "component_of",
    "describe",
    "flops_per_token",
    "format_bytes",
    "format_bytes_decimal",
    "format_component_table",
    "format_count",
    "format_flop_count",
    "format_flops",
    "format_kv_cache",
    "format_parameter_table",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "norm_size",
    "parameter_counts",
    "parameter_rows",
    "parameter_table",
    "preset_names",
    "resolve_preset",
    "rnn_state_bytes",
]
