"""LoRA adapters in peft's file format, both ways: adapter_config.json + adapter_model.safetensors
with peft's tensor names, so `peft.PeftModel.from_pretrained(transformers_model, DIR)` runs a
glassformer adapter, and an adapter peft wrote loads into glassformer (seed 002: LoRA moves the
attention projections).

The names come from the Hugging Face name table of the model's architecture (archs/): the rule
that fuses model.layers.0.self_attn.{q,k,v}_proj into blocks.0.attn.qkv_proj says which rows of
the fused matrix each peft module is. peft stores, per module M of the transformers model,

    base_model.model.M.lora_A.weight  (r, K)      base_model.model.M.lora_B.weight  (O_M, r)

and scales B A by lora_alpha / r (rank_pattern / alpha_pattern override both per module).

A glassformer adapter that does not line up with one Hugging Face module is rewritten exactly:
an adapter on the whole fused qkv becomes q, k and v adapters sharing its A; GPT-2's q, k and v
adapters become one c_attn adapter of rank 3r (A stacked, B block-diagonal, alpha scaled by 3 so
alpha / r is unchanged).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save
from torch import Tensor, nn

from glassformer.files import restore_aside, write_folder
from glassformer.interop.adapter_config import (
    ADAPTER_CONFIG,
    FLOAT32_MAX,
    AdapterConfig,
    read_adapter_config,
)
from glassformer.interop.hf import architecture_for, default_model_type
from glassformer.interop.hf_files import PICKLE_SUFFIXES, read_shapes, read_tensors
from glassformer.interop.integrity import InteropError, clip
from glassformer.nn.lora import LoRASite, add_adapters, lora_modules, lora_sites

ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel wraps the transformers model as base_model.model
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"


@dataclass(frozen=True)
class HFPiece:
    """One module of the transformers model (e.g. model.layers.0.self_attn.v_proj): rows
    [start, start + size) of the glassformer Linear `module`."""

    hf_name: str
    module: str
    start: int
    size: int


# --- the name mapping -------------------------------------------------------------------------


def hf_pieces(model: nn.Module) -> tuple[str, dict[str, list[HFPiece]]]:
    """(model_type, glassformer Linear -> the transformers modules it is made of), from the
    architecture's name table, for every Linear LoRA can wrap."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or cfg.family != "gpt":
        family = getattr(cfg, "family", type(model).__name__)
        raise InteropError(
            f"peft adapters are read and written for decoder-only models (family 'gpt': "
            f"Llama, Qwen2, Mistral, GPT-2, SmolLM2), not {family!r}"
        )
    model_type = default_model_type(cfg)
    arch = architecture_for(model_type)
    table = arch.rules(arch.export_config(cfg), set())  # the ForCausalLM layout peft wraps
    linears = {s.module: s.size for s in lora_sites(model) if s.name == s.module}
    pieces: dict[str, list[HFPiece]] = {}
    for rule in table:
        module = rule.target.removesuffix(".weight")
        if not rule.target.endswith(".weight") or module not in linears:
            continue
        out = linears[module]
        # A fused rule splits along dim 0; a single source (maybe transposed) is the whole.
        sizes = (
            [out]
            if len(rule.sources) == 1
            else [p.shape[0] for p in rule.split(torch.empty(out, 1))]
        )
        start = 0
        pieces[module] = []
        for source, size in zip(rule.sources, sizes, strict=True):
            pieces[module].append(HFPiece(source.removesuffix(".weight"), module, start, size))
            start += size
    return model_type, pieces


# --- writing ----------------------------------------------------------------------------------


def _piece_adapter(wrapper, piece: HFPiece) -> tuple[Tensor, Tensor, int, float] | None:
    """(A, B, rank, alpha) of the peft module `piece` from the glassformer adapters that cover
    its rows, or None if none does. Several adapters combine exactly: A stacked, B block-wise."""
    covering = []
    for i, (start, size) in enumerate(wrapper.slices):
        lo, hi = max(start, piece.start), min(start + size, piece.start + piece.size)
        if lo < hi:
            covering.append((i, lo, hi, start))
    if not covering:
        return None
    scalings = {wrapper.scalings[i] for i, *_ in covering}
    if len(scalings) > 1:
        raise InteropError(
            f"{piece.hf_name} would combine adapters of different alpha / rank {sorted(scalings)}: "
            "peft has one scaling per module; train them with one rank and alpha"
        )
    rank = sum(wrapper.ranks[i] for i, *_ in covering)
    A = torch.cat([wrapper.lora_A[i].detach() for i, *_ in covering])  # (rank, K)
    B = A.new_zeros(piece.size, rank)  # (O_M, rank)
    column = 0
    for i, lo, hi, start in covering:
        r = wrapper.ranks[i]
        B[lo - piece.start : hi - piece.start, column : column + r] = wrapper.lora_B[i].detach()[
            lo - start : hi - start
        ]
        column += r
    return A, B, rank, scalings.pop() * rank


