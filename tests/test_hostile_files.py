"""Hostile and damaged model files: every loader (glassformer checkpoints, Hugging Face folders,
GGUF files) refuses them with one error that names the file and the bad value, before anything
large is allocated, and nothing is ever unpickled.

Every input is built here from a tiny valid model, then damaged: a config that claims 100,000
layers, a shard index pointing outside its folder, NaN weights, truncated or byte-flipped
safetensors, random-bytes GGUF, metadata with 0 heads, pickles that would run code. Each one is
driven through `from_pretrained` and the CLI (`generate`, `info`, `convert`), which must answer
with exit code 2 and a one-line `error:` message, never a traceback.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import finish_gguf
from processes import DEADLINE_S
from safetensors.torch import load_file, save_file

import glassformer.memory
import glassformer.models
from glassformer.cli import main
from glassformer.config import ModelConfig
from glassformer.interop import gguf as gf_gguf
from glassformer.interop import gguf_file, hf_files
from glassformer.interop.hf import InteropError, save_hf_model
from glassformer.interop.integrity import non_finite
from glassformer.interop.pretrained import from_pretrained
from glassformer.models import build_model
from glassformer.train.checkpoint import CheckpointError, load_model_weights, save_model_weights

LOAD_ERRORS = (InteropError, CheckpointError)

# A tiny Llama-layout model: rope, RMS norm, SwiGLU, grouped KV heads, no biases.
TINY = ModelConfig(
    family="gpt", vocab_size=16, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=32,
    max_seq_len=32, position="rope", norm="rms", ffn="swiglu", norm_bias=False,
    tie_embeddings=True,
)  # fmt: skip
TOKENS = [chr(ord("a") + i) for i in range(TINY.vocab_size)]


# --- building valid files ---------------------------------------------------------------------


def write_checkpoint(step_dir: Path, cfg: ModelConfig = TINY) -> Path:
    """A glassformer step directory: model.safetensors + config.json."""
    step_dir.mkdir(parents=True)
    save_model_weights(build_model(cfg), step_dir / "model.safetensors")
    (step_dir / "config.json").write_text(cfg.to_json() + "\n")
    return step_dir


def write_hf_folder(folder: Path) -> Path:
    return save_hf_model(build_model(TINY), folder)  # model_type llama


def gguf_tensors(n_blocks: int = 2, d: int = 16, ff: int = 32) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 values (PyTorch dimension order) for TINY's layout."""
    rng = np.random.default_rng(0)
    kv = d // TINY.n_heads * TINY.n_kv_heads

    def rand(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.2, shape).astype(np.float32)

    tensors = {"token_embd.weight": rand(TINY.vocab_size, d), "output_norm.weight": rand(d)}
    for i in range(n_blocks):
        tensors |= {
            f"blk.{i}.attn_q.weight": rand(d, d), f"blk.{i}.attn_k.weight": rand(kv, d),
            f"blk.{i}.attn_v.weight": rand(kv, d), f"blk.{i}.attn_output.weight": rand(d, d),
            f"blk.{i}.attn_norm.weight": rand(d), f"blk.{i}.ffn_norm.weight": rand(d),
            f"blk.{i}.ffn_gate.weight": rand(ff, d), f"blk.{i}.ffn_up.weight": rand(ff, d),
            f"blk.{i}.ffn_down.weight": rand(d, ff),
        }  # fmt: skip
    return tensors


def gguf_metadata() -> dict[str, Any]:
    return {
        "llama.block_count": 2, "llama.embedding_length": 16, "llama.feed_forward_length": 32,
        "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
        "llama.context_length": 32, "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": TOKENS,
        "tokenizer.ggml.token_type": [1] * len(TOKENS),
    }  # fmt: skip


