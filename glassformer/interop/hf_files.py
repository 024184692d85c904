"""The files of a Hugging Face model folder, read with suspicion: config.json's values checked by
type and range before any architecture reads them, a shard index that may only name files inside
its folder, safetensors headers read for shapes before anything is allocated, and tensors
checked for NaN/Inf as they are read. Pickled weights are never opened.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from safetensors import safe_open
from torch import Tensor

from glassformer import json_input
from glassformer.interop.integrity import (
    UNREADABLE_SAFETENSORS,
    InteropError,
    clip,
    non_finite,
    safetensors_shapes,
)

# Files that hold pickles (pytorch_model.bin, model.pt, ...): unpickling can run any code.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def read_json(path: Path) -> dict[str, Any]:
    """A JSON file that must hold an object (config.json, the shard index)."""
    try:
        data = json_input.loads(path.read_text())
    except FileNotFoundError:
        raise InteropError(f"{path} is missing: a Hugging Face model folder needs it") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InteropError(
            f"{path} is not valid JSON ({err}): the file is damaged; save or download it again"
        ) from None
    except OSError as err:  # a directory, unreadable
        raise InteropError(f"cannot read {path}: {err}") from None
    if not isinstance(data, dict):
        raise InteropError(
            f"{path} holds a JSON {type(data).__name__}, not an object: the file is damaged"
        )
    return data


def _shard_paths(index: Path) -> list[Path]:
    """The shard files an index's weight_map names, each checked to stay inside the folder (an
    entry such as ../../elsewhere/x.safetensors, an absolute path or a symlink out is refused)."""
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise InteropError(
            f"{index}: weight_map={clip(weight_map)} must be a non-empty object of tensor name "
            "-> shard file name: the index is damaged"
        )
    bad = {name: shard for name, shard in weight_map.items() if not isinstance(shard, str)}
    if bad:
        name, shard = next(iter(bad.items()))
        raise InteropError(
            f"{index}: weight_map[{name!r}]={clip(shard)} must be a shard file name (a string) "
            f"({len(bad)} such entries): the index is damaged"
        )
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        _check_inside(index, shard)
    missing = [s for s in shards if not (index.parent / s).is_file()]
    if missing:
        raise InteropError(f"{index} names shard(s) that are missing: {missing}")
    return [index.parent / s for s in shards]


def _check_inside(index: Path, shard: str) -> None:
    """Refuse a shard outside the index's folder: an absolute path, `..`, or a symlink out.
    The Hugging Face hub cache is the one layout whose files link out: snapshots/<revision>/
    holds links into the sibling blobs/ folder of the same repository."""
    folder = index.parent.resolve()
    target = (index.parent / shard).resolve()
    allowed = [folder]
    if folder.parent.name == "snapshots":
        allowed.append(folder.parent.parent / "blobs")
    if Path(shard).is_absolute() or ".." in Path(shard).parts:
        where = "an absolute path" if Path(shard).is_absolute() else "a path with '..'"
    elif not any(target.is_relative_to(root) for root in allowed):
        where = f"a link to {target}"
    else:
        return
    raise InteropError(
        f"{index}: the shard entry {shard!r} is {where}, outside {folder}: an index may only "
        "name files inside its folder; refusing to read it"
    )


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of a folder: one model.safetensors, or the shards of an index."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return _shard_paths(index)
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    if single.exists():
        raise InteropError(f"{single} is not a file but a directory: the model folder is damaged")
    pickled = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickled:
        raise InteropError(
            f"{folder} has only pickled weights ({', '.join(pickled)}); glassformer never "
            "unpickles files. Convert them to safetensors first, e.g. in a trusted environment: "
            "AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
        )
    raise InteropError(f"{folder} has no model.safetensors (or model.safetensors.index.json)")


def _unreadable(path: Path, err: Exception) -> InteropError:
    return InteropError(
        f"{path} is not a readable safetensors file ({err}): it is truncated or damaged; "
        "download or convert it again"
    )


def read_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over all files, from the headers alone (nothing is allocated)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        try:
            shapes.update(safetensors_shapes(path))
        except UNREADABLE_SAFETENSORS as err:
            raise _unreadable(path, err) from None
    return shapes


def read_tensors(files: list[Path]) -> dict[str, Tensor]:
    """Every tensor of the files; a NaN or infinite value anywhere is refused, naming it."""
    tensors: dict[str, Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[name] = f.get_tensor(name)
                    check_finite(name, tensors[name], path)
        except UNREADABLE_SAFETENSORS as err:
            raise _unreadable(path, err) from None
    return tensors


def check_finite(name: str, tensor: Tensor, path: Path | str) -> None:
    problem = non_finite(name, tensor)
    if problem:
        raise InteropError(
            f"{path}: {problem}: the file is damaged (or was saved from a run whose loss "
            "diverged); download or convert it again"
        )


# --- config.json values -----------------------------------------------------------------------

# config.json keys the name tables read, by what each must hold. Counts are >= 1; null is
# allowed only where transformers itself writes it for "use the default".
COUNT_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "head_dim",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "n_ctx",
    "d_model",
    "d_ff",
    "d_kv",
    "num_layers",
    "num_heads",
    "encoder_layers",
    "decoder_layers",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "num_local_experts",
    "num_experts_per_tok",
    "sliding_window",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
)
INDEX_KEYS = ("num_decoder_layers", "max_window_layers", "type_vocab_size")  # >= 0
NUMBER_KEYS = (
    "rms_norm_eps",
    "layer_norm_eps",
    "layer_norm_epsilon",
    "rope_theta",
    "initializer_range",
    "init_std",
    "router_aux_loss_coef",
    "partial_rotary_factor",
)
FLAG_KEYS = (
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "scale_embedding",
    "use_sliding_window",
    "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx",
    "add_cross_attention",
    "is_decoder",
    "scale_decoder_outputs",
)
TEXT_KEYS = (
    "model_type",
    "hidden_act",
    "activation_function",
    "feed_forward_proj",
    "position_embedding_type",
)
TABLE_KEYS = ("rope_scaling", "rope_parameters", "id2label")
LIST_KEYS = ("architectures", "layer_types")
CHECKED_KEYS = {
    *COUNT_KEYS,
    *INDEX_KEYS,
    *NUMBER_KEYS,
    *FLAG_KEYS,
    *TEXT_KEYS,
    *TABLE_KEYS,
    *LIST_KEYS,
}
NULLABLE_KEYS = {
    "num_key_value_heads",
    "head_dim",
    "n_inner",
    "sliding_window",
    "num_decoder_layers",
    "rope_scaling",
    "rope_parameters",
    "id2label",
    "architectures",
    "layer_types",
    "partial_rotary_factor",
    "max_window_layers",
}


def _wrong_type(key: str, value: Any) -> str:
    """What is wrong with config.json's `key`: value, or "" if nothing."""
    if value is None:
        return "" if key in NULLABLE_KEYS or key not in CHECKED_KEYS else "must not be null"
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if key in COUNT_KEYS:
        return "" if is_int and value >= 1 else "must be an integer >= 1"
    if key in INDEX_KEYS:
        return "" if is_int and value >= 0 else "must be an integer >= 0"
    if key in NUMBER_KEYS:
        number = is_int or isinstance(value, float)
        return "" if number and math.isfinite(value) else "must be a finite number"
    if key in FLAG_KEYS:
        return "" if isinstance(value, bool) else "must be true or false"
    if key in TEXT_KEYS:
        return "" if isinstance(value, str) else "must be a string"
    if key in TABLE_KEYS:
        return "" if isinstance(value, dict) else "must be an object (a table)"
    if key in LIST_KEYS:
        return "" if isinstance(value, list) else "must be a list"
    return ""


def check_config_values(hf_config: dict[str, Any], config_file: Path) -> None:
    """Refuse a config.json value of the wrong type or range, naming the key, before any
    architecture reads it (where "no" would be a true bool and 0 heads a ZeroDivisionError)."""
    for key, value in hf_config.items():
        problem = _wrong_type(key, value)
        if problem:
            raise InteropError(
                f"{config_file}: {key}={clip(value)} ({type(value).__name__}) {problem}: fix "
                "the value or take the config.json saved with these weights"
            )
