"""glassformer's own checkpoint format: a step folder holds model.safetensors, config.json (the
ModelConfig) and tokenizer.json; a run folder holds step-NNNNNN folders and a `latest` file naming
the newest. Here: the file names, writing and strictly reading the weights and config, finding
the step a path means, and loading a model from it. The trainer's state saved beside them and
the atomic save of a training step live in train/checkpoint.py. Nothing here unpickles: tensors
go through safetensors, everything else through JSON.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
from torch import Tensor

from glassformer import json_input
from glassformer.config import ConfigError, ModelConfig
from glassformer.files import restore_aside
from glassformer.interop.integrity import (
    UNREADABLE_SAFETENSORS,
    count_values,
    memory_problem,
    non_finite,
    oversized_claim,
    safetensors_shapes,
)

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
LATEST_FILE = "latest"
REQUIRED_FILES = (CONFIG_FILE, MODEL_FILE)

STEP_DIR_RE = re.compile(r"^step-(\d+)$")
_TRAIN_HINT = "train a model first: glassformer train --config configs/shakespeare-char.toml"


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or does not fit the model; the message says the fix."""


def few(names: list[str], shown: int = 5) -> str:
    head = ", ".join(names[:shown])
    return f"{head} and {len(names) - shown} more" if len(names) > shown else head


# --- weights ----------------------------------------------------------------------------------


def _alias_key(tensor: Tensor) -> tuple:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.dtype,
    )


def _alias_groups(state: dict[str, Tensor]) -> list[list[str]]:
    """Names that are the very same tensor (tied embeddings), in state_dict order."""
    groups: dict[tuple, list[str]] = {}
    for name, tensor in state.items():
        # Empty and meta tensors all report data_ptr 0; never group them.
        key = _alias_key(tensor) if tensor.numel() and not tensor.is_meta else (name,)
        groups.setdefault(key, []).append(name)
    return list(groups.values())


def weights_to_save(model: torch.nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """One tensor per alias group (safetensors refuses shared storage) and the dropped names."""
    state = model.state_dict()
    tensors, aliases = {}, {}
    for group in _alias_groups(state):
        kept = group[0]  # the first name in module order: the embedding when lm_head is tied
        tensors[kept] = state[kept].detach().to("cpu").contiguous()
        aliases.update({name: kept for name in group[1:]})
    # Views that overlap without being identical (rare) would still share storage: copy them.
    seen: set[int] = set()
    for name, tensor in tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        if tensor.numel() and ptr in seen:
            tensors[name] = tensor.clone()
        seen.add(ptr)
    return tensors, aliases


def save_model_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Write the model's weights to one safetensors file (tied tensors stored once)."""
    from glassformer.nn.quant import refuse_quantized

    refuse_quantized(model, f"save {path} from")
    tensors, aliases = weights_to_save(model)
    metadata = {"format": "pt"}
    if aliases:
        metadata["glassformer.aliases"] = json.dumps(aliases, sort_keys=True)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)


def read_checkpoint_tensors(path: Path) -> dict[str, Tensor]:
    """Every tensor of a safetensors file of a step folder; missing or damaged is a
    CheckpointError."""
    try:
        return safetensors.torch.load_file(str(path))
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} is missing: the checkpoint is incomplete; load another step or re-save it"
        ) from None
    except (safetensors.SafetensorError, OSError, ValueError) as err:
        raise CheckpointError(
            f"{path} is not a readable safetensors file ({err}): it was probably cut short by a"
            " crash or a full disk; load an earlier checkpoint or re-save this one"
        ) from None


def _saved_aliases(path: Path) -> dict[str, str]:
    """The tied names a glassformer save dropped, from the file header (empty if none)."""
    with safetensors.safe_open(str(path), "pt") as f:
        metadata = f.metadata() or {}
    try:
        return json_input.loads(metadata.get("glassformer.aliases", "{}"))
    except json.JSONDecodeError:
        return {}  # only used to explain errors better; never worth failing over


