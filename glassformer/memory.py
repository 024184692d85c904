"""Will it fit? A config's parameter count from closed-form formulas (nothing allocated) and the
memory this process may still use, so that a model, a training run or a hostile file that
claims n_layers=100000 is refused before a byte of it is allocated (seed 000 §2.1's table,
turned into a guard).
"""

from __future__ import annotations

import re
from pathlib import Path

from glassformer.calc import format_bytes, norm_size, parameter_rows
from glassformer.config import ConfigError, ModelConfig


def estimated_parameters(cfg: ModelConfig) -> int:
    """The parameter count from closed-form formulas: nothing is built, so a hostile config
    (n_layers=100000, vocab_size=2e9) is priced before a byte is allocated."""
    if cfg.family == "rnn":
        gates = {"rnn": 1, "gru": 3, "lstm": 4}[cfg.cell]
        per_layer = gates * (2 * cfg.d_model * cfg.d_model + 2 * cfg.d_model)  # W_x, W_h, biases
        head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
        final_norm = norm_size(cfg) if cfg.norm_position == "pre" else 0
        return cfg.vocab_size * cfg.d_model + cfg.n_layers * per_layer + final_norm + head
    return sum(row.count for row in parameter_rows(cfg))


def estimated_buffer_numbers(cfg: ModelConfig) -> int:
    """Numbers a model holds besides its parameters that grow with the config: the sinusoidal
    table is max_seq_len x d_model (RoPE and ALiBi compute theirs per call)."""
    return cfg.max_seq_len * cfg.d_model if cfg.position == "sinusoidal" else 0


def available_memory_bytes() -> int | None:
    """Memory this process may still use: MemAvailable, capped by a cgroup limit; None where
    the system does not say (then no check is made)."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    if found is None:
        return None
    available = int(found.group(1)) * 1024
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return available if limit == "max" else min(available, int(limit) - used)


def check_fits_in_memory(
    cfg: ModelConfig, what: str, bytes_per_param: int, extra_bytes: int = 0, fix: str = ""
) -> int:
    """Raise ConfigError if `what` (e.g. "loading smollm2") would need more memory than there
    is: parameters x bytes_per_param + extra_bytes. Returns the parameter count."""
    params = estimated_parameters(cfg)
    need = (params + estimated_buffer_numbers(cfg)) * bytes_per_param + extra_bytes
    available = available_memory_bytes()
    if available is not None and need > available:
        extra = f" + {format_bytes(extra_bytes)} more" if extra_bytes else ""
        raise ConfigError(
            f"{what} needs about {format_bytes(need)} ({params:,} parameters x {bytes_per_param} "
            f"bytes{extra}) but {format_bytes(available)} of memory is available: "
            f"{fix or 'use a smaller config (n_layers, d_model, vocab_size)'}"
        )
    return params