def _put(writer: gguf.GGUFWriter, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_int64(key, value)  # signed, so a test can write -1
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def write_gguf(
    path: Path, metadata: dict[str, Any] | None = None, tensors: dict | None = None
) -> Path:
    """A GGUF file the way llama.cpp lays one out; `metadata` entries replace the defaults (None
    drops a key)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in (gguf_metadata() | (metadata or {})).items():
        if value is not None:
            _put(writer, key, value)
    for name, values in (gguf_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, values)
    finish_gguf(writer)
    return path


def _edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("kind", ["checkpoint", "hf", "gguf"])
def test_the_undamaged_files_load(tmp_path: Path, kind: str) -> None:
    # The control for everything below: each refusal comes from the damage, not the base file.
    path = {
        "checkpoint": lambda: write_checkpoint(tmp_path / "ckpt"),
        "hf": lambda: write_hf_folder(tmp_path / "hf"),
        "gguf": lambda: write_gguf(tmp_path / "m.gguf"),
    }[kind]()
    model, _ = from_pretrained(path)
    assert model.cfg.n_layers == 2
    assert main(["info", "--model", str(path)]) == 0


# --- 1. sizes are checked against the file before anything is built ---------------------------


@pytest.fixture
def no_building(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any loader gets as far as allocating a model."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built from a config the file does not back")

    monkeypatch.setattr(glassformer.models, "build_model", refuse)
    monkeypatch.setattr(gf_gguf, "GPT", refuse)


@pytest.mark.parametrize(
    "changes, claim",
    [
        ({"n_layers": 100_000}, r"claims 100,000 layers .*\(233\.6M parameters\)"),
        (
            {"vocab_size": 2_000_000_000},
            r"claims 2 layers .* vocabulary of 2,000,000,000 \(32\.0B parameters\)",
        ),
    ],
    ids=["n_layers=100000", "vocab_size=2e9"],
)
def test_checkpoint_config_claiming_far_more_than_its_weights_is_refused(
    tmp_path: Path, no_building: None, changes: dict, claim: str
) -> None:
    step = write_checkpoint(tmp_path / "ckpt")
    _edit_json(step / "config.json", **changes)
    with pytest.raises(
        CheckpointError, match=rf"config\.json {claim} but model\.safetensors holds"
    ):
        from_pretrained(step)


def test_hf_config_claiming_far_more_than_its_safetensors_is_refused(
    tmp_path: Path, no_building: None
) -> None:
    folder = write_hf_folder(tmp_path / "hf")
    _edit_json(folder / "config.json", num_hidden_layers=5000, hidden_size=4096)
    with pytest.raises(
        InteropError, match=r"config\.json claims 5,000 layers of d_model=4,096 .* but "
        r"model\.safetensors holds .* the config does not belong to these weights"
    ):  # fmt: skip
        from_pretrained(folder)


def test_gguf_metadata_claiming_1000_blocks_with_tensors_for_2_is_refused(
    tmp_path: Path, no_building: None
) -> None:
    path = write_gguf(tmp_path / "m.gguf", {"llama.block_count": 1000})
    with pytest.raises(
        InteropError, match=r"metadata of .*m\.gguf claims 1,000 layers .* but its tensors hold"
    ):
        from_pretrained(path)


def test_gguf_lacking_a_block_is_refused_before_the_model_is_built(
    tmp_path: Path, no_building: None
) -> None:
    # 3 blocks claimed, 2 stored: within the size slack, so the name table catches it.
    path = write_gguf(tmp_path / "m.gguf", {"llama.block_count": 3})
    with pytest.raises(InteropError, match=r"m\.gguf lacks tensor\(s\) .*blk\.2\.attn_k\.weight"):
        from_pretrained(path)


@pytest.mark.parametrize("kind", ["checkpoint", "hf", "gguf"])
def test_a_model_larger_than_free_memory_is_refused_before_building(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_building: None, kind: str
) -> None:
    monkeypatch.setattr(glassformer.memory, "available_memory_bytes", lambda: 10_000)
    path = {
        "checkpoint": lambda: write_checkpoint(tmp_path / "ckpt"),
        "hf": lambda: write_hf_folder(tmp_path / "hf"),
        "gguf": lambda: write_gguf(tmp_path / "m.gguf"),
    }[kind]()
    with pytest.raises(LOAD_ERRORS, match=rf"loading {path}.* needs about .* is available"):
        from_pretrained(path)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")
def test_hostile_sizes_under_an_address_space_cap(tmp_path: Path) -> None:
    """The same refusals in a process that may map only 1 GiB more than it holds once imported:
    a loader that built the claimed model first would die of MemoryError (or run for minutes)
    instead of naming the config."""
    step = write_checkpoint(tmp_path / "ckpt")
    _edit_json(step / "config.json", n_layers=100_000, vocab_size=2_000_000_000)
    folder = write_hf_folder(tmp_path / "hf")
    _edit_json(folder / "config.json", num_hidden_layers=100_000, hidden_size=4096)
    path = write_gguf(tmp_path / "m.gguf", {"llama.block_count": 1000})
    script = textwrap.dedent(
        """
        import re, resource, sys
        import glassformer.interop.gguf, glassformer.models, glassformer.train.checkpoint
        from glassformer.interop.pretrained import from_pretrained
        status = open("/proc/self/status").read()
        cap = int(re.search(r"VmSize:\\s+(\\d+) kB", status)[1]) * 1024 + 2**30
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        for path in sys.argv[1:]:
            try:
                from_pretrained(path)
            except ValueError as err:
                print(type(err).__name__, "claims" in str(err))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(step), str(folder), str(path)],
        capture_output=True, text=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:3] == [
        "CheckpointError True", "InteropError True", "InteropError True"
    ]  # fmt: skip


