"""Hugging Face model folders: config.json + safetensors (single file or shards) + tokenizer.

Loading is a name table per architecture (see `archs/`): each glassformer parameter is built
from one or more checkpoint tensors (renamed, concatenated, transposed). Loading is strict:
every checkpoint tensor is consumed and every parameter filled, or the error lists what is
missing or extra. Weights are read only through safetensors; pickled .bin files are refused.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from glassformer.config import ConfigError, ModelConfig
from glassformer.interop.hf_files import (
    check_config_values,
    read_json,
    read_shapes,
    read_tensors,
    safetensors_files,
)
from glassformer.interop.integrity import (
    InteropError,
    count_values,
    memory_problem,
    oversized_claim,
)

# --- the name table ---------------------------------------------------------------------------


def _identity(tensors: list[Tensor]) -> Tensor:
    return tensors[0]


def _cat(tensors: list[Tensor]) -> Tensor:
    return torch.cat(tensors, dim=0)


@dataclass
class WeightRule:
    """One glassformer parameter made from checkpoint tensors, and the way back.

    `load` combines the source tensors (in `sources` order) into the parameter; `save` splits
    the parameter back into the source tensors. The default is a plain rename; `cat` rules
    fuse q/k/v or gate/up along the output dimension."""

    target: str
    sources: list[str]
    load: Callable[[list[Tensor]], Tensor] = _identity
    save: Callable[[Tensor], list[Tensor]] | None = None

    def split(self, param: Tensor) -> list[Tensor]:
        if self.save is not None:
            return self.save(param)
        if len(self.sources) != 1:
            raise InteropError(f"rule for {self.target} has several sources but no save split")
        return [param]


def rename(target: str, source: str) -> WeightRule:
    return WeightRule(target, [source])


def fused(target: str, sources: list[str], sizes: list[int]) -> WeightRule:
    """A parameter stored as several tensors concatenated along dim 0 (fused QKV, gate|up)."""
    return WeightRule(target, sources, _cat, lambda t: list(t.split(sizes, dim=0)))


def transposed(target: str, source: str) -> WeightRule:
    """GPT-2's Conv1D stores weights as (in, out); nn.Linear wants (out, in)."""
    return WeightRule(target, [source], lambda ts: ts[0].t(), lambda t: [t.t()])


@dataclass
class Architecture:
    """How one Hugging Face `model_type` maps onto a ModelConfig and its parameters."""

    model_types: tuple[str, ...]
    config_from_hf: Callable[[dict[str, Any]], ModelConfig]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    rules: Callable[[ModelConfig, set[str]], list[WeightRule]]  # (cfg, checkpoint names)
    # checkpoint tensors that carry no information (e.g. rotary caches); never an error
    ignorable: Callable[[str], bool] = lambda name: False
    # adjusts the config to the checkpoint's tensor names: which optional heads it holds (BERT's
    # pooler and MLM head are not in config.json); None keeps config_from_hf's answer
    refine_config: Callable[[ModelConfig, set[str]], ModelConfig] | None = None
    # Writing: the config as this architecture stores it (e.g. with the zero biases GPT-2
    # always has), or an InteropError naming the field it cannot express.
    export_config: Callable[[ModelConfig], ModelConfig] = lambda cfg: cfg
    extra: dict[str, Any] = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for model_type in arch.model_types:
        ARCHITECTURES[model_type] = arch
    return arch


def architecture_for(model_type: str) -> Architecture:
    from glassformer.interop import archs  # noqa: F401  (registers the architectures)

    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise InteropError(
            f"model_type={model_type!r} is not supported: supported are "
            f"{', '.join(sorted(ARCHITECTURES))}"
        )
    return ARCHITECTURES[model_type]


# --- applying the table -----------------------------------------------------------------------


