"""`glassformer convert SRC --to hf OUT`: any model from_pretrained loads (alias, Hugging Face
folder, GGUF file, glassformer checkpoint) written as a Hugging Face folder that transformers
runs with the same logits: model.safetensors, config.json and the tokenizer files."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models

from glassformer import json_input
from glassformer.files import check_destination, write_folder
from glassformer.interop.checkpoint import checkpoint_folders
from glassformer.interop.hf import InteropError, default_model_type, save_hf_model
from glassformer.interop.pretrained import from_pretrained, resolve
from glassformer.tokenizers import BPETokenizer, CharTokenizer, PretrainedTokenizer

# Files of a Hugging Face folder that describe tokenization and generation, copied verbatim.
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)


@dataclass
class ConversionReport:
    out_dir: Path
    model_type: str
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _hf_model_type(path: Path) -> str | None:
    """The model_type of a Hugging Face folder, or None for anything else."""
    config = path / "config.json"
    if not (path.is_dir() and config.is_file()):
        return None
    try:
        return json_input.loads(config.read_text()).get("model_type")
    except (json.JSONDecodeError, AttributeError):  # not JSON, or JSON but not an object
        return None


def char_tokenizer_to_hf(tokenizer: CharTokenizer) -> HFTokenizer:
    """The same one-token-per-character mapping as a Hugging Face tokenizer: a BPE model with
    the characters as its vocabulary and no merges, decoded by plain concatenation."""
    vocab = {char: i for i, char in enumerate(tokenizer.chars)}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    hf.decoder = decoders.Fuse()
    return hf


def _write_tokenizer_config(out: Path, **entries: Any) -> None:
    # clean_up_tokenization_spaces=False: transformers must not rewrite " ." to "." on decode.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **{k: v for k, v in entries.items() if v is not None},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def _save_tokenizer(tokenizer: Any, src: Path, out: Path, report: ConversionReport) -> None:
    if _hf_model_type(src) is not None:
        for name in HF_TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, out / name)
                report.files.append(name)
        if "tokenizer.json" not in report.files:
            report.notes.append(f"{src} has no tokenizer.json: none written")
        return
    if tokenizer is None:
        report.notes.append("the source has no tokenizer: only the weights were written")
        return
    if isinstance(tokenizer, PretrainedTokenizer):
        tokenizer.save(out)
        config = json_input.loads((out / "tokenizer_config.json").read_text())
        _write_tokenizer_config(out, **config)
    elif isinstance(tokenizer, BPETokenizer):
        tokenizer.save(out)
        eos = tokenizer.eos_token_id
        _write_tokenizer_config(
            out, eos_token=None if eos is None else tokenizer.hf.id_to_token(eos)
        )
    elif isinstance(tokenizer, CharTokenizer):
        char_tokenizer_to_hf(tokenizer).save(str(out / "tokenizer.json"))
        _write_tokenizer_config(out)
        report.notes.append(
            "the character tokenizer was written as an equivalent Hugging Face tokenizer.json "
            "(a BPE over the characters with no merges); characters outside the vocabulary are "
            "dropped by it instead of raising an error"
        )
    else:
        raise InteropError(
            f"cannot write a {type(tokenizer).__name__} as Hugging Face tokenizer files"
        )
    report.files += ["tokenizer.json", "tokenizer_config.json"]


def convert_to_hf(
    src: str | Path, out_dir: str | Path, model_type: str | None = None, overwrite: bool = False
) -> ConversionReport:
    """Write `src` as a Hugging Face folder. model_type: the architecture to write (default: the
    source's own for a Hugging Face folder, else the closest one to its config). The folder is
    written whole through files.write_folder: never one the source lives in, and one that holds
    a model already only with overwrite."""
    path = resolve(src)
    out = Path(out_dir)
    check_destination(out_dir, checkpoint_folders(path))  # before the (slow) load
    model, tokenizer = from_pretrained(path)
    notes = []
    if model_type is None:
        model_type = _hf_model_type(path) or default_model_type(model.cfg)
        if model_type == "qwen2" and isinstance(tokenizer, (CharTokenizer, BPETokenizer)):
            # transformers' AutoTokenizer forces Qwen2Tokenizer (its own byte-level split) on
            # every qwen2 folder, which would re-tokenize glassformer's vocabulary. Llama with
            # attention_bias and a zero o_proj bias computes the same and keeps the tokenizer.
            model_type = "llama"
            notes.append(
                "written as llama (attention_bias with a zero o_proj bias) rather than qwen2: "
                "transformers' AutoTokenizer would force Qwen2's tokenizer onto this vocabulary "
                "(pass --model-type qwen2 to write qwen2 anyway)"
            )
    report = ConversionReport(out, model_type, ["model.safetensors", "config.json"], notes)
    folder = write_folder(
        out_dir,
        "model",
        sources=checkpoint_folders(path),
        overwrite=overwrite,
        format="huggingface",
        written_by="glassformer convert",
        source=str(path),
    )
    with folder as tmp:
        save_hf_model(model, tmp, model_type)
        _save_tokenizer(tokenizer, path, tmp, report)
    return report