def load_model_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load weights strictly: every model tensor must be in the file with the same shape.

    `path` is a .safetensors file or anything `resolve_checkpoint` accepts. Tied tensors need
    only one of their names in the file and stay tied, since values are copied in place.
    """
    path = Path(path)
    file = path if path.is_file() else resolve_checkpoint(path) / MODEL_FILE
    on_disk = read_checkpoint_tensors(file)
    for name, tensor in on_disk.items():
        problem = non_finite(name, tensor)
        if problem:
            raise CheckpointError(
                f"{file}: {problem}: the file is damaged, or the run that saved it diverged (its"
                " loss went to NaN); load an earlier step, or retrain with a lower learning rate"
            )
    state = model.state_dict()
    to_load: dict[str, Tensor] = {}
    missing: list[str] = []
    mismatched: list[str] = []
    used: set[str] = set()
    for group in _alias_groups(state):
        source = next((name for name in group if name in on_disk), None)
        if source is None:
            missing.extend(group)
            continue
        used.add(source)
        tensor = on_disk[source]
        if tensor.shape != state[group[0]].shape:
            mismatched.append(
                f"{source} {tuple(tensor.shape)} in file vs {tuple(state[group[0]].shape)} in model"
            )
            continue
        to_load.update({name: tensor for name in group})
    # A file saved elsewhere may store both names of a tied pair: that is not unexpected.
    known = set(state)
    unexpected = sorted(name for name in on_disk if name not in used and name not in known)
    problems = []
    if missing:
        problems.append(f"missing from the file: {few(sorted(missing))}")
    if unexpected:
        problems.append(f"not in the model: {few(unexpected)}")
    if mismatched:
        problems.append(f"shape mismatch: {few(mismatched, 3)}")
    if problems:
        aliases = _saved_aliases(file)
        tied = sorted(f"{name} with {aliases[name]}" for name in missing if name in aliases)
        if tied:
            problems.append(f"the file ties {few(tied, 3)} but the model does not")
        raise CheckpointError(
            f"{file} does not fit {type(model).__name__} ({'; '.join(problems)}): build the model"
            f" from the checkpoint's own {CONFIG_FILE} (ModelConfig.from_json) and load again"
        )
    with torch.no_grad():
        model.load_state_dict(to_load, strict=True)


def save_model_files(
    directory: Path, model: torch.nn.Module, config: ModelConfig, tokenizer: Any | None = None
) -> None:
    """The model's part of a step folder: weights, config and, if given, the tokenizer (anything
    with `.save(directory)`). Nothing is fsynced: the caller writes into a temporary folder and
    syncs it before renaming it into place (train/checkpoint.py)."""
    save_model_weights(model, directory / MODEL_FILE)
    (directory / CONFIG_FILE).write_text(config.to_json() + "\n")
    if tokenizer is not None:
        tokenizer.save(directory)


# --- step folders and run folders -------------------------------------------------------------


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """The complete step directories of a run, oldest step first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for child in out_dir.iterdir():
        match = STEP_DIR_RE.match(child.name)
        if match and child.is_dir() and _is_complete(child):
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def _is_complete(step_dir: Path) -> bool:
    return all((step_dir / name).is_file() for name in REQUIRED_FILES)


def _check_step_dir(step_dir: Path) -> Path:
    missing = [name for name in REQUIRED_FILES if not (step_dir / name).is_file()]
    if missing:
        raise CheckpointError(
            f"checkpoint {step_dir} is incomplete: {', '.join(missing)} missing; load another"
            f" step of the run (see {step_dir.parent}) or {_TRAIN_HINT}"
        )
    return step_dir