# --- 2. a shard index may only name files inside its folder -----------------------------------


def _shard(folder: Path) -> dict[str, str]:
    """Split model.safetensors into two shards plus an index, as transformers writes them."""
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}  # fmt: skip
    weight_map = {}
    for shard, shard_names in halves.items():
        save_file({n: tensors[n] for n in shard_names}, folder / shard, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard_names, shard)
    _write_index(folder, weight_map)
    return weight_map


def _write_index(folder: Path, weight_map: Any) -> None:
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_sharded_folder_loads(tmp_path: Path) -> None:
    folder = write_hf_folder(tmp_path / "hf")
    _shard(folder)
    model, _ = from_pretrained(folder)
    assert model.cfg.n_layers == 2


def test_a_hub_cache_snapshot_linking_into_its_blobs_loads(tmp_path: Path) -> None:
    # huggingface_hub stores snapshots/<rev>/<file> as links to ../../blobs/<hash>.
    repo = tmp_path / "models--tiny"
    snapshot = write_hf_folder(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    for shard in _shard(snapshot).values():
        blob = repo / "blobs" / f"blob-{shard}"
        if not blob.exists():
            (snapshot / shard).rename(blob)
            (snapshot / shard).symlink_to(Path("../../blobs") / blob.name)
    model, _ = from_pretrained(snapshot)
    assert model.cfg.n_layers == 2


@pytest.mark.parametrize(
    "entry, message",
    [
        ("../../elsewhere/x.safetensors", r"'\.\./\.\./elsewhere/x\.safetensors' is a path with"),
        ("/etc/passwd", r"'/etc/passwd' is an absolute path"),
        ("link.safetensors", r"'link\.safetensors' is a link to .*outside\.safetensors"),
    ],
    ids=["dot-dot", "absolute", "symlink-out"],
)
def test_a_shard_outside_the_folder_is_refused(tmp_path: Path, entry: str, message: str) -> None:
    folder = write_hf_folder(tmp_path / "hf")
    weight_map = _shard(folder)
    outside = tmp_path / "outside.safetensors"
    (folder / "model-00002-of-00002.safetensors").rename(outside)
    (folder / "link.safetensors").symlink_to(outside)
    weight_map = {n: entry if s.startswith("model-00002") else s for n, s in weight_map.items()}
    _write_index(folder, weight_map)
    with pytest.raises(InteropError, match=rf"index\.json: the shard entry {message}"):
        from_pretrained(folder)


@pytest.mark.parametrize(
    "weight_map, message",
    [
        (5, r"weight_map=5 must be a non-empty object"),
        (["model.safetensors"], r"weight_map=\['model\.safetensors'\] must be a non-empty"),
        ({"lm_head.weight": 3}, r"weight_map\['lm_head\.weight'\]=3 must be a shard file name"),
    ],
    ids=["int", "list", "non-string-value"],
)
def test_a_malformed_weight_map_is_refused(tmp_path: Path, weight_map: Any, message: str) -> None:
    folder = write_hf_folder(tmp_path / "hf")
    _write_index(folder, weight_map)
    with pytest.raises(InteropError, match=rf"model\.safetensors\.index\.json: {message}"):
        from_pretrained(folder)


# --- 3. NaN and Inf weights -------------------------------------------------------------------


def _poison_safetensors(file: Path, name: str) -> None:
    tensors = load_file(file)
    flat = tensors[name].view(-1)
    flat[:2] = float("nan")
    flat[2] = float("inf")
    save_file(tensors, file, metadata={"format": "pt"})


def _nan_checkpoint(tmp_path: Path) -> Path:
    step = write_checkpoint(tmp_path / "ckpt")
    _poison_safetensors(step / "model.safetensors", "blocks.1.ffn.down.weight")
    return step


def _nan_hf_folder(tmp_path: Path) -> Path:
    folder = write_hf_folder(tmp_path / "hf")
    _poison_safetensors(folder / "model.safetensors", "model.layers.1.mlp.down_proj.weight")
    return folder


def _nan_gguf(tmp_path: Path) -> Path:
    tensors = gguf_tensors()
    tensors["blk.1.ffn_down.weight"].reshape(-1)[:3] = [np.nan, np.nan, np.inf]
    return write_gguf(tmp_path / "m.gguf", tensors=tensors)


NAN_FILES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "checkpoint": (_nan_checkpoint, r"model\.safetensors: tensor blocks\.1\.ffn\.down\.weight"),
    "hf": (_nan_hf_folder, r"model\.safetensors: tensor model\.layers\.1\.mlp\.down_proj\.weight"),
    "gguf": (_nan_gguf, r"m\.gguf: tensor blk\.1\.ffn_down\.weight"),
}