def _few(names: list[str] | set[str], shown: int = 6) -> str:
    names = sorted(names)
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def check_tensor_names(rules: list[WeightRule], names, ignorable, source: str) -> None:
    """Every tensor the rules read is in the file and every tensor of the file is read (or
    ignorable). Runs before the model is built, so a file that lacks blocks costs nothing."""
    missing = [s for r in rules for s in r.sources if s not in names]
    if missing:
        raise InteropError(f"{source} lacks tensor(s) the model needs: {_few(missing)}")
    consumed = {s for r in rules for s in r.sources}
    extra = {n for n in names if n not in consumed and not ignorable(n)}
    if extra:
        raise InteropError(
            f"{source} has tensor(s) this architecture does not use: {_few(extra)}; refusing "
            "to load half a model"
        )


def load_state(
    model: nn.Module, rules: list[WeightRule], tensors: dict[str, Tensor], ignorable, source: str
) -> None:
    """Fill every parameter of `model` from `tensors` by the rules; strict both ways."""
    params = dict(model.named_parameters())
    check_tensor_names(rules, tensors, ignorable, source)
    targets = {r.target for r in rules}
    unfilled = set(params) - targets
    unknown = targets - set(params)
    if unfilled or unknown:
        raise InteropError(
            f"name table does not match the model: unfilled {_few(unfilled)}; unknown "
            f"{_few(unknown)}"
        )
    _check_source_shapes(params, rules, tensors, source)
    with torch.no_grad():
        for rule in rules:
            value = rule.load([tensors[s] for s in rule.sources])
            param = params[rule.target]
            if tuple(value.shape) != tuple(param.shape):
                raise InteropError(
                    f"{source}: {rule.sources} give shape {tuple(value.shape)} for "
                    f"{rule.target}, which needs {tuple(param.shape)}"
                )
            param.copy_(value.to(param.dtype))


def _check_source_shapes(
    params: dict[str, Tensor], rules: list[WeightRule], tensors: dict[str, Tensor], source: str
) -> None:
    """Name the one checkpoint tensor of the wrong shape (a fused rule has several), before any
    parameter is written."""
    for rule in rules:
        if rule.save is None and len(rule.sources) != 1:
            continue  # no way to split the parameter: load_state checks the combined shape
        expected = [tuple(t.shape) for t in rule.split(params[rule.target].detach())]
        for name, shape in zip(rule.sources, expected, strict=True):
            if tuple(tensors[name].shape) != shape:
                raise InteropError(
                    f"{source}: {name} has shape {tuple(tensors[name].shape)} but the config "
                    f"needs {shape} (it fills {rule.target})"
                )


def export_state(model: nn.Module, rules: list[WeightRule]) -> dict[str, Tensor]:
    params = dict(model.named_parameters())
    out: dict[str, Tensor] = {}
    for rule in rules:
        for name, tensor in zip(
            rule.sources, rule.split(params[rule.target].detach()), strict=True
        ):
            out[name] = tensor.contiguous().clone()
    return out


# --- public entry points ----------------------------------------------------------------------


def load_hf_model(
    folder: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict[str, Any]]:
    """A glassformer model with the weights of a Hugging Face folder, and the raw config.

    Everything the file claims is checked against the safetensors headers before a tensor is
    read or a parameter allocated: sizes, tensor names, then the memory it will take."""
    from glassformer.models import build_model

    folder = Path(folder)
    if not folder.is_dir():
        raise InteropError(f"{folder} is not a folder: give a Hugging Face model directory")
    config_file = folder / "config.json"
    hf_config = read_json(config_file)
    check_config_values(hf_config, config_file)
    try:
        arch = architecture_for(hf_config.get("model_type", "<missing model_type>"))
    except InteropError as err:
        raise InteropError(f"{config_file}: {err}") from None
    files = safetensors_files(folder)
    shapes = read_shapes(files)
    cfg = config_for_weights(arch, hf_config, config_file, set(shapes))
    table = _checked_rules(arch, cfg, shapes, files, config_file)
    tensors = read_tensors(files)
    model = build_model(cfg)
    load_state(model, table, tensors, arch.ignorable, str(folder))
    return model.to(dtype).eval(), hf_config


