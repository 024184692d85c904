"""Calculators from a config, no weights needed (seed 000 §2.1, §2.3, §2.5.3; seed 002):
parameter tables, KV-cache bytes, FLOPs, training memory and inference cost.

parameters.py the parameter table: rows and counts, and the count-only MLA/MoE config
formulas.py  KV-cache bytes and FLOPs
presets.py   the names `glassformer calc --preset` takes (ModelConfig presets and deepseek-v3)
render.py    the printed tables and the byte/count/FLOP formatters
memory_cost.py  training memory (parameters, gradients, optimizer, activations) and the
             prefill + decode cost at this machine's measured peaks
"""

from glassformer.calc.formulas import (
    DTYPE_BYTES,
    attention_width,
    flops_per_token,
    kv_bytes_per_token,
    kv_cache_bytes,
    rnn_state_bytes,
)
from glassformer.calc.memory_cost import (
    activation_bytes,
    activation_terms,
    decode_flops,
    decode_step_bytes,
    format_cost,
    format_training_memory,
    measure_peaks,
    prefill_flops,
    training_memory,
)
from glassformer.calc.parameters import (
    AnyConfig,
    MLAMoEConfig,
    Row,
    component_of,
    norm_size,
    parameter_counts,
    parameter_rows,
    parameter_table,
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
    "activation_bytes",
    "activation_terms",
    "attention_width",
    "component_of",
    "decode_flops",
    "decode_step_bytes",
    "describe",
    "flops_per_token",
    "format_bytes",
    "format_bytes_decimal",
    "format_component_table",
    "format_cost",
    "format_count",
    "format_flop_count",
    "format_flops",
    "format_kv_cache",
    "format_parameter_table",
    "format_training_memory",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "measure_peaks",
    "norm_size",
    "parameter_counts",
    "parameter_rows",
    "parameter_table",
    "prefill_flops",
    "preset_names",
    "resolve_preset",
    "rnn_state_bytes",
    "training_memory",
]
