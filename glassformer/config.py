"""ModelConfig: one dataclass that describes every model in the house.

Each mechanism of the tutorials (seed 000 §3-§5) is a named choice here: the position kind,
the norm and where it sits, the FFN kind, the number of key/value heads. The config validates
itself, round-trips to JSON and has named presets that need no weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glassformer import json_input

FAMILIES = ("gpt", "bert", "seq2seq", "rnn")
POSITIONS = ("learned", "sinusoidal", "rope", "alibi", "none", "relative")
NORMS = ("layer", "rms")
NORM_POSITIONS = ("pre", "post")
# geglu_tanh: GeGLU with the tanh GELU (T5 v1.1's "gated-gelu")
FFNS = ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "moe", "geglu_tanh")
DENSE_FFNS = tuple(f for f in FFNS if f != "moe")
ATTENTION_BACKENDS = ("sdpa", "eager")
CELLS = ("rnn", "lstm", "gru")  # family "rnn": the recurrent cell (seed 000 §1)
ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3")


class ConfigError(ValueError):
    """A config value is invalid; the message names the field, the value and the fix."""


def check_choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not known: pick one of {', '.join(allowed)}")


def _type_names(hint: Any) -> tuple[type, ...]:
    """The runtime types a dataclass field annotation allows: `int | None` -> (int, NoneType)."""
    args = typing.get_args(hint)
    if args and typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(t for a in args for t in _type_names(a))
    origin = typing.get_origin(hint)
    return (origin,) if origin is not None else (hint,)


_PLAIN_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
                dict: "a table (dict)", list: "a list", type(None): "none"}  # fmt: skip


def check_field_types(obj: Any, prefix: str = "") -> None:
    """Check every field of dataclass `obj` against its annotation before any value is used.

    Config files and --set overrides hand over whatever TOML or JSON held: "20" for 20, true
    for 1, 2.5 for a step count. A bool is never an int here, an int is taken where a float is
    wanted (and stored as a float), a whole float is never taken for an int. Raises ConfigError
    naming the field, the value and what to write instead."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        allowed = _type_names(hints[f.name])
        if isinstance(value, bool):
            ok = bool in allowed
        elif isinstance(value, int):
            ok = int in allowed or float in allowed
            if ok and int not in allowed:
                setattr(obj, f.name, float(value))
        else:
            ok = isinstance(value, tuple(t for t in allowed if t is not Any))
        if isinstance(value, float) and ok and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}={value!r} must be a finite number")
        if not ok and Any not in allowed:
            wanted = " or ".join(_PLAIN_NAMES.get(t, t.__name__) for t in allowed)
            hint = ""
            if isinstance(value, str) and (int in allowed or float in allowed) and _numeric(value):
                hint = f" (write {f.name} = {value.strip()} without quotes)"
            raise ConfigError(
                f"{prefix}{f.name}={value!r} ({type(value).__name__}) must be {wanted}{hint}"
            )


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ModelConfig:
    """Sizes and component names of one model. Derived sizes are filled in __post_init__."""

    family: str = "gpt"
    vocab_size: int = 256
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int | None = None  # None: same as n_heads (MHA); 1: MQA; in between: GQA
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4 * d_model, or about 8/3 * d_model for gated FFNs
    max_seq_len: int = 256

    position: str = "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"type": "yarn", "factor": 4.0, ...}
    norm: str = "layer"
    norm_position: str = "pre"
    residual: bool = True  # False drops the "x +" of §5.2 (an ablation: deep stacks fail)
    norm_eps: float = 1e-5
    norm_bias: bool = True
    ffn: str = "gelu"

    # Mixture of Experts (seed 000 §2.5.3): used when ffn == "moe"
    n_experts: int = 8
    n_experts_per_token: int = 2
    moe_expert_ffn: str = "swiglu"
    moe_aux_loss_coef: float = 0.01

    # BERT-style encoders (seed 000 §6.3)
    type_vocab_size: int = 0  # token type (segment) embeddings; 0 = none
    embedding_norm: bool = False  # a norm right after the embeddings (BERT)
    pooler: bool = False  # BERT's pooler: tanh(W h_[CLS] + b)
    mlm_head: bool = False  # BERT's masked-LM head: dense, act, norm, then the tied decoder
    n_classes: int = 0  # a sequence-classification head on the pooled [CLS]; 0 = none
    nsp_head: bool = False  # BERT's next-sentence head on the pooled [CLS] (IsNext/NotNext)

    bias: bool = False  # biases on the linear layers; the three below override it per part
    qkv_bias: bool | None = None  # None: follows `bias` (Qwen2 sets it alone)
    attn_out_bias: bool | None = None  # None: follows `bias`
    mlp_bias: bool | None = None  # None: follows `bias`
    tie_embeddings: bool = True
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm over each head's q and k before RoPE (Qwen3)
    attention_backend: str = "sdpa"
    cell: str = "lstm"  # family "rnn" only: "rnn" (the tutorial's tanh cell), "lstm" or "gru"
    dropout: float = 0.0
    init_std: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    # Encoder-decoder (seed 000 §6.1; family="seq2seq"): n_layers is the decoder's depth
    n_encoder_layers: int | None = None  # None: same as n_layers
    share_embeddings: bool = True  # encoder, decoder and output share one token table
    label_smoothing: float = 0.0  # the paper's eps_ls = 0.1
    decoder_start_token_id: int | None = None  # None: bos_token_id
    scale_embeddings: bool | None = None  # token embeddings * sqrt(d_model); None: sinusoidal
    position_offset: int = 0  # learned table rows skipped before position 0 (BART: 2)
    attention_scale: float | None = None  # None: 1/sqrt(head_dim); T5 folds it into its init: 1.0
    relative_buckets: int = 32  # position="relative" (T5): log-bucketed distance bias
    relative_max_distance: int = 128
    output_scale: float = 1.0  # decoder output * this before the lm_head (T5 tied: d_model**-0.5)
    lm_head_bias: bool = False  # a bias on the output projection (BART's final_logits_bias)

    def __post_init__(self) -> None:
        check_field_types(self)
        check_choice("family", self.family, FAMILIES)
        check_choice("position", self.position, POSITIONS)
        check_choice("norm", self.norm, NORMS)
        check_choice("norm_position", self.norm_position, NORM_POSITIONS)
        check_choice("ffn", self.ffn, FFNS)
        check_choice("moe_expert_ffn", self.moe_expert_ffn, DENSE_FFNS)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("cell", self.cell, CELLS)
        self._check_ranges()
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.family != "rnn":  # an RNN has no attention heads: nothing to check there
            self._check_heads()
        if self.position == "sinusoidal" and self.d_model % 2:
            raise ConfigError(f"sinusoidal positions need an even d_model, got {self.d_model}")
        if self.d_ff is None:
            self.d_ff = self.default_d_ff()
        if self.ffn == "moe" and not 1 <= self.n_experts_per_token <= self.n_experts:
            raise ConfigError(
                f"n_experts_per_token={self.n_experts_per_token} must be in 1..n_experts="
                f"{self.n_experts}"
            )
        if self.position == "relative" and self.family != "seq2seq":
            raise ConfigError(
                f"position='relative' (T5's bucketed bias) is built by family='seq2seq' only, not "
                f"family={self.family!r}: use rope or alibi for a relative position"
            )
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"label_smoothing={self.label_smoothing} must be in [0, 1)")
        if (self.n_classes or self.nsp_head) and not self.pooler:
            raise ConfigError(
                f"n_classes={self.n_classes}, nsp_head={self.nsp_head}: the heads read the "
                "pooled [CLS], so set pooler=True (and n_classes >= 0)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1)")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("type")
            check_choice("rope_scaling['type']", kind, ROPE_SCALINGS)
            factor = self.rope_scaling.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
                raise ConfigError(f"rope_scaling factor={factor!r} must be a number > 0")
            if not math.isfinite(factor):
                raise ConfigError(f"rope_scaling factor={factor!r} must be finite")

    def _check_ranges(self) -> None:
        """Every size at least its smallest sensible value (types are checked already)."""
        for name, low in _LOWEST.items():
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"{name}={value!r} must be >= {low}")
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}={value!r} must be > 0")
        if (
            not self.rope_theta > 1
        ):  # RoPE's wavelengths are powers of theta (and NTK/YaRN take its log)
            raise ConfigError(f"rope_theta={self.rope_theta!r} must be > 1 (10000 is usual)")
        if self.qk_norm and self.family not in ("gpt", "bert"):
            raise ConfigError(
                f"qk_norm=True is for self-attention models (family gpt or bert), not"
                f" family={self.family!r}: leave qk_norm out"
            )

    def _check_heads(self) -> None:
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                good = [h for h in _divisors(self.d_model) if h <= 64]
                raise ConfigError(
                    f"n_heads={self.n_heads} does not divide d_model={self.d_model}: pick n_heads"
                    f" in {{{', '.join(map(str, good))}}} or set head_dim explicitly"
                )
            self.head_dim = self.d_model // self.n_heads
        if self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads:
            raise ConfigError(
                f"n_kv_heads={self.n_kv_heads} does not divide n_heads={self.n_heads}: pick"
                f" n_kv_heads in {{{', '.join(map(str, _divisors(self.n_heads)))}}}"
                " (1 = MQA, n_heads = MHA)"
            )
        if self.position == "rope" and self.head_dim % 2:
            raise ConfigError(f"RoPE rotates pairs of dims: head_dim={self.head_dim} must be even")

    def default_d_ff(self) -> int:
        ffn = self.moe_expert_ffn if self.ffn == "moe" else self.ffn
        if ffn in ("swiglu", "geglu", "geglu_tanh"):
            # A gated FFN has three matrices; 8/3 * d keeps the parameter count of a 4*d MLP.
            return 64 * math.ceil(8 * self.d_model / 3 / 64)
        return 4 * self.d_model

    def has_bias(self, part: str) -> bool:
        """Whether the linear layers of `part` ("qkv", "attn_out" or "mlp") carry biases."""
        override = {"qkv": self.qkv_bias, "attn_out": self.attn_out_bias, "mlp": self.mlp_bias}
        return self.bias if override[part] is None else override[part]

    @property
    def causal(self) -> bool:
        """Decoders look only backwards; BERT-style encoders see both directions."""
        return self.family in ("gpt", "rnn")

    # --- serialization -------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"unknown ModelConfig field(s) {unknown}: known fields are {sorted(known)}"
            )
        return cls(**data)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            data = json_input.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"no model config at {path}") from None
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path} is not valid JSON ({err}): re-save the checkpoint") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with some fields changed; derived sizes are recomputed unless given."""
        data = self.to_dict()
        for derived in ("n_kv_heads", "head_dim", "d_ff"):
            if derived not in changes and _was_derived(self, derived):
                data[derived] = None
        data.update(changes)
        return ModelConfig.from_dict(data)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        if name not in PRESETS:
            raise ConfigError(f"unknown preset {name!r}: pick one of {', '.join(sorted(PRESETS))}")
        return cls.from_dict({**PRESETS[name], **overrides})


