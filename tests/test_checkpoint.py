"""Checkpoints: round trips, pruning, crash safety, clear errors, exact optimizer/RNG resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from processes import DEADLINE_S
from torch import nn

from glassformer.config import ModelConfig
from glassformer.files import atomic_write_text
from glassformer.models import build_model
from glassformer.tokenizers import CharTokenizer
from glassformer.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load,
    load_model_weights,
    read_config,
    read_train_state,
    resolve_checkpoint,
    save_checkpoint,
)
from glassformer.train.train_state import (
    load_optimizer_state,
    optimizer_state_to_tensors,
    restore_rng_state,
    rng_state_tensors,
)

torch.set_num_threads(1)

CONFIG = ModelConfig(vocab_size=11, d_model=8, n_layers=1, n_heads=2, max_seq_len=16)


class TinyTied(nn.Module):
    """Embedding tied to the output head, as in GPT-2, plus a persistent buffer."""

    def __init__(self, seed: int, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.rand(width))


class FakeTokenizer:
    def save(self, directory: Path) -> None:
        (Path(directory) / "tokenizer.json").write_text('{"kind": "fake"}')


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_weights(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


# --- round trip -------------------------------------------------------------------------------


def test_save_resolve_load_round_trip(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    tensors = {"extra.counts": torch.arange(5), **rng_state_tensors()}
    step_dir = save_checkpoint(
        tmp_path,
        500,
        model,
        CONFIG,
        tokenizer=FakeTokenizer(),
        train_state={"losses": [2.5, 2.1], "data_position": 1234, "seed": 7},
        train_tensors=tensors,
    )
    assert step_dir == tmp_path / "step-000500"
    assert (tmp_path / "latest").read_text().strip() == "step-000500"
    assert sorted(p.name for p in step_dir.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "train_state.json",
        "train_state.safetensors",
    ]
    assert resolve_checkpoint(tmp_path) == step_dir
    assert resolve_checkpoint(step_dir) == step_dir
    assert resolve_checkpoint(step_dir / "model.safetensors") == step_dir

    fresh = TinyTied(seed=1)
    assert not torch.equal(fresh.proj.weight, model.proj.weight)
    load_model_weights(fresh, tmp_path)
    _assert_weights(fresh, _weights(model))

    assert read_config(tmp_path) == CONFIG
    assert json.loads((step_dir / "tokenizer.json").read_text()) == {"kind": "fake"}
    state, loaded = read_train_state(tmp_path)
    assert state == {"step": 500, "losses": [2.5, 2.1], "data_position": 1234, "seed": 7}
    assert loaded.keys() == tensors.keys()
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    step_dir = save_checkpoint(tmp_path, 1, model, CONFIG)
    with safetensors.safe_open(str(step_dir / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored == set(model.state_dict()) - {"head.weight"}

    fresh = TinyTied(seed=1)
    load_model_weights(fresh, step_dir)
    assert fresh.head.weight is fresh.embed.weight
    with torch.no_grad():
        fresh.embed.weight[0, 0] = 42.0
    assert fresh.head.weight[0, 0].item() == 42.0


def test_file_loads_with_safetensors_own_reader(tmp_path: Path) -> None:
    # An independent reader of the format: safetensors' load_model knows about tied names too.
    model = TinyTied(seed=0)
    step_dir = save_checkpoint(tmp_path, 1, model, CONFIG)
    fresh = TinyTied(seed=3)
    safetensors.torch.load_model(fresh, step_dir / "model.safetensors")
    _assert_weights(fresh, _weights(model))


def test_load_rebuilds_the_model_and_tokenizer(tmp_path: Path) -> None:
    tokenizer = CharTokenizer(list("abcdefghijk"))
    torch.manual_seed(0)
    model = build_model(CONFIG).eval()
    save_checkpoint(tmp_path, 7, model, CONFIG, tokenizer=tokenizer)
    loaded, loaded_tokenizer = load(tmp_path)
    assert not loaded.training
    ids = torch.tensor([tokenizer.encode("badge")])
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert loaded_tokenizer.encode("kick") == tokenizer.encode("kick")
    (tmp_path / "step-000007" / "tokenizer.json").unlink()
    assert load(tmp_path)[1] is None


def test_loading_a_checkpoint_never_imports_the_trainer(tmp_path: Path) -> None:
    """The format lives in interop/checkpoint.py, below train/ (the layering: imports only
    point down): a fresh process that imports the package and interop and loads a saved run the
    way generate and convert do (from_pretrained) holds no glassformer.train module afterwards."""
    torch.manual_seed(0)
    save_checkpoint(tmp_path, 7, build_model(CONFIG), CONFIG, tokenizer=CharTokenizer(list("ab")))
    script = (
        "import sys\n"
        "import glassformer, glassformer.interop.convert, glassformer.interop.gguf\n"
        "from glassformer.interop.pretrained import from_pretrained\n"
        "model, tokenizer = from_pretrained(sys.argv[1])\n"
        "assert tokenizer.encode('ba') == [1, 0]\n"
        "print(sorted(name for name in sys.modules if name.startswith('glassformer.train')))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- pruning ----------------------------------------------------------------------------------


def test_keep_last_prunes_older_steps(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    for step in (100, 200, 300, 400, 500):
        save_checkpoint(tmp_path, step, model, CONFIG, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000400", "step-000500"]
    save_checkpoint(tmp_path, 600, model, CONFIG, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000600"]


def test_keep_last_none_keeps_all_and_newer_runs_are_left_alone(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, CONFIG, keep_last=None)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-00000{i}" for i in (1, 2, 3)]
    # resuming from step 1 and saving step 2 again: step 3 belongs to an abandoned run
    save_checkpoint(tmp_path, 2, model, CONFIG, keep_last=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000002", "step-000003"]
    assert resolve_checkpoint(tmp_path).name == "step-000002"


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep_last=0"):
        save_checkpoint(tmp_path, 1, TinyTied(seed=0), CONFIG, keep_last=0)


# --- crash safety -----------------------------------------------------------------------------


def _loads_as_one_of(out_dir: Path, candidates: list[dict[str, torch.Tensor]]) -> None:
    """What a reader that arrives right now gets: a complete checkpoint with one known state."""
    latest = (out_dir / "latest").read_text().strip()
    resolved = resolve_checkpoint(out_dir)
    assert (resolved / "config.json").is_file() and (resolved / "model.safetensors").is_file()
    assert resolved.name == latest or resolved.name.startswith(f".old-{latest}-")
    fresh = TinyTied(seed=99)
    load_model_weights(fresh, resolved)
    state = fresh.state_dict()
    assert any(all(torch.equal(state[k], c[k]) for k in c) for c in candidates)


@pytest.mark.parametrize("overwrite", [False, True])
def test_every_intermediate_state_is_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool
) -> None:
    # A process killed between any two renames leaves exactly the disk state seen here.
    old, new = TinyTied(seed=0), TinyTied(seed=1)
    save_checkpoint(tmp_path, 100, old, CONFIG)
    if overwrite:
        save_checkpoint(tmp_path, 200, old, CONFIG)
    candidates = [_weights(old), _weights(new)]
    real_replace = os.replace
    calls = []

    def checking_replace(src: str | Path, dst: str | Path) -> None:
        _loads_as_one_of(tmp_path, candidates)
        real_replace(src, dst)
        calls.append(Path(dst).name)
        _loads_as_one_of(tmp_path, candidates)

    monkeypatch.setattr(os, "replace", checking_replace)
    save_checkpoint(tmp_path, 200, new, CONFIG)
    monkeypatch.undo()
    assert calls[-1] == "latest" and "step-000200" in calls
    assert len(calls) == (3 if overwrite else 2)  # aside, into place, latest
    fresh = TinyTied(seed=99)
    load_model_weights(fresh, tmp_path)
    _assert_weights(fresh, candidates[1])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize("failing_call", [0, 1, 2])
def test_failed_rename_leaves_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overwrite: bool, failing_call: int
) -> None:
    old, new = TinyTied(seed=0), TinyTied(seed=1)
    save_checkpoint(tmp_path, 100, old, CONFIG)
    if overwrite:
        save_checkpoint(tmp_path, 200, old, CONFIG)
    real_replace = os.replace
    count = [0]

    def failing_replace(src: str | Path, dst: str | Path) -> None:
        count[0] += 1
        if count[0] - 1 == failing_call:
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    n_renames = 3 if overwrite else 2
    if failing_call < n_renames:
        with pytest.raises(OSError, match="No space"):
            save_checkpoint(tmp_path, 200, new, CONFIG)
    else:
        save_checkpoint(tmp_path, 200, new, CONFIG)
    monkeypatch.undo()
    _loads_as_one_of(tmp_path, [_weights(old), _weights(new)])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    if failing_call == 0:  # nothing was renamed yet: the old checkpoint is untouched
        fresh = TinyTied(seed=99)
        load_model_weights(fresh, tmp_path)
        _assert_weights(fresh, _weights(old))


def test_leftovers_of_a_crash_are_ignored_then_removed(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    save_checkpoint(tmp_path, 100, model, CONFIG)
    half_written = tmp_path / ".tmp-step-000200-abcd"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"\x00\x01")
    assert resolve_checkpoint(tmp_path).name == "step-000100"
    save_checkpoint(tmp_path, 200, model, CONFIG)
    assert not half_written.exists()


def test_dangling_latest_falls_back_to_the_moved_aside_copy(tmp_path: Path) -> None:
    # The state a kill between "move old aside" and "move new in" leaves behind.
    model = TinyTied(seed=0)
    step_dir = save_checkpoint(tmp_path, 100, model, CONFIG)
    aside = tmp_path / ".old-step-000100-1234abcd"
    step_dir.rename(aside)
    assert resolve_checkpoint(tmp_path) == aside


def test_without_latest_the_highest_complete_step_wins(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    for step in (9, 10):
        save_checkpoint(tmp_path, step, model, CONFIG, keep_last=None)
    (tmp_path / "latest").unlink()
    (tmp_path / "step-000011").mkdir()  # incomplete: no files
    assert resolve_checkpoint(tmp_path).name == "step-000010"  # numeric, not "latest" text


def test_atomic_write_text_replaces_whole_file(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "latest"
    atomic_write_text(path, "one\n")
    atomic_write_text(path, "two\n")
    assert path.read_text() == "two\n"

    def broken_replace(src, dst) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        atomic_write_text(path, "three\n")
    monkeypatch.undo()
    assert path.read_text() == "two\n"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no temp file left behind


# --- errors -----------------------------------------------------------------------------------


def test_missing_path_says_how_to_get_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(err.value)
    assert "glassformer train" in str(err.value)
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        resolve_checkpoint(tmp_path)  # exists but empty
    with pytest.raises(CheckpointError):
        load_model_weights(TinyTied(seed=0), tmp_path / "nope")


def test_incomplete_step_dir_names_the_missing_file(tmp_path: Path) -> None:
    step_dir = save_checkpoint(tmp_path, 5, TinyTied(seed=0), CONFIG)
    (step_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"incomplete: model\.safetensors missing"):
        resolve_checkpoint(step_dir)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("keep_bytes", [0, 5, 100, -1])
def test_truncated_weights_raise_checkpoint_error_naming_the_file(
    tmp_path: Path, keep_bytes: int
) -> None:
    step_dir = save_checkpoint(tmp_path, 5, TinyTied(seed=0), CONFIG)
    file = step_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:keep_bytes])
    with pytest.raises(CheckpointError) as err:
        load_model_weights(TinyTied(seed=1), tmp_path)
    assert str(file) in str(err.value)
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_corrupt_json_raises_checkpoint_error(tmp_path: Path) -> None:
    step_dir = save_checkpoint(tmp_path, 5, TinyTied(seed=0), CONFIG)
    (step_dir / "config.json").write_text('{"vocab_size": 11,')
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        read_config(step_dir)
    (step_dir / "config.json").write_text('{"vocab_size": -3}')
    with pytest.raises(CheckpointError, match="vocab_size=-3"):
        read_config(step_dir)


class Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 16)  # shape differs
        self.head = nn.Linear(8, 11, bias=False)  # not tied, unlike the saved model
        self.extra = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))  # 8 names not in file


def test_strict_load_lists_missing_unexpected_and_mismatched(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, TinyTied(seed=0), CONFIG)
    with pytest.raises(CheckpointError) as err:
        load_model_weights(Wider(), tmp_path)
    message = str(err.value)
    assert "missing from the file: extra.0.bias, extra.0.weight" in message
    assert "and 4 more" in message  # 9 missing names: five shown, then a count
    assert "the file ties head.weight with embed.weight but the model does not" in message
    assert "not in the model: norm.bias, norm.weight, scale" in message
    assert "proj.weight (8, 8) in file vs (16, 8) in model" in message
    assert "ModelConfig.from_json" in message


def test_train_state_must_be_json_and_agree_on_step(tmp_path: Path) -> None:
    model = TinyTied(seed=0)
    with pytest.raises(ValueError, match="not JSON-able"):
        save_checkpoint(tmp_path, 5, model, CONFIG, train_state={"t": torch.zeros(1)})
    with pytest.raises(ValueError, match="train_state\\['step'\\]=4 differs from step=5"):
        save_checkpoint(tmp_path, 5, model, CONFIG, train_state={"step": 4})
    assert list(tmp_path.iterdir()) == []


# --- optimizer and RNG ------------------------------------------------------------------------


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 3, generator=gen)
        loss = (model(x) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_adamw_resume_is_bitwise_exact(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), eps=1e-6)
    _train(model, optimizer, steps=3, seed=1)

    meta, tensors = optimizer_state_to_tensors(optimizer)
    json.dumps(meta)  # the metadata really is JSON
    assert {"optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg_sq"} <= tensors.keys()
    assert "optimizer.state.0.step" in tensors
    save_checkpoint(
        tmp_path, 3, model, CONFIG, train_state={"optimizer": meta}, train_tensors=tensors
    )

    resumed = nn.Linear(3, 2)
    resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=0.5)  # hyperparameters come back
    load_model_weights(resumed, tmp_path)
    state, loaded = read_train_state(tmp_path)
    load_optimizer_state(resumed_opt, state["optimizer"], loaded)
    assert resumed_opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert resumed_opt.param_groups[0]["lr"] == 1e-2

    _train(model, optimizer, steps=4, seed=2)
    _train(resumed, resumed_opt, steps=4, seed=2)
    assert torch.equal(model.weight, resumed.weight)
    assert torch.equal(model.bias, resumed.bias)


def test_optimizer_state_with_wrong_group_count_is_refused() -> None:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    meta, tensors = optimizer_state_to_tensors(optimizer)
    two_groups = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}])
    with pytest.raises(CheckpointError, match="1 optimizer param groups but the optimizer has 2"):
        load_optimizer_state(two_groups, meta, tensors)


def test_rng_restore_repeats_the_same_draws(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(1234)
    torch.rand(3)
    saved = rng_state_tensors({"data": gen})
    expected_global = torch.rand(5)
    expected_gen = torch.rand(5, generator=gen)

    save_checkpoint(tmp_path, 1, TinyTied(seed=0), CONFIG, train_tensors=saved)
    torch.manual_seed(999)
    gen.manual_seed(999)
    _, loaded = read_train_state(tmp_path)
    restore_rng_state(loaded, {"data": gen})
    assert torch.equal(torch.rand(5), expected_global)
    assert torch.equal(torch.rand(5, generator=gen), expected_gen)

    with pytest.raises(CheckpointError, match=r"rng\.generator\.eval is missing"):
        restore_rng_state(loaded, {"eval": gen})
    with pytest.raises(CheckpointError, match=r"rng\.torch_cpu is missing"):
        restore_rng_state({})
