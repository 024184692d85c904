"""Training-run configuration: a TOML file with [model], [data] and [train] tables, plus
`--set section.key=value` overrides from the command line. Every value is checked for its type
and range when the config is built, so a bad one is one error before any work starts."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glassformer.config import PRESETS, ConfigError, ModelConfig, check_choice, check_field_types
from glassformer.data.corpus import SPELLINGS
from glassformer.data.parallel import DEFAULT_MAX_CHARS, DEFAULT_THRESHOLD
from glassformer.devices import DEVICES

STRATEGIES = ("auto", "single", "ddp", "fsdp")  # train.strategy: train/distributed.py

CHUNKINGS = ("sliding", "truncate", "pack")
TOKENIZERS = ("char", "bpe")
DTYPES = ("fp32", "bf16", "fp16")
MAX_SEED = 2**63 - 1  # torch.manual_seed's range, and batch generators seed with seed + epoch


def _at_least(section: str, obj: Any, names: tuple[str, ...], low: float, hints: dict) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is not None and value < low:
            hint = hints.get(name, "")
            raise ConfigError(f"{section}.{name}={value!r} must be >= {low}{hint}")


def _in_unit_interval(name: str, value: float, high_open: bool) -> None:
    if not (0.0 <= value < 1.0 if high_open else 0.0 <= value <= 1.0):
        bound = "[0, 1)" if high_open else "[0, 1]"
        raise ConfigError(f"{name}={value!r} must be in {bound}")


def _non_empty(name: str, value: str | None) -> None:
    if value is not None and not value.strip():
        raise ConfigError(f"{name}={value!r} is empty: give a path")


@dataclass
class DataConfig:
    task: str = "lm"  # what to learn: "lm" (next token); other families add theirs
    corpus: str = "shakespeare"  # "shakespeare", or a path to a .txt file or a folder of them
    spelling: str = "modern"  # shakespeare only: "modern" or "folio"
    documents: str = "play"  # "play" (whole files) or "paragraph" (split at blank lines)
    tokenizer: str = "char"  # "char" or "bpe" (byte-level BPE trained on the corpus)
    bpe_vocab_size: int = 2048
    chunking: str = "sliding"  # seed 000 §2.4: "sliding", "truncate" or "pack"
    stride: int | None = None  # sliding windows: None = block size (no overlap)
    val_fraction: float = 0.1  # the last part of every document is held out
    nsp: bool = False  # task "mlm": add BERT's next-sentence prediction (50% real / random)
    # task "translation" (Folio -> modern spelling, data/parallel.py): pairs of at most this
    # many characters per side, aligned speeches kept above this trigram-cosine similarity
    max_pair_chars: int = DEFAULT_MAX_CHARS  # 200
    align_threshold: float = DEFAULT_THRESHOLD  # 0.5
    # task "arith" (data/arith.py): additions of 1..arith_max_digits digits; this share of the
    # examples shows its worked steps inside <think> ... </think>, the rest answers at once
    arith_max_digits: int = 4
    think_fraction: float = 0.67

    def __post_init__(self) -> None:
        check_field_types(self, "data.")
        check_choice("data.chunking", self.chunking, CHUNKINGS)
        check_choice("data.tokenizer", self.tokenizer, TOKENIZERS)
        check_choice("data.documents", self.documents, ("play", "paragraph"))
        check_choice("data.spelling", self.spelling, tuple(SPELLINGS))
        _non_empty("data.corpus", self.corpus)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"data.val_fraction={self.val_fraction} must be in (0, 1)")
        hints = {"stride": " (tokens between window starts; leave it out for no overlap)"}
        _at_least("data", self, ("bpe_vocab_size", "stride", "max_pair_chars"), 1, hints)
        _at_least("data", self, ("arith_max_digits",), 1, {})
        if not 0.0 <= self.think_fraction <= 1.0:
            raise ConfigError(f"data.think_fraction={self.think_fraction} must be in [0, 1]")
        _in_unit_interval("data.align_threshold", self.align_threshold, high_open=False)


@dataclass
class TrainConfig:
    out_dir: str = "out/run"
    max_steps: int = 1000
    batch_size: int = 32
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 disables clipping
    eval_interval: int = 250
    eval_batches: int = 20
    checkpoint_interval: int = 500
    keep_checkpoints: int = 2
    seed: int = 1337
    # "bf16"/"fp16": autocast with fp32 weights ("bf16" runs as fp16 plus a gradient scaler on
    # GPUs without bf16)
    dtype: str = "fp32"
    device: str = "auto"  # "auto" (cuda, then mps, then cpu), "cpu", "cuda" or "mps"
    threads: int | None = None  # torch threads; None keeps torch's default
    # Under torchrun: "ddp", "fsdp", or "auto" (one process: single; more: ddp). See
    # train/distributed.py.
    strategy: str = "auto"
    # Under torchrun: how long a rank waits for the others at any collective (gloo and nccl
    # apply it to each all-reduce, barrier and gather) before it reports the silent rank and
    # stops. 120 s outlasts the slowest thing one rank does while the others wait (rank 0
    # writing a checkpoint); raise it for multi-GB checkpoints on slow storage.
    rank_timeout_s: float = 120.0
    init_from: str | None = None  # start from these weights (a checkpoint), e.g. fine-tuning

    def __post_init__(self) -> None:
        check_field_types(self, "train.")
        check_choice("train.dtype", self.dtype, DTYPES)
        check_choice("train.device", self.device, DEVICES)
        check_choice("train.strategy", self.strategy, STRATEGIES)
        _non_empty("train.out_dir", self.out_dir)
        _non_empty("train.init_from", self.init_from)
        counts = ("max_steps", "batch_size", "grad_accum_steps", "eval_interval", "eval_batches")
        counts += ("checkpoint_interval", "keep_checkpoints", "threads")
        _at_least("train", self, counts, 1, _TRAIN_HINTS)
        _at_least("train", self, ("warmup_steps", "weight_decay", "min_lr", "grad_clip"), 0, {})
        if not self.rank_timeout_s > 0:
            raise ConfigError(
                f"train.rank_timeout_s={self.rank_timeout_s!r} must be > 0: seconds a rank waits"
                " for the others, e.g. 120"
            )
        if not self.learning_rate > 0:
            raise ConfigError(f"train.learning_rate={self.learning_rate!r} must be > 0, e.g. 1e-3")
        _in_unit_interval("train.beta1", self.beta1, high_open=True)
        _in_unit_interval("train.beta2", self.beta2, high_open=True)
        if not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(
                f"train.seed={self.seed} is out of range: pick an integer in 0..{MAX_SEED}"
                " (2**63 - 1), e.g. 1337"
            )


_TRAIN_HINTS = {
    "checkpoint_interval": " (save every N steps; set it to max_steps to save only at the end)",
    "keep_checkpoints": " (how many step directories to keep; the newest is always kept)",
    "eval_batches": " (validation batches per evaluation)",
    "threads": " (torch threads; leave it out to keep torch's default)",
    "grad_accum_steps": " (micro-batches per optimizer step)",
}


@dataclass
class RunConfig:
    model: dict[str, Any] = field(default_factory=dict)  # ModelConfig fields (or a preset)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def model_config(self, vocab_size: int) -> ModelConfig:
        """The ModelConfig, with the vocabulary size the tokenizer decided."""
        fields = dict(self.model)
        preset = fields.pop("preset", None)
        if preset and preset not in PRESETS:
            raise ConfigError(f"unknown preset {preset!r}: pick one of {sorted(PRESETS)}")
        base = dict(PRESETS[preset]) if preset else {}
        return ModelConfig.from_dict({**base, **fields, "vocab_size": vocab_size})

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dict(self.model),
            "data": dataclasses.asdict(self.data),
            "train": dataclasses.asdict(self.train),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RunConfig:
        unknown = sorted(set(raw) - {"model", "data", "train"})
        if unknown:
            if "finetune" in unknown:
                raise ConfigError(
                    "this file has a [finetune] section: run it with glassformer finetune "
                    "--config FILE (glassformer train takes [model], [data] and [train])"
                )
            raise ConfigError(f"unknown section(s) {unknown}: use [model], [data] and [train]")
        for section in ("model", "data", "train"):
            if not isinstance(raw.get(section, {}), dict):
                raise ConfigError(
                    f"{section}={raw[section]!r} must be a table: write [{section}] followed by"
                    " key = value lines"
                )
        return cls(
            model=dict(raw.get("model", {})),
            data=_build(DataConfig, raw.get("data", {}), "data"),
            train=_build(TrainConfig, raw.get("train", {}), "train"),
        )


# Keys that older runs wrote into run_config.json and train_state.json but nothing reads any
# more: dropped when read, so those runs still resume, evaluate and translate.
# Keys older versions wrote into run_config.json: read past with a note, so old runs still load.
RETIRED_KEYS = {"train": frozenset({"log_interval"})}


def _build(cls: type, values: dict[str, Any], section: str):
    retired = sorted(RETIRED_KEYS.get(section, frozenset()) & set(values))
    if retired:
        print(f"note: [{section}] {', '.join(retired)} is no longer used; ignoring it")
        values = {key: value for key, value in values.items() if key not in retired}
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown [{section}] key(s) {unknown}: known keys are {sorted(known)}")
    return cls(**values)


def parse_override(
    text: str, sections: tuple[str, ...] = ("model", "data", "train")
) -> tuple[str, str, Any]:
    """'train.max_steps=100' -> ('train', 'max_steps', 100). Values are read as TOML."""
    key, sep, value = text.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or section not in sections:
        raise ConfigError(
            f"--set {text!r} should look like section.key=value with section"
            f" {', '.join(sections[:-1])} or {sections[-1]}, e.g. --set train.max_steps=100"
        )
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except (tomllib.TOMLDecodeError, RecursionError):
        parsed = value.strip()  # a bare word such as rope or bf16
    return section, name.strip(), parsed


def read_toml(path: str | Path) -> dict[str, Any]:
    """The tables of a TOML file; a folder, a binary file or bad TOML is one ConfigError."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(
            f"--config {path} is a folder: pass a TOML file, e.g. configs/shakespeare-char.toml"
        )
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}: see configs/ for examples") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"--config {path} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset"
            f" {err.start}): pass a TOML file, e.g. configs/shakespeare-char.toml"
        ) from None
    except OSError as err:
        raise ConfigError(f"cannot read --config {path}: {err.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    except RecursionError:
        raise ConfigError(
            f"{path} nests arrays or tables too deeply to read: a run config is a few flat"
            " tables ([model], [data], [train]); see configs/ for examples"
        ) from None


def load_run_config(path: str | Path | None, overrides: list[str] = ()) -> RunConfig:
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    for text in overrides:
        section, name, value = parse_override(text)
        raw.setdefault(section, {})[name] = value
    return RunConfig.from_dict(raw)


def run_config_json(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_dict(), indent=2, sort_keys=True)


# --- fine-tuning a pretrained model -------------------------------------------------------------

FINETUNE_METHODS = ("lora", "full")
FOLIO_DATA = "folio"  # data = "folio": the built-in First Folio -> modern chat task


@dataclass
class FinetuneConfig:
    """[finetune]: which pretrained model, which data, and how to adapt it (train/finetune.py)."""

    model: str = "smollm2"  # an alias, a Hugging Face folder, a .gguf file or a glassformer run
    data: str = ""  # a .jsonl of {"messages": [...]} or {"text": ...} lines, or "folio"
    val_data: str | None = None  # None: the last val_fraction of `data` (folio: its own plays)
    val_fraction: float = 0.05
    method: str = "lora"  # "lora" (adapters only) or "full" (every weight)
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: str = "q,v"  # "q,v", "all-linear" or module names, comma-separated
    quantize: str | None = None  # "int8": a frozen int8 base under the adapters (QLoRA on CPU)
    # longest example in tokens (a longer one is an error); None: 512 or the model's own limit
    max_seq_len: int | None = None
    packing: bool = False  # several examples per row, kept apart by document masks
    folio_max_chars: int = 120  # data = "folio": longest speech (characters per side)

    def __post_init__(self) -> None:
        check_field_types(self, "finetune.")
        check_choice("finetune.method", self.method, FINETUNE_METHODS)
        check_choice("finetune.quantize", self.quantize, (None, "int8"))
        _non_empty("finetune.model", self.model)
        _non_empty("finetune.val_data", self.val_data)
        if not self.data.strip():
            raise ConfigError(
                'finetune.data is empty: give a .jsonl file of {"messages": [...]} or'
                ' {"text": ...} lines (--data FILE.jsonl), or "folio" for the built-in task'
            )
        if self.lora_rank < 1:
            raise ConfigError(
                f"finetune.lora_rank={self.lora_rank} must be >= 1 (the adapters' inner size),"
                " e.g. 8"
            )
        if not self.lora_alpha > 0:
            raise ConfigError(f"finetune.lora_alpha={self.lora_alpha!r} must be > 0, e.g. 16")
        _in_unit_interval("finetune.lora_dropout", self.lora_dropout, high_open=True)
        if not 0.0 < self.val_fraction < 1.0:
            raise ConfigError(f"finetune.val_fraction={self.val_fraction} must be in (0, 1)")
        _at_least("finetune", self, ("max_seq_len", "folio_max_chars"), 2, {})
        if self.quantize and self.method == "full":
            raise ConfigError(
                "finetune.quantize='int8' freezes int8 weights, which full fine-tuning would"
                " have to train: use method='lora' with it, or drop quantize"
            )


@dataclass
class FinetuneRunConfig:
    """A fine-tuning run: [finetune] (model, data, method) and the trainer's own [train]."""

    finetune: FinetuneConfig
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return {
            "finetune": dataclasses.asdict(self.finetune),
            "train": dataclasses.asdict(self.train),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> FinetuneRunConfig:
        unknown = sorted(set(raw) - {"finetune", "train"})
        if unknown:
            raise ConfigError(f"unknown section(s) {unknown}: use [finetune] and [train]")
        for section in ("finetune", "train"):
            if not isinstance(raw.get(section, {}), dict):
                raise ConfigError(f"{section}={raw[section]!r} must be a table: write [{section}]")
        return cls(
            finetune=_build(FinetuneConfig, raw.get("finetune", {}), "finetune"),
            train=_build(TrainConfig, raw.get("train", {}), "train"),
        )


def load_finetune_config(
    path: str | Path | None,
    overrides: list[str] = (),
    values: dict[str, dict[str, Any]] | None = None,
) -> FinetuneRunConfig:
    """[finetune] and [train] from a TOML file (or nothing), then `section.key=value` overrides,
    then `values` ({section: {key: value}}, what command-line flags set: they win)."""
    raw: dict[str, Any] = read_toml(path) if path is not None else {}
    for text in overrides:
        section, name, value = parse_override(text, sections=("finetune", "train"))
        raw.setdefault(section, {})[name] = value
    for section, table in (values or {}).items():
        raw.setdefault(section, {}).update(table)
    return FinetuneRunConfig.from_dict(raw)
