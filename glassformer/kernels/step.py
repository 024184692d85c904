"""kernels/step.h as ctypes: the structs of one decode step, which infer/fused.py fills with
the model's own weights and the Engine's cache, and the numbers of step.h's enums. The C
compiler lays the structs out; `check_layout` holds these mirrors to its sizes and offsets
(decode.c's glassformer_layout) before the first call, so that one field out of order is
refused instead of read as another.
"""

from __future__ import annotations

import ctypes

import torch

# step.h's enum storage by the weight's dtype (uint8: int4, two weights a byte)
STORAGE = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.uint8: 3}
CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # CACHE_* by dtype
# step.h's enum activation by the config's ffn; GATED: the ffns with a gate (Model.gated)
ACTIVATION = {
    "relu": 0,
    "gelu": 1,
    "gelu_tanh": 2,
    "silu": 3,
    "swiglu": 3,
    "geglu": 1,
    "geglu_tanh": 2,
}
GATED = ("swiglu", "geglu", "geglu_tanh")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Linear(ctypes.Structure):
    _fields_ = [
        ("weight", _P),
        ("scale", _P),
        ("mins", _P),
        ("bias", _P),
        ("in_", _I),
        ("out", _I),
        ("group", _I),
        ("storage", _I),
        ("round_inputs", _I),
        ("packed", _P),
    ]


class Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm_weight", _P),
        ("attn_norm_bias", _P),
        ("q_norm_weight", _P),
        ("k_norm_weight", _P),
        ("ffn_norm_weight", _P),
        ("ffn_norm_bias", _P),
        ("qkv", Linear),
        ("out", Linear),
        ("up", Linear),
        ("down", Linear),
        ("k_cache", _P),
        ("v_cache", _P),
    ]


class Model(ctypes.Structure):
    _fields_ = [
        (name, _I)
        for name in (
            "n_layers",
            "d_model",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "vocab_size",
            "cache_head_stride",
            "cache_pos_stride",
            "rms_norm",
            "gated",
            "activation",
            "cache_kind",
            "emb_storage",
        )
    ] + [
        ("norm_eps", _F),
        ("attn_scale", _F),
        ("rope_factor", _F),
        ("inv_freq", _P),
        ("tok_emb", _P),
        ("pos_emb", _P),
        ("final_norm_weight", _P),
        ("final_norm_bias", _P),
        ("head", Linear),
        ("layers", ctypes.POINTER(Layer)),
        ("x", _P),
        ("h", _P),
        ("qkv", _P),
        ("att", _P),
        ("scores", _P),
        ("ff", _P),
        ("max_positions", _I),
    ]


def check_layout(library: ctypes.CDLL) -> None:
    """Refuse a ctypes struct above whose fields differ from step.h's as the C compiler laid
    them out (glassformer_layout: each struct's size, each field's offset and size): a field
    out of order, missing or of another type would make the C step read one value as another."""
    function = library.glassformer_layout
    function.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_I), _I]
    function.restype = _I
    capacity = 256
    names, numbers = (ctypes.c_char_p * capacity)(), (_I * (2 * capacity))()
    count = function(names, numbers, capacity)
    if count > capacity:
        raise RuntimeError(f"decode.c's layout has {count} entries: raise capacity above")
    in_c = {names[i].decode(): (numbers[2 * i], numbers[2 * i + 1]) for i in range(count)}
    in_python = {}
    for name, struct in (("Linear", Linear), ("Layer", Layer), ("Model", Model)):
        in_python[name] = (0, ctypes.sizeof(struct))
        for field, *_ in struct._fields_:
            descriptor = getattr(struct, field)
            in_python[f"{name}.{field.rstrip('_')}"] = (descriptor.offset, descriptor.size)
    for entry in sorted(in_c.keys() | in_python.keys()):
        c, python = in_c.get(entry), in_python.get(entry)
        if c != python:
            raise RuntimeError(
                f"kernels/step.py's ctypes structs do not match kernels/step.h at {entry}: "
                f"{_place(c)} in C, {_place(python)} in Python; make the _fields_ of "
                f"{entry.split('.')[0]} list step.h's fields in its order, with its types"
            )


def _place(offset_and_size: tuple[int, int] | None) -> str:
    if offset_and_size is None:
        return "missing"
    offset, size = offset_and_size
    return f"{size} bytes at offset {offset}"


def decode_functions(library: ctypes.CDLL) -> tuple:
    """decode.c's decode_tokens (one cache row) and decode_rows (a row per cache row), their
    arguments declared, once the library's layout matches the structs above."""
    check_layout(library)
    tokens, rows = library.decode_tokens, library.decode_rows
    # ..., logits, picks (NULL: none), n_threads
    tokens.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(_I), _I, _I, _P, _P, ctypes.c_int]
    rows.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(_I), _I, ctypes.POINTER(_I),
                     ctypes.POINTER(_I), _P, _P, ctypes.c_int]  # fmt: skip
    tokens.restype = rows.restype = None
    return tokens, rows
