"""adapter_config.json, read with suspicion (seed 002's LoRA, in peft's file format): every key
peft's LoRA reads is checked by type and range before it is used, each error naming the file,
the key, the value and the fix, and an option that would make glassformer compute something
other than peft is refused. Which modules the config adapts follows peft's own matching rule
(`AdapterConfig.targets`), so an adapter peft would load differently is refused, not guessed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from glassformer.interop.hf_files import read_json
from glassformer.interop.integrity import InteropError, clip

ADAPTER_CONFIG = "adapter_config.json"
# No layer of a released model is this wide, so a larger r is a damaged or hostile file (the
# shapes of lora_A and lora_B must then still match r exactly).
MAX_RANK = 1 << 16
FLOAT32_MAX = 3.4028234663852886e38
ALL_LINEAR = "all-linear"  # peft's shorthand for every Linear but the output layer

# adapter_config.json values that change what the adapter computes and that glassformer does not
# implement: key -> the values that are fine (the first is what to write).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "use_rslora": (False, None),
    "lora_bias": (False, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "target_parameters": (None, []),
    "trainable_token_indices": (None, {}, []),
    "layer_replication": (None, []),
    "alora_invocation_tokens": (None, []),  # aLoRA: the adapter acts from a token on
    "use_qalora": (False, None),  # QALoRA pools the input of lora_A
    "use_bdlora": (None,),  # block-diagonal A or B
    "arrow_config": (None,),  # routing between several adapters
    "monteclora_config": (None,),
    "kasa_config": (None,),  # a diagonal of singular values between A and B
    "megatron_config": (None,),
}
# What peft itself accepts for the keys above that take one of a few names.
PEFT_VALUES = {"bias": ("none", "all", "lora_only")}
TASK_TYPES = ("CAUSAL_LM", None)  # glassformer loads adapters of decoder-only language models
SAVED_BY_PEFT = "fix the value, or use the adapter_config.json saved with the adapter's weights"


@dataclass(frozen=True)
class AdapterConfig:
    """The keys of adapter_config.json that decide what a LoRA adapter computes, checked."""

    path: Path
    rank: int  # r
    alpha: float  # lora_alpha: the update is scaled by alpha / rank
    dropout: float
    target_modules: str | tuple[str, ...]  # a str is a regular expression (peft's fullmatch)
    exclude_modules: str | tuple[str, ...]
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...]
    rank_pattern: dict[str, int]
    alpha_pattern: dict[str, float]
    fan_in_fan_out: bool | None

    def rank_of(self, module: str) -> int:
        return _pattern_value(self.rank_pattern, module, self.rank)

    def alpha_of(self, module: str) -> float:
        return _pattern_value(self.alpha_pattern, module, self.alpha)

    def targets(self, module: str) -> bool:
        """Whether peft would put an adapter on `module` (a Linear of the transformers model,
        e.g. model.layers.0.self_attn.q_proj): peft's check_target_module_exists."""
        if _names(self.exclude_modules, module):
            return False
        targets = self.target_modules
        if isinstance(targets, str):  # layers_to_transform applies to lists only, as in peft
            return targets == ALL_LINEAR or bool(re.fullmatch(targets, module))
        if module in targets:  # a whole name is taken as it stands
            return True
        if not _names(targets, module):
            return False
        if not self.layers_to_transform:
            return True
        return layer_index(module, self.layers_pattern) in self.layers_to_transform


def _names(targets: str | tuple[str, ...], module: str) -> bool:
    """peft's rule: a string is a regular expression of the whole name, a list holds names or
    the dotted ends of names."""
    if isinstance(targets, str):
        return bool(re.fullmatch(targets, module))
    return any(module == t or module.endswith("." + t) for t in targets)