@pytest.mark.parametrize("kind", NAN_FILES)
def test_nan_weights_are_named_with_their_count(tmp_path: Path, kind: str) -> None:
    make, where = NAN_FILES[kind]
    with pytest.raises(
        LOAD_ERRORS, match=rf"{where} has 3 NaN/Inf value\(s\) \(of 512\): the file is damaged"
    ):
        from_pretrained(make(tmp_path))


def test_finite_values_whose_sum_overflows_are_not_called_bad() -> None:
    # The check sums first (cheap) and counts only when the sum is not finite.
    huge = torch.full((4,), 3e38)
    assert non_finite("w", huge) == ""
    huge[1] = float("-inf")
    assert non_finite("w", huge) == "tensor w has 1 NaN/Inf value(s) (of 4)"
    assert non_finite("ids", torch.arange(4)) == ""  # integer buffers are never checked


def test_load_model_weights_refuses_nan_weights(tmp_path: Path) -> None:
    step = _nan_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"has 3 NaN/Inf .* diverged .* earlier step"):
        load_model_weights(build_model(TINY), step / "model.safetensors")


@pytest.mark.parametrize("command", ["info", "convert"])
@pytest.mark.parametrize("kind", NAN_FILES)
def test_info_and_convert_of_nan_weights_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, kind: str, command: str
) -> None:
    make, where = NAN_FILES[kind]
    path = make(tmp_path)
    _assert_cli_refuses(command, path, tmp_path, capsys, rf"{where} has 3 NaN/Inf")


