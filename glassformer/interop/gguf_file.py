"""Reading a GGUF file (llama.cpp's one-file format) without trusting it: metadata as typed
values (a count must be a whole number >= 1, a size must be a finite number), tensors
memory-mapped and dequantized to float32 one at a time, only when a name-table rule reads them,
and checked for NaN/Inf as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from torch import Tensor

from glassformer.interop.hf import WeightRule
from glassformer.interop.hf_files import check_finite
from glassformer.interop.integrity import InteropError, clip

_REQUIRED = object()  # a metadata key with no default


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (memory-mapped, not yet dequantized)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "<missing general.architecture>"))

    def arch_key(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}`, e.g. llama.block_count."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_key(key)
        if value is None:
            raise InteropError(
                f"{self.path} lacks the metadata key {self.architecture}.{key}, which a "
                f"{self.architecture} model needs: the file is incomplete or not a model"
            )
        return value

    def count(self, key: str, default: Any = _REQUIRED) -> Any:
        """`{architecture}.{key}` as an integer >= 1 (block_count, head_count, ...)."""
        value = self.arch_key(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            self._refuse(key, value, "an integer >= 1")
        return value

    def number(self, key: str, default: Any = _REQUIRED, above: float = 0.0) -> float:
        """`{architecture}.{key}` as a finite number > above (rope.freq_base, an epsilon)."""
        value = self.arch_key(key)
        if value is None:
            return self.require(key) if default is _REQUIRED else default
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and np.isfinite(value) and value > above):
            self._refuse(key, value, f"a finite number > {above:g}")
        return float(value)

    def _refuse(self, key: str, value: Any, wanted: str) -> NoReturn:
        raise InteropError(
            f"{self.path}: the metadata {self.architecture}.{key}={clip(value)} "
            f"({type(value).__name__}) must be {wanted}: the file is damaged or was written by a "
            "broken converter"
        )

    def strings(self, key: str) -> list[str] | None:
        """A metadata list of strings (tokens, merges), or None if the key is absent."""
        value = self.metadata.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(item, str) for item in value)
        ):
            raise InteropError(
                f"{self.path}: the metadata {key} must be a list of strings, not "
                f"{clip(value)}: the file is damaged"
            )
        return value


def _reader_class():
    from gguf import GGUFReader, GGUFValueType

    array = int(GGUFValueType.ARRAY)  # an enum attribute costs ~1 us: this runs per item

    class PlainArrayReader(GGUFReader):
        """GGUFReader over a plain ndarray view of its memory map. The reader slices the map
        once per metadata value (about 100k times for a 49k-token vocabulary), and a slice of
        an np.memmap costs several times one of an ndarray: 2.5 s -> 0.8 s for SmolLM2."""

        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain_data = value.view(np.ndarray)  # same memory, no copy

        def _get_field_parts(self, orig_offs: int, raw_type: int):
            # The reader loops once per array item it is told of, and an item read past the
            # end of the file is empty rather than an error: an array that claims 2**40 numbers
            # would fill memory for minutes. Every item takes at least one byte.
            if raw_type == array:
                count = int(self._get(orig_offs + 4, np.uint64)[0])  # after the item type
                left = len(self.data) - orig_offs - 12
                if count > left:
                    raise ValueError(
                        f"a metadata array at byte {orig_offs} claims {count:,} items but only "
                        f"{max(left, 0):,} bytes follow"
                    )
            return GGUFReader._get_field_parts(self, orig_offs, raw_type)

    return PlainArrayReader


# What the gguf reader raises for a damaged file: ValueError (bad magic, version, value type,
# UTF-8, a tensor past the end), IndexError (a value cut off), KeyError (a repeated key),
# OSError (a file it cannot map).
UNREADABLE_GGUF = (ValueError, IndexError, KeyError, OSError)


def read_gguf(path: str | Path) -> GGUFFile:
    """Open a GGUF file: metadata as Python values, tensors memory-mapped."""
    path = Path(path)
    if path.is_dir():
        raise InteropError(f"{path} is a directory, not a GGUF file: give a llama.cpp .gguf file")
    if not path.is_file():
        raise InteropError(f"no GGUF file at {path}")
    try:
        reader = _reader_class()(str(path))
        metadata = {name: field.contents() for name, field in reader.fields.items()}
    except UNREADABLE_GGUF as err:
        raise InteropError(
            f"{path} is not a readable GGUF file ({type(err).__name__}: {err}): it is truncated "
            "or damaged, or not GGUF at all; give a llama.cpp .gguf model file"
        ) from None
    tensors = {t.name: t for t in reader.tensors}
    return GGUFFile(path, metadata, tensors)


def dequantize(tensor: Any) -> Tensor:
    """One GGUF tensor as float32 in PyTorch's dimension order.

    GGUF lists dimensions fastest-first (ne[0] = the input features of a matrix), the reverse
    of PyTorch, so a Linear weight stored as [in, out] comes back as (out, in)."""
    from gguf.quants import dequantize as gguf_dequantize

    try:
        values = gguf_dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise InteropError(
            f"tensor {tensor.name} has type {tensor.tensor_type.name}, which the gguf package "
            "cannot dequantize: re-quantize the file to a common type (Q8_0, Q4_K_M, F16)"
        ) from None
    values = np.asarray(values, dtype=np.float32).reshape(LazyTensor(tensor).shape)
    if not values.flags.writeable:  # F32 data is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(values)


@dataclass(frozen=True)
class LazyTensor:
    """A GGUF tensor whose shape is known from the header and whose values are dequantized
    only when a rule loads it, so a whole fp32 copy of the file never sits next to the model."""

    raw: Any  # gguf.ReaderTensor
    source: str = ""  # the file, for error messages

    @property
    def shape(self) -> torch.Size:
        return torch.Size(int(d) for d in reversed(self.raw.shape.tolist()))

    def load(self) -> Tensor:
        values = dequantize(self.raw)
        check_finite(self.raw.name, values, self.source)
        return values


class LazyTensors(Mapping):
    def __init__(self, tensors: dict[str, Any], source: str) -> None:
        self._tensors = tensors
        self._source = source

    def __getitem__(self, name: str) -> LazyTensor:
        return LazyTensor(self._tensors[name], self._source)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def dequantizing(rule: WeightRule) -> WeightRule:
    """The same rule, fed dequantized tensors instead of LazyTensors."""
    load = rule.load
    return dataclasses.replace(rule, load=lambda lazy: load([t.load() for t in lazy]))