def adapter_state(model: nn.Module) -> tuple[str, dict[str, Tensor], dict[str, tuple[int, float]]]:
    """(model_type, peft tensor name -> tensor, peft module name -> (rank, alpha))."""
    wrappers = lora_modules(model)
    if not wrappers:
        raise InteropError("the model has no LoRA adapters to save: apply_lora(model, ...) first")
    model_type, pieces = hf_pieces(model)
    tensors: dict[str, Tensor] = {}
    shapes: dict[str, tuple[int, float]] = {}
    for name, wrapper in wrappers:
        if name not in pieces:
            raise InteropError(f"{name} has no module in the {model_type} layout peft reads")
        for piece in pieces[name]:
            found = _piece_adapter(wrapper, piece)
            if found is None:
                continue
            A, B, rank, alpha = found
            tensors[PREFIX + piece.hf_name + A_SUFFIX] = A.float().contiguous()
            tensors[PREFIX + piece.hf_name + B_SUFFIX] = B.float().contiguous()
            shapes[piece.hf_name] = (rank, alpha)
    return model_type, tensors, shapes


def _target_modules(model: nn.Module, adapted: set[str]) -> list[str]:
    """peft's target_modules: the short names (q_proj, v_proj) when every layer's module of
    those names is adapted, else the full module names (peft matches either as a suffix)."""
    _, pieces = hf_pieces(model)
    every = {p.hf_name for group in pieces.values() for p in group}
    short = {name.rsplit(".", 1)[-1] for name in adapted}
    if {name for name in every if name.rsplit(".", 1)[-1] in short} == adapted:
        return sorted(short)
    return sorted(adapted)


def save_adapter(
    model: nn.Module, out_dir: str | Path, base_model: str = "", overwrite: bool = False
) -> Path:
    """Write the model's LoRA adapters as peft does (adapter_config.json and
    adapter_model.safetensors) into a new adapter folder, swapped in whole by
    files.write_folder (overwrite: replace an adapter folder already there), and return it.
    base_model is recorded as base_model_name_or_path (peft reads it to find the base)."""
    sources = [base_model] if base_model and Path(base_model).exists() else []
    with write_folder(out_dir, "adapter", sources, overwrite, written_by="glassformer") as tmp:
        write_adapter_files(model, tmp, base_model)
    return Path(out_dir)