# --- 4. GGUF metadata -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"llama.attention.head_count": 0}, r"attention\.head_count=0 \(int\) must be an integer"),
        ({"llama.block_count": -1}, r"llama\.block_count=-1 \(int\) must be an integer >= 1"),
        ({"llama.block_count": 2.5}, r"llama\.block_count=2\.5 \(float\) must be an integer"),
        ({"llama.feed_forward_length": "32"}, r"feed_forward_length='32' \(str\) must be an"),
        ({"llama.embedding_length": None}, r"lacks the metadata key llama\.embedding_length"),
        ({"llama.attention.layer_norm_rms_epsilon": 0.0}, r"epsilon=0\.0 \(float\) must be a"),
        ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, r"epsilon=nan \(float\)"),
        ({"tokenizer.ggml.tokens": [1, 2, 3]}, r"tokenizer\.ggml\.tokens must be a list of str"),
        ({"tokenizer.ggml.tokens": [f"t{i}" for i in range(5000)]},
         r"vocabulary of 5,000 .* but its tensors hold"),
        ({"tokenizer.ggml.bos_token_id": "x"}, r"bos_token_id='x' \(str\) must be an integer"),
    ],
    ids=["head_count=0", "block_count=-1", "block_count=2.5", "ffn-length-string",
         "no-embedding-length", "eps=0", "eps=nan", "tokens-not-strings", "5000-tokens",
         "bos-id-string"],
)  # fmt: skip
def test_bad_gguf_metadata_is_named(tmp_path: Path, metadata: dict, message: str) -> None:
    path = write_gguf(tmp_path / "m.gguf", metadata)
    with pytest.raises(InteropError, match=rf"m\.gguf.*{message}"):
        from_pretrained(path)


def test_gguf_tensor_of_the_wrong_shape_is_named(tmp_path: Path) -> None:
    tensors = gguf_tensors()
    tensors["blk.1.ffn_down.weight"] = np.zeros((16, 40), np.float32)
    path = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    with pytest.raises(
        InteropError, match=r"blk\.1\.ffn_down\.weight has shape \(16, 40\) but the config needs"
    ):
        from_pretrained(path)


def _array_count_offset(raw: bytes, key: str) -> int:
    """Byte offset of the item count of metadata array `key`: after the key, the value type
    (u32) and the item type (u32)."""
    return raw.index(key.encode()) + len(key) + 8


@pytest.mark.parametrize("key", ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
def test_a_huge_array_claim_is_refused_at_once(tmp_path: Path, key: str) -> None:
    # 2**40 items in a 10 kB file: without a bound the reader loops (and allocates) per item.
    path = write_gguf(tmp_path / "m.gguf")
    raw = bytearray(path.read_bytes())
    at = _array_count_offset(bytes(raw), key)
    raw[at : at + 8] = struct.pack("<Q", 2**40)
    path.write_bytes(bytes(raw))
    with pytest.raises(InteropError, match=r"not a readable GGUF .*claims 1,099,511,627,776 items"):
        from_pretrained(path)


# --- config.json values of the wrong type (Hugging Face and glassformer) ----------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tie_word_embeddings": "no"}, r": tie_word_embeddings='no' \(str\) must be true or"),
        ({"hidden_size": None}, r" lacks 'hidden_size', which a llama config needs"),
        ({"num_attention_heads": None}, r" lacks 'num_attention_heads'"),
        ({"num_attention_heads": 0}, r": num_attention_heads=0 \(int\) must be an integer >= 1"),
        ({"hidden_size": "16"}, r": hidden_size='16' \(str\) must be an integer >= 1"),
        ({"num_hidden_layers": True}, r": num_hidden_layers=True \(bool\) must be an integer"),
        ({"rms_norm_eps": "tiny"}, r": rms_norm_eps='tiny' \(str\) must be a finite number"),
        ({"rope_scaling": "yes"}, r": rope_scaling='yes' \(str\) must be an object"),
        ({"model_type": ["llama"]}, r": model_type=\['llama'\] \(list\) must be a string"),
        ({"model_type": "llama9"}, r": model_type='llama9' is not supported: supported are"),
        ({"num_key_value_heads": 3}, r": n_kv_heads=3 does not divide n_heads=2"),
        ({"rope_parameters": {"rope_type": "linear", "factor": "2"}},
         r": rope_parameters factor='2' \(str\) must be a number"),
    ],
    ids=["tie=no", "no-hidden_size", "no-heads", "heads=0", "hidden_size-string",
         "layers=true", "eps-string", "rope_scaling-string", "model_type-list",
         "unknown-model_type", "kv-heads-do-not-divide", "rope-factor-string"],
)  # fmt: skip
def test_bad_hf_config_values_name_the_file_and_key(
    tmp_path: Path, changes: dict, message: str
) -> None:
    folder = write_hf_folder(tmp_path / "hf")
    _edit_json(folder / "config.json", **changes)
    with pytest.raises(InteropError, match=rf"config\.json{message}"):
        from_pretrained(folder)