def _from_latest(out_dir: Path) -> Path | None:
    name = (out_dir / LATEST_FILE).read_text().strip()
    if not STEP_DIR_RE.match(name):
        return None  # `latest` holds something we did not write: fall back to scanning
    target = out_dir / name
    if _is_complete(target):
        return target
    # A save that replaced this very step died between its two renames (save_checkpoint in
    # train/checkpoint.py): the old copy is aside.
    for aside in sorted(out_dir.glob(f".old-{name}-*")):
        if _is_complete(aside):
            return aside
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory that `path` means: a step directory itself, or a run directory
    (its `latest`, or else its highest complete step-* directory)."""
    path = Path(path)
    if not path.exists() and not restore_aside(path):  # a folder a killed write left aside
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist; {_TRAIN_HINT}")
    if path.is_file():
        if path.name in (MODEL_FILE, CONFIG_FILE, LATEST_FILE):
            return resolve_checkpoint(path.parent)
        raise CheckpointError(
            f"{path} is a file, not a checkpoint: pass a step directory (with {CONFIG_FILE})"
            " or a run directory (with latest)"
        )
    if (path / CONFIG_FILE).exists():
        return _check_step_dir(path)
    if (path / LATEST_FILE).is_file():
        found = _from_latest(path)
        if found is not None:
            return found
    steps = list_checkpoints(path)
    if steps:
        return steps[-1]
    incomplete = [c.name for c in path.iterdir() if STEP_DIR_RE.match(c.name)]
    if incomplete:
        raise CheckpointError(
            f"no complete checkpoint in {path}: {few(sorted(incomplete))} lack"
            f" {' or '.join(REQUIRED_FILES)}; re-run training to save a new one"
        )
    raise CheckpointError(
        f"no checkpoint in {path}: expected {CONFIG_FILE} (a step directory) or latest /"
        f" step-* directories (a run directory); {_TRAIN_HINT}"
    )


def checkpoint_folders(path: str | Path) -> list[Path]:
    """What a model at `path` is read from, for files.write_folder's source check: the path
    itself and, for a glassformer checkpoint or LoRA run, the step folder it resolves to and the
    run folder around that step (writing into a sibling step would replace a checkpoint)."""
    path = Path(path)
    folders = [path]
    if not path.is_dir():
        return folders  # a .gguf or safetensors file
    try:
        step = resolve_checkpoint(path)
    except CheckpointError:
        return folders  # a folder of other files (a peft adapter, a tokenizer)
    folders.append(step)
    run = step.parent
    if (run / LATEST_FILE).is_file() or any(run.glob("step-*")):
        folders.append(run)
    return folders


# --- reading ----------------------------------------------------------------------------------


def read_checkpoint_json(path: Path) -> Any:
    """A JSON file of a step folder; missing or damaged is a CheckpointError."""
    try:
        return json_input.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: load another step or re-save it") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}): the file is damaged; load another step"
        ) from None


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig saved with a checkpoint (`path` as for resolve_checkpoint)."""
    file = resolve_checkpoint(path) / CONFIG_FILE
    data = read_checkpoint_json(file)
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{file} holds a JSON {type(data).__name__}, not a model config: the file is damaged;"
            " load another step"
        )
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as err:
        raise CheckpointError(f"{file} is not a valid model config: {err}") from None


def _check_weights_fit_config(cfg: ModelConfig, step_dir: Path) -> None:
    """Before a parameter is allocated: the config must not claim far more than the weights
    file holds (read from its header), and the model must fit in memory."""
    weights = step_dir / MODEL_FILE
    try:
        shapes = safetensors_shapes(weights)
    except UNREADABLE_SAFETENSORS as err:
        raise CheckpointError(
            f"{weights} is not a readable safetensors file ({err}): it was probably cut short by"
            " a crash or a full disk; load an earlier checkpoint or re-save this one"
        ) from None
    held = count_values(shapes.values())
    problem = oversized_claim(cfg, held, str(step_dir / CONFIG_FILE), MODEL_FILE) or (
        memory_problem(cfg, f"loading {step_dir}", extra_bytes=weights.stat().st_size)
    )
    if problem:
        raise CheckpointError(problem)


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[torch.nn.Module, Any]:
    """A model in eval mode and its tokenizer (None if none was saved) from a checkpoint.

    `path` is a run directory or a step directory, as for `resolve_checkpoint`.
    """
    # Imported here so checkpoint files can be read (tests, calculators, the trainer's resume)
    # without pulling in every model family.
    from glassformer.models import build_model
    from glassformer.tokenizers import load_tokenizer

    step_dir = resolve_checkpoint(path)
    cfg = read_config(step_dir)
    _check_weights_fit_config(cfg, step_dir)
    model = build_model(cfg)
    load_model_weights(model, step_dir / MODEL_FILE)
    model.to(device).eval()
    tokenizer_file = step_dir / TOKENIZER_FILE
    if not tokenizer_file.is_file():
        return model, None
    try:
        if (step_dir / "tokenizer_config.json").is_file():  # a pretrained model's tokenizer:
            from glassformer.tokenizers import PretrainedTokenizer  # keep its chat template, eos

            return model, PretrainedTokenizer.from_folder(step_dir)
        return model, load_tokenizer(tokenizer_file)
    except ValueError as err:
        raise CheckpointError(f"{tokenizer_file} cannot be loaded: {err}") from None