# The smallest value of each size (None stays allowed where the field is optional).
_LOWEST = {
    "vocab_size": 1, "d_model": 1, "n_layers": 1, "n_heads": 1, "max_seq_len": 1,
    "n_kv_heads": 1, "head_dim": 1, "d_ff": 1, "n_experts": 1, "n_experts_per_token": 1,
    "type_vocab_size": 0, "n_classes": 0, "n_encoder_layers": 1, "sliding_window": 1,
    "relative_buckets": 1, "relative_max_distance": 1, "position_offset": 0, "init_std": 0,
    "moe_aux_loss_coef": 0,
}  # fmt: skip
_POSITIVE = ("norm_eps", "attention_scale")


def _was_derived(cfg: ModelConfig, name: str) -> bool:
    if name == "n_kv_heads":
        return cfg.n_kv_heads == cfg.n_heads
    if name == "head_dim":
        return cfg.head_dim == cfg.d_model // cfg.n_heads
    return cfg.d_ff == cfg.default_d_ff()


_LLAMA = dict(position="rope", norm="rms", ffn="swiglu", bias=False, norm_bias=False)
_BERT = dict(
    max_seq_len=512, position="learned", type_vocab_size=2, norm="layer", norm_position="post",
    norm_eps=1e-12, ffn="gelu", bias=True, embedding_norm=True, tie_embeddings=True,
    pad_token_id=0,
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # nanoGPT's "baby GPT" on characters (the train_throughput benchmark shape)
    "baby-gpt": dict(
        vocab_size=65, d_model=384, n_layers=6, n_heads=6, max_seq_len=256,
        position="learned", norm="layer", ffn="gelu", bias=True, tie_embeddings=True,
    ),
    # the demo model: small enough to learn Shakespeare's characters in minutes on 2 cores
    "tiny-shakespeare": dict(
        vocab_size=65, d_model=192, n_layers=4, n_heads=6, max_seq_len=128,
        **_LLAMA, tie_embeddings=True,
    ),
    "gpt2-124m": dict(
        vocab_size=50257, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024,
        position="learned", norm="layer", ffn="gelu_tanh", bias=True, tie_embeddings=True,
    ),
    "llama-7b": dict(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, d_ff=11008, max_seq_len=4096,
        **_LLAMA, tie_embeddings=False, norm_eps=1e-6,
    ),
    "llama-2-70b": dict(
        vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672,
        max_seq_len=4096, **_LLAMA, tie_embeddings=False,
    ),
    "smollm2-135m": dict(
        vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
        max_seq_len=8192, rope_theta=100000.0, **_LLAMA, tie_embeddings=True,
    ),
    "mixtral-8x7b": dict(
        vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336,
        max_seq_len=32768, rope_theta=1e6, position="rope", norm="rms", ffn="moe",
        n_experts=8, n_experts_per_token=2, moe_expert_ffn="swiglu", bias=False,
        norm_bias=False, tie_embeddings=False,
    ),
    # GPT-3 175B (seed 000 §5.4: "GPT-3 是 96 次"): GPT-2's design at 96 x 12288. GPT-3 alternates
    # dense and locally banded sparse attention layers; that changes no parameter count.
    "gpt3-175b": dict(
        vocab_size=50257, d_model=12288, n_layers=96, n_heads=96, max_seq_len=2048,
        position="learned", norm="layer", ffn="gelu_tanh", bias=True, tie_embeddings=True,
    ),
    # BERT (seed 000 §6.3): post-norm encoder, token types, pooler and masked-LM head
    "bert-base": dict(
        family="bert", **_BERT, vocab_size=30522, d_model=768, n_layers=12, n_heads=12,
        d_ff=3072, pooler=True, mlm_head=True,
    ),
    # all-MiniLM-L6-v2 (the `minilm` alias): a 6-layer BERT for sentence embeddings
    "minilm-l6": dict(
        family="bert", **_BERT, vocab_size=30522, d_model=384, n_layers=6, n_heads=12,
        d_ff=1536, pooler=True, mlm_head=False,
    ),
    # T5 v1.0 base (seed 000 §6.1): pre-norm encoder-decoder, RMS norms, no biases, T5's bucketed
    # relative position bias, ReLU FFN, one token table shared by encoder, decoder and output
    "t5-base": dict(
        family="seq2seq", vocab_size=32128, d_model=768, n_layers=12, n_encoder_layers=12,
        n_heads=12, head_dim=64, d_ff=3072, max_seq_len=512, position="relative", norm="rms",
        norm_position="pre", norm_eps=1e-6, norm_bias=False, ffn="relu", bias=False,
        attention_scale=1.0, share_embeddings=True, tie_embeddings=True,
        output_scale=768**-0.5, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    ),
}  # fmt: skip