def test_gpt2_config_without_its_width_names_the_key(tmp_path: Path) -> None:
    cfg = TINY.replace(position="learned", norm="layer", ffn="gelu", norm_bias=True, n_kv_heads=2)
    folder = save_hf_model(build_model(cfg), tmp_path / "gpt2")
    _edit_json(folder / "config.json", n_embd=None)
    with pytest.raises(InteropError, match=r"config\.json lacks 'n_embd', which a gpt2 config"):
        from_pretrained(folder)


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"tie_embeddings": "no"}', r"is not a valid model config: tie_embeddings='no' \(str\)"),
        ("[1, 2]", r"holds a JSON list, not a model config"),
    ],
    ids=["tie=no", "a-list"],
)
def test_bad_checkpoint_config_is_named(tmp_path: Path, content: str, message: str) -> None:
    step = write_checkpoint(tmp_path / "ckpt")
    (step / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=rf"config\.json {message}"):
        from_pretrained(step)


# --- 5. only the errors a damaged file causes are translated ----------------------------------


def test_a_bug_inside_the_safetensors_reader_is_not_disguised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = write_hf_folder(tmp_path / "hf")

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a bug, not a damaged file")

    monkeypatch.setattr(hf_files, "safe_open", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        hf_files.read_tensors([folder / "model.safetensors"])


def test_a_bug_inside_the_gguf_reader_is_not_disguised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_gguf(tmp_path / "m.gguf")

    def broken() -> Callable:
        def reader(path: str) -> None:
            raise TypeError("a bug, not a damaged file")

        return reader

    monkeypatch.setattr(gguf_file, "_reader_class", broken)
    with pytest.raises(TypeError, match="a bug"):
        gguf_file.read_gguf(path)


# --- 6. damaged files through every entry point -----------------------------------------------


class Trap:
    """Unpickling this creates `marker`: proof that a file was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def pickled_weights(marker: Path) -> bytes:
    return pickle.dumps({"weight": [1.0, 2.0], "trap": Trap(marker)})


def test_the_pickle_trap_fires_when_unpickled(tmp_path: Path) -> None:
    # The control for the pickle inputs: if anything unpickled them, the marker would appear.
    pickle.loads(pickled_weights(tmp_path / "marker")).get("trap").close()
    assert (tmp_path / "marker").exists()


def _cut(file: Path, keep: float) -> None:
    file.write_bytes(file.read_bytes()[: int(file.stat().st_size * keep)])


def _flip_header(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[9] = ord("X")  # the first byte of the JSON header after its opening brace
    file.write_bytes(bytes(raw))


def _huge_header_length(file: Path) -> None:
    raw = file.read_bytes()
    file.write_bytes(struct.pack("<Q", 2**60) + raw[8:])


def _make_directory(file: Path) -> None:
    file.unlink()
    file.mkdir()


SAFETENSORS_DAMAGE = {
    "truncated": (lambda f: _cut(f, 0.5), r"not a readable safetensors file"),
    "header-byte-flipped": (_flip_header, r"not a readable safetensors file .*invalid JSON"),
    "huge-header-length": (_huge_header_length, r"not a readable safetensors .*header too large"),
}


def _damaged_checkpoint(damage: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        step = write_checkpoint(tmp_path / "ckpt")
        damage(step / "model.safetensors")
        return step

    return make


def _damaged_hf(damage: Callable[[Path], None]) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        folder = write_hf_folder(tmp_path / "hf")
        damage(folder / "model.safetensors")
        return folder

    return make


def _damaged_gguf(damage: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        path = write_gguf(tmp_path / "m.gguf")
        path.write_bytes(damage(path.read_bytes()))
        return path

    return make


def _gguf_directory(tmp_path: Path) -> Path:
    (tmp_path / "m.gguf").mkdir()
    return tmp_path / "m.gguf"


def _huge_tokens(raw: bytes) -> bytes:
    at = _array_count_offset(raw, "tokenizer.ggml.tokens")
    return raw[:at] + struct.pack("<Q", 2**40) + raw[at + 8 :]


def _pickle_file(name: str) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        path = tmp_path / name
        path.write_bytes(pickled_weights(tmp_path / "marker"))
        return path

    return make


def _pickle_in_hf_folder(name: str) -> Callable[[Path], Path]:
    def make(tmp_path: Path) -> Path:
        folder = write_hf_folder(tmp_path / "hf")
        (folder / "model.safetensors").unlink()
        (folder / name).write_bytes(pickled_weights(tmp_path / "marker"))
        return folder

    return make


PICKLES = ("pytorch_model.bin", "model.pt", "model.pth", "model.ckpt", "model.pkl")

# input id -> (how to make it under tmp_path, what the error must say)
DAMAGED: dict[str, tuple[Callable[[Path], Path], str]] = {
    **{
        f"checkpoint-{name}": (_damaged_checkpoint(damage), rf"model\.safetensors is {message}")
        for name, (damage, message) in SAFETENSORS_DAMAGE.items()
    },
    **{
        f"hf-{name}": (_damaged_hf(damage), rf"model\.safetensors is {message}")
        for name, (damage, message) in SAFETENSORS_DAMAGE.items()
    },
    "checkpoint-weights-a-directory": (
        _damaged_checkpoint(_make_directory),
        r"ckpt is incomplete: model\.safetensors missing",
    ),
    "hf-weights-a-directory": (
        _damaged_hf(_make_directory),
        r"hf/model\.safetensors is not a file but a directory",
    ),
    "checkpoint-nan": (_nan_checkpoint, r"down\.weight has 3 NaN/Inf"),
    "hf-nan": (_nan_hf_folder, r"down_proj\.weight has 3 NaN/Inf"),
    "gguf-nan": (_nan_gguf, r"ffn_down\.weight has 3 NaN/Inf"),
    "gguf-random-bytes": (
        _damaged_gguf(lambda raw: np.random.default_rng(0).bytes(len(raw))),
        r"m\.gguf is not a readable GGUF file \(ValueError: GGUF magic invalid\)",
    ),
    "gguf-truncated-header": (
        _damaged_gguf(lambda raw: raw[:200]),
        r"m\.gguf is not a readable GGUF file",
    ),
    "gguf-truncated-tensors": (
        _damaged_gguf(lambda raw: raw[:-100]),
        r"m\.gguf is not a readable GGUF file",
    ),
    "gguf-huge-token-claim": (_damaged_gguf(_huge_tokens), r"claims 1,099,511,627,776 items"),
    # convert checks its source folder as a checkpoint first, and says so in its own words
    "gguf-a-directory": (
        _gguf_directory,
        r"m\.gguf( is a directory, not a GGUF file|: expected config\.json)",
    ),
    **{
        f"pickle-{name}": (_pickle_file(name), rf"{name} is a pickled checkpoint; .* never")
        for name in PICKLES
    },
    **{
        f"hf-folder-with-{name}": (
            _pickle_in_hf_folder(name),
            rf"has only pickled weights \({name}\); .* never",
        )
        for name in PICKLES
    },
}


def _assert_cli_refuses(
    command: str, path: Path, tmp_path: Path, capsys: pytest.CaptureFixture, message: str
) -> None:
    argv = {
        "generate": ["generate", "--model", str(path), "hello", "--max-new-tokens", "2"],
        "info": ["info", "--model", str(path)],
        "convert": ["convert", str(path), str(tmp_path / "converted"), "--to", "hf"],
    }[command]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize("entry", ["from_pretrained", "generate", "info", "convert"])
@pytest.mark.parametrize("damaged", DAMAGED)
def test_damaged_inputs_are_refused_everywhere(
    tmp_path: Path, capsys: pytest.CaptureFixture, damaged: str, entry: str
) -> None:
    make, message = DAMAGED[damaged]
    path = make(tmp_path)
    if entry == "from_pretrained":
        with pytest.raises(LOAD_ERRORS, match=message):
            from_pretrained(path)
    else:
        _assert_cli_refuses(entry, path, tmp_path, capsys, message)
    assert not (tmp_path / "marker").exists(), "a pickle was unpickled"