def layer_index(module: str, layers_pattern: tuple[str, ...] = ()) -> int | None:
    """The layer a module name is in (model.layers.3.mlp.up_proj -> 3), as peft finds it: the
    first number after the layer list (`layers_pattern`, or any name when none is given)."""
    patterns = [rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\." for p in layers_pattern]
    for pattern in patterns or [r".*?\.[^.]*\.(?P<idx>\d+)\."]:
        match = re.match(pattern, module)
        if match:
            return int(match.group("idx"))
    return None


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """peft's rank_pattern / alpha_pattern lookup: a key matches a module name ending in it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# --- the checks -------------------------------------------------------------------------------


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(value: Any) -> float | None:
    """value as a float if it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None
    return number if math.isfinite(number) else None


def _rank_problem(value: Any) -> str:
    if _whole(value) and 1 <= value <= MAX_RANK:
        return ""
    return (
        f"must be a whole number in 1..{MAX_RANK:,}: the rank of lora_A and lora_B (8 or 16 "
        "are usual), equal to the rows of the adapter's lora_A tensors"
    )


def _alpha_problem(value: Any) -> str:
    number = _finite(value)
    if number is not None and number > 0:
        return ""
    return "must be a finite number > 0: the update is scaled by lora_alpha / r (2 * r is usual)"


def _names_problem(value: Any, *, nullable: bool, regex_entries: bool = False) -> str:
    """What is wrong with target_modules / exclude_modules / layers_pattern, or ""."""
    if value is None and nullable:
        return ""
    if isinstance(value, str) and value:
        return _regex_problem(value)
    if isinstance(value, list) and all(isinstance(v, str) and v for v in value):
        if not value and not nullable:
            return "names nothing: list the modules the adapter's tensors are for"
        entries = (_regex_problem(v) for v in value) if regex_entries else ()
        return next((problem for problem in entries if problem), "")
    null = ", or null" if nullable else ""
    return (
        "must be a module name pattern (a string: a regular expression of the whole name) or a "
        f'list of module names such as ["q_proj", "v_proj"]{null}'
    )


def _regex_problem(pattern: str) -> str:
    try:
        re.compile(pattern)
    except re.error as err:
        return f"is not a regular expression ({err})"
    return ""


def _flag_problem(value: Any) -> str:
    return "" if value is None or isinstance(value, bool) else "must be true or false"


def _dropout_problem(value: Any) -> str:
    if value is None or (_finite(value) is not None and 0 <= value < 1):
        return ""
    return "must be a number in [0, 1) (0.05 is usual; 0 = off)"


def _layers_problem(value: Any) -> str:
    if value is None or (_whole(value) and value >= 0):
        return ""
    if isinstance(value, list) and all(_whole(v) and v >= 0 for v in value):
        return ""
    return "must be a layer index (a whole number >= 0), a list of them, or null for every layer"


def _pattern_problem(key: str, patterns: Any) -> str:
    """rank_pattern / alpha_pattern: an object of module-name pattern -> rank / alpha."""
    if patterns is None:
        return ""
    value_problem = _rank_problem if key == "rank_pattern" else _alpha_problem
    if not isinstance(patterns, dict):
        return 'must be an object of module name pattern -> value, such as {"k_proj": 4}'
    for name, value in patterns.items():
        problem = _regex_problem(name) or _regex_problem(rf"(.*\.)?({name})$")
        if problem:
            return f"has the key {clip(name)}, which {problem}"
        problem = value_problem(value)
        if problem:
            return f"maps {clip(name)} to {clip(value)}, which {problem}"
    return ""


def _bad(path: Path, key: str, value: Any, problem: str) -> InteropError:
    return InteropError(
        f"{path}: {key}={clip(value)} ({type(value).__name__}) {problem}; {SAVED_BY_PEFT}"
    )


def _check_choices(path: Path, config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InteropError(
            f"{path}: peft_type={clip(peft_type)}; glassformer reads LoRA adapters only "
            "(peft_type 'LORA'): load this adapter with peft"
        )
    task_type = config.get("task_type")
    if task_type not in TASK_TYPES:
        raise InteropError(
            f"{path}: task_type={clip(task_type)} is not one glassformer loads: allowed are "
            "'CAUSAL_LM' or null (adapters of decoder-only language models)"
        )
    for key, fine in UNSUPPORTED.items():
        value = config.get(key)
        if value in fine:
            continue
        known = PEFT_VALUES.get(key)
        if known and value not in known:
            raise _bad(path, key, value, f"is not one of peft's values ({', '.join(known)})")
        raise InteropError(
            f"{path}: {key}={clip(value)} is not supported by glassformer's LoRA "
            f"(supported: {fine[0]!r}); merge it with peft instead (merge_and_unload)"
        )


def read_adapter_config(folder: Path) -> AdapterConfig:
    """adapter_config.json of an adapter folder, checked (see the module docstring)."""
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        raise InteropError(
            f"{folder} has no {ADAPTER_CONFIG}: give a folder written by save_adapter, "
            "glassformer finetune or peft's save_pretrained"
        )
    config = read_json(path)
    _check_choices(path, config)
    get = config.get
    problems = {
        "r": _rank_problem(get("r")),
        "lora_alpha": _alpha_problem(get("lora_alpha")),
        "lora_dropout": _dropout_problem(get("lora_dropout")),
        "target_modules": _names_problem(get("target_modules"), nullable=False),
        "exclude_modules": _names_problem(get("exclude_modules"), nullable=True),
        "layers_to_transform": _layers_problem(get("layers_to_transform")),
        "layers_pattern": _names_problem(get("layers_pattern"), nullable=True, regex_entries=True),
        "rank_pattern": _pattern_problem("rank_pattern", get("rank_pattern")),
        "alpha_pattern": _pattern_problem("alpha_pattern", get("alpha_pattern")),
        "fan_in_fan_out": _flag_problem(get("fan_in_fan_out")),
    }
    for key, problem in problems.items():
        if problem:
            raise _bad(path, key, get(key), problem)
    return AdapterConfig(
        path=path,
        rank=config["r"],
        alpha=float(config["lora_alpha"]),
        dropout=float(get("lora_dropout") or 0.0),
        target_modules=_as_names(config["target_modules"]),
        exclude_modules=_as_names(config.get("exclude_modules") or ()),
        layers_to_transform=_as_layers(config.get("layers_to_transform")),
        layers_pattern=_as_tuple(config.get("layers_pattern") or ()),
        rank_pattern=dict(config.get("rank_pattern") or {}),
        alpha_pattern={k: float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
        fan_in_fan_out=config.get("fan_in_fan_out"),
    )


def _as_names(value: str | list[str] | tuple[str, ...]) -> str | tuple[str, ...]:
    return value if isinstance(value, str) else tuple(value)


def _as_tuple(value: str | list[str] | tuple[str, ...]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _as_layers(value: int | list[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, int) else tuple(value)