def write_adapter_files(model: nn.Module, folder: Path, base_model: str = "") -> None:
    """adapter_config.json and adapter_model.safetensors, in peft's format, into `folder` (a
    folder being built: a training step's, or save_adapter's). Nothing is fsynced here."""
    model_type, tensors, ranks = adapter_state(model)
    # r and lora_alpha: the glassformer adapters' own (apply_lora gives them one); a module that
    # combines several adapters (GPT-2's c_attn) gets its rank in rank_pattern / alpha_pattern.
    counts = Counter(
        pair for _, w in lora_modules(model) for pair in zip(w.ranks, w.alphas, strict=True)
    )
    (rank, alpha), _ = counts.most_common(1)[0]
    dropouts = [w.dropout.p for _, w in lora_modules(model) if isinstance(w.dropout, nn.Dropout)]
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base_model) or None,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": max(dropouts, default=0.0),
        "target_modules": _target_modules(model, set(ranks)),
        "rank_pattern": {name: r for name, (r, _) in ranks.items() if r != rank},
        "alpha_pattern": {name: a for name, (_, a) in ranks.items() if a != alpha},
        "bias": "none",
        "fan_in_fan_out": model_type == "gpt2",  # GPT-2's Conv1D stores weights as (in, out)
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "revision": None,
    }
    (folder / ADAPTER_WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


# --- reading ----------------------------------------------------------------------------------


def _adapter_tensors(folder: Path) -> dict[str, Tensor]:
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        pickled = sorted(
            p.name for p in folder.glob("adapter_model*") if p.suffix in PICKLE_SUFFIXES
        )
        hint = (
            f"; {', '.join(pickled)} is pickled and glassformer never unpickles files: save it "
            "again with peft's save_pretrained(dir) (safetensors is its default)"
            if pickled
            else ""
        )
        raise InteropError(f"{folder} has no {ADAPTER_WEIGHTS}{hint}")
    read_shapes([path])  # a damaged header fails here, before anything is read
    return read_tensors([path])


def _modules_in_file(tensors: dict[str, Tensor], folder: Path) -> dict[str, tuple[Tensor, Tensor]]:
    """peft module name -> (A, B); any other tensor (embedding adapters, DoRA magnitudes,
    trained biases) is refused, naming it."""
    found: dict[str, dict[str, Tensor]] = {}
    strange = []
    for name, tensor in tensors.items():
        suffix = next((s for s in (A_SUFFIX, B_SUFFIX) if name.endswith(s)), None)
        if not name.startswith(PREFIX) or suffix is None:
            strange.append(name)
            continue
        module = name[len(PREFIX) : -len(suffix)]
        found.setdefault(module, {})[suffix] = tensor
    if strange:
        raise InteropError(
            f"{folder / ADAPTER_WEIGHTS} holds tensor(s) that are not LoRA A/B matrices of "
            f"a causal LM: {', '.join(sorted(strange)[:4])}; glassformer reads plain LoRA only"
        )
    incomplete = sorted(m for m, pair in found.items() if len(pair) != 2)
    if incomplete:
        raise InteropError(
            f"{folder / ADAPTER_WEIGHTS}: {', '.join(incomplete[:4])} lack lora_A or lora_B: "
            "the file is damaged"
        )
    return {m: (pair[A_SUFFIX], pair[B_SUFFIX]) for m, pair in found.items()}


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> list[str]:
    """Put the LoRA adapter of a peft folder (written by save_adapter or by peft) on `model`,
    which must be the base it was trained on, without adapters yet. Returns the site names.
    Every module and shape is checked before the model changes: an adapter for another model
    or size is one error naming the tensor and both shapes."""
    folder = Path(adapter_dir)
    if not folder.is_dir() and not restore_aside(folder):  # a folder a killed write left aside
        raise InteropError(
            f"{folder} is not a folder: give the adapter's folder (adapter_config.json)"
        )
    config = read_adapter_config(folder)
    modules = _modules_in_file(_adapter_tensors(folder), folder)
    if not modules:
        raise InteropError(f"{folder / ADAPTER_WEIGHTS} holds no LoRA matrices")
    model_type, pieces = hf_pieces(model)
    _check_fan_in_fan_out(config, model_type)
    _check_layers(config, model.cfg.n_layers, model_type)
    by_hf = {p.hf_name: p for group in pieces.values() for p in group}
    in_features = {s.module: _in_features(model, s.module) for s in lora_sites(model)}
    sites_by_rows = {(s.module, s.start, s.size): s for s in lora_sites(model)}
    sites: list[LoRASite] = []
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    weights: dict[str, tuple[Tensor, Tensor]] = {}
    for hf_name, (A, B) in sorted(modules.items()):
        if hf_name not in by_hf:
            known = sorted({n.rsplit(".", 1)[-1] for n in by_hf})
            raise InteropError(
                f"{folder}: the adapter is for module {hf_name!r}, which this {model_type} model "
                f"does not have (its modules end in {', '.join(known)}): the adapter was trained "
                "on another architecture"
            )
        if not config.targets(hf_name):
            raise _untargeted(config, hf_name, folder / ADAPTER_WEIGHTS)
        piece = by_hf[hf_name]
        rank, alpha = config.rank_of(hf_name), config.alpha_of(hf_name)
        expected = {
            "lora_A": (rank, in_features[piece.module]),
            "lora_B": (piece.size, rank),
        }
        for kind, tensor in (("lora_A", A), ("lora_B", B)):
            if tuple(tensor.shape) != expected[kind]:
                raise InteropError(
                    f"{folder}: {PREFIX}{hf_name}.{kind}.weight has shape {tuple(tensor.shape)} "
                    f"but this model with r={rank} needs {expected[kind]}: the adapter belongs "
                    "to a model of another size (or its config's r does not match its tensors)"
                )
        _check_update(A, B, rank, alpha, f"{folder / ADAPTER_WEIGHTS}: {hf_name}")
        site = sites_by_rows[(piece.module, piece.start, piece.size)]
        sites.append(site)
        ranks[site.name], alphas[site.name] = rank, alpha
        weights[site.name] = (A, B)
    names = add_adapters(model, sites, ranks, alphas, config.dropout)
    _copy_weights(model, weights)
    return names


# Which transformers layer class each model type's projections are: peft's fan_in_fan_out says
# the weights are stored (in, out), as GPT-2's Conv1D stores them; nn.Linear stores (out, in).
CONV1D_MODEL_TYPES = ("gpt2",)


def _check_fan_in_fan_out(config: AdapterConfig, model_type: str) -> None:
    conv1d = model_type in CONV1D_MODEL_TYPES
    if config.fan_in_fan_out is None or config.fan_in_fan_out == conv1d:
        return
    layer = "GPT-2's Conv1D, which stores (in, out)" if conv1d else "nn.Linear, (out, in)"
    raise InteropError(
        f"{config.path}: fan_in_fan_out={config.fan_in_fan_out} does not describe this "
        f"{model_type} model, whose projections are {layer}: set fan_in_fan_out to "
        f"{str(conv1d).lower()} (lora_A and lora_B are stored the same either way; peft "
        "itself resets the flag to match the layer)"
    )


def _check_layers(config: AdapterConfig, n_layers: int, model_type: str) -> None:
    outside = [i for i in config.layers_to_transform or () if i >= n_layers]
    if outside:
        raise InteropError(
            f"{config.path}: layers_to_transform={list(config.layers_to_transform)} names "
            f"layer {outside[0]}, but this {model_type} model has {n_layers} layers (0.."
            f"{n_layers - 1}): the adapter was trained on a deeper model; load it on that one"
        )


def _untargeted(config: AdapterConfig, hf_name: str, weights: Path) -> InteropError:
    """A module with tensors in the file that the config does not adapt: peft would leave
    those tensors out, so loading them would compute something else than peft."""
    given = [
        f"{key}={clip(list(value) if isinstance(value, tuple) else value)}"
        for key, value in (
            ("target_modules", config.target_modules),
            ("exclude_modules", config.exclude_modules),
            ("layers_to_transform", config.layers_to_transform),
        )
        if value
    ]
    return InteropError(
        f"{weights} holds an adapter for {hf_name}, which {config.path.name}'s "
        f"{', '.join(given)} does not adapt (peft would leave those tensors out): fix the "
        "config to name that module, or use the config saved with these weights"
    )


def _check_update(A: Tensor, B: Tensor, rank: int, alpha: float, where: str) -> None:
    """Refuse an adapter whose update (alpha / rank) B @ A does not fit in float32: merged or
    not, the model would then compute inf and NaN (weights of 1e38 are finite, their product
    is not)."""
    scaling = alpha / rank
    if scaling > FLOAT32_MAX:
        raise InteropError(
            f"{where}: lora_alpha / r = {alpha:.3g} / {rank} does not fit in float32: the "
            "config's lora_alpha (or alpha_pattern) is broken; fix it (2 * r is usual)"
        )
    largest = _update_overflow(A, B, scaling)
    if largest is not None:
        raise InteropError(
            f"{where}: the update (lora_alpha / r) * B @ A reaches {largest:.3g}, beyond "
            f"float32's {FLOAT32_MAX:.3g}: the adapter's weights (or its lora_alpha={alpha:g}) "
            "are broken, e.g. by a diverged training run; train or download it again"
        )


def _update_overflow(A: Tensor, B: Tensor, scaling: float) -> float | None:
    """The largest |value| of scaling * B @ A if it is past float32's range, else None. A
    bound that costs one pass over each matrix settles it for any sane adapter
    (|sum_k B_ik A_kj| <= sum_k |B_ik| * max |A|); only past it is the product computed, in
    float64, where a product of float32 values cannot overflow."""
    A64, B64 = A.double(), B.double()  # (r, K), (O, r)
    bound = scaling * float(B64.abs().sum(dim=1).max()) * float(A64.abs().max())
    if bound <= FLOAT32_MAX:
        return None
    largest = scaling * float((B64 @ A64).abs().max())  # (O, K)
    return largest if largest > FLOAT32_MAX else None


def _in_features(model: nn.Module, module: str) -> int:
    return model.get_submodule(module).in_features


def _copy_weights(model: nn.Module, weights: dict[str, tuple[Tensor, Tensor]]) -> None:
    by_site = {}
    for name, wrapper in lora_modules(model):
        for i, (start, size) in enumerate(wrapper.slices):
            by_site[(name, start, size)] = (wrapper, i)
    sites = {s.name: s for s in lora_sites(model)}
    with torch.no_grad():
        for site_name, (A, B) in weights.items():
            site = sites[site_name]
            wrapper, i = by_site[(site.module, site.start, site.size)]
            wrapper.lora_A[i].copy_(A.to(wrapper.lora_A[i].dtype))
            wrapper.lora_B[i].copy_(B.to(wrapper.lora_B[i].dtype))