def _checked_rules(
    arch: Architecture,
    cfg: ModelConfig,
    shapes: dict[str, tuple[int, ...]],
    files: list[Path],
    config_file: Path,
) -> list[WeightRule]:
    """The name table, once the config's claims hold against the safetensors headers, before a
    tensor is read or a parameter allocated: the size, every tensor the table reads, memory."""
    folder = config_file.parent
    weights = files[0].name if len(files) == 1 else f"the {len(files)} shards of {folder}"
    problem = oversized_claim(cfg, count_values(shapes.values()), str(config_file), weights)
    if problem:
        raise InteropError(problem)
    table = arch.rules(cfg, set(shapes))
    check_tensor_names(table, shapes, arch.ignorable, str(folder))
    file_bytes = sum(f.stat().st_size for f in files)  # read_tensors holds them all at once
    problem = memory_problem(cfg, f"loading {folder}", extra_bytes=file_bytes)
    if problem:
        raise InteropError(problem)
    return table


def config_for_weights(
    arch: Architecture, hf_config: dict[str, Any], config_file: Path, names: set[str]
) -> ModelConfig:
    """The ModelConfig of a config.json (refined by the tensor names it comes with); any value
    of the wrong type, a missing key or an invalid combination is one InteropError naming the
    file and the key (check_config_values has refused values of the wrong type)."""
    try:
        cfg = arch.config_from_hf(hf_config)
        if arch.refine_config is not None:
            cfg = arch.refine_config(cfg, names)
    except KeyError as err:
        raise InteropError(
            f"{config_file} lacks {err.args[0]!r}, which a {hf_config['model_type']} config "
            "needs: the file is incomplete; take the config.json saved with these weights"
        ) from None
    except (ConfigError, InteropError) as err:
        raise InteropError(f"{config_file}: {err}") from None
    except (TypeError, ValueError, ZeroDivisionError) as err:  # a value of a type not listed
        raise InteropError(f"{config_file} holds a value glassformer cannot use: {err}") from None
    return cfg


def save_hf_model(model: nn.Module, folder: str | Path, model_type: str | None = None) -> Path:
    """Write model.safetensors + config.json that transformers loads with the same logits."""
    model_type = model_type or default_model_type(model.cfg)
    arch = architecture_for(model_type)
    cfg = arch.export_config(model.cfg)
    if cfg != model.cfg:
        model = with_zero_biases(model, cfg)
    hf_config = arch.config_to_hf(cfg)
    rules = arch.rules(cfg, set())
    state = export_state(model, rules)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)  # safetensors writes 0600; models are shared
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    return folder


def with_zero_biases(model: nn.Module, cfg: ModelConfig) -> nn.Module:
    """A copy of `model` built from `cfg`, which may add biases (initialized to zero, so the
    copy computes the same function); every other parameter must match by name and shape."""
    from glassformer.models import build_model

    wider = build_model(cfg).to(next(model.parameters()).dtype)
    state = model.state_dict()
    added = set(wider.state_dict()) - set(state)
    not_bias = sorted(n for n in added if not n.endswith(".bias"))
    if not_bias:
        raise InteropError(f"exporting would add non-bias parameters {_few(not_bias)}")
    result = wider.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise InteropError(f"exporting would drop parameters {_few(result.unexpected_keys)}")
    with torch.no_grad():
        for name, param in wider.named_parameters():
            if name in added:
                param.zero_()
    return wider.eval()


def default_model_type(cfg: ModelConfig) -> str:
    """The Hugging Face architecture a glassformer config is closest to."""
    if cfg.family == "bert":
        return "bert"
    if cfg.family == "seq2seq":
        return "t5" if cfg.position == "relative" else "bart"
    if cfg.position == "learned" and cfg.norm == "layer":
        return "gpt2"
    if cfg.ffn == "moe":
        return "mixtral"
    if cfg.qk_norm:
        return "qwen3"
    # Qwen2: biases on q/k/v only (Llama's attention_bias also puts one on o_proj).
    qkv, out, mlp = (cfg.has_bias(part) for part in ("qkv", "attn_out", "mlp"))
    if qkv and not out and not mlp:
        return "qwen2"
    if cfg.sliding_window is not None:
        return "mistral"
    return "llama"
