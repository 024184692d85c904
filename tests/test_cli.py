"""The command line end to end: train, generate, info, and one-line errors for bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from glassformer.cli import main
from glassformer.data import shakespeare_plays
from glassformer.interop.pretrained import from_pretrained

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A checkpoint trained through the CLI on one play, with the demo's TOML config."""
    tmp = tmp_path_factory.mktemp("cli")
    corpus = tmp / "corpus.txt"
    plays = shakespeare_plays("modern")
    corpus.write_text(plays[next(k for k in plays if "hamlet" in k)][:50_000], encoding="utf-8")
    out = tmp / "run"
    code = main(
        [
            "train", "--config", str(REPO / "configs" / "shakespeare-char.toml"),
            "--set", f'data.corpus="{corpus}"', "--set", f'train.out_dir="{out}"',
            "--set", "train.max_steps=6", "--set", "train.eval_interval=3",
            "--set", "train.batch_size=4", "--set", "model.n_layers=1",
            "--set", "train.threads=1", "--no-progress",
        ]
    )  # fmt: skip
    assert code == 0
    return out


def test_train_writes_a_loadable_checkpoint(trained, capsys):
    assert (trained / "latest").read_text().strip() == "step-000006"
    step = trained / "step-000006"
    for name in ("model.safetensors", "config.json", "tokenizer.json", "train_state.json"):
        assert (step / name).is_file()


def test_generate_streams_text_and_stats(trained, capsys):
    code = main(
        ["generate", "--model", str(trained), "To be", "--max-new-tokens", "12", "--seed", "0",
         "--stats"]
    )  # fmt: skip
    assert code == 0
    out, err = capsys.readouterr()
    assert out.startswith("To be") and len(out.rstrip("\n")) == len("To be") + 12  # char model
    assert "time to first token" in err and "tok/s" in err and "KV cache" in err


def test_greedy_generation_is_deterministic(trained, capsys):
    outputs = []
    for _ in range(2):
        main(["generate", "--model", str(trained), "KING", "--temperature", "0"])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_info_prints_the_parameter_table(trained, capsys):
    assert main(["info", "--model", str(trained)]) == 0
    out = capsys.readouterr().out
    model, _ = from_pretrained(trained)
    total = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert f"{trained}: {total:,} parameters" in out
    assert "component" in out and "per layer" in out and "attention" in out
    assert any(line.split()[:2] == ["total", f"{total:,}"] for line in out.splitlines())
    assert "bytes/token" in out


def test_info_and_calc_params_print_one_parameter_table(trained, capsys):
    assert main(["calc", "params", "--model", str(trained)]) == 0
    table = capsys.readouterr().out
    assert main(["info", "--model", str(trained)]) == 0
    info = capsys.readouterr().out
    assert info.startswith(table) and "KV cache per token" in info[len(table) :]


def test_missing_checkpoint_is_one_clear_line(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nothing"), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "nothing" in err and "Traceback" not in err


def test_corrupt_checkpoint_is_one_clear_line(trained, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(trained / "step-000006", broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 20)
    assert main(["generate", "--model", str(broken), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "model.safetensors" in err


def test_unknown_character_and_long_prompt_are_clear(trained, capsys):
    assert main(["generate", "--model", str(trained), "猫"]) == 2
    assert "猫" in capsys.readouterr().err
    assert main(["generate", "--model", str(trained), "a" * 500]) == 2
    assert "context window" in capsys.readouterr().err


def test_bad_config_value_is_one_clear_line(capsys):
    code = main(["train", "--set", "model.position=rotary", "--set", "train.max_steps=1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "position='rotary' is not known" in err and "rope" in err


def test_python_dash_m_entry_point_shows_help():
    proc = subprocess.run(
        [sys.executable, "-m", "glassformer", "generate", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "--top-p" in proc.stdout and "--temperature" in proc.stdout


def test_decode_kernels_generate_what_the_plain_model_does(trained, capsys):
    """generate runs the model through optimize_for_decode by default; --plain runs it as
    built. Greedy, the two texts are the same (fp32 sums in another order: no near-ties)."""
    args = ["generate", "--model", str(trained), "To be", "--max-new-tokens", "24",
            "--temperature", "0"]  # fmt: skip
    texts = []
    for extra in ([], ["--plain"]):
        assert main([*args, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and len(texts[0].rstrip("\n")) == len("To be") + 24
    assert main([*args, "--dtype", "bf16"]) == 0
    assert capsys.readouterr().out.startswith("To be")


def test_int8_with_bf16_is_one_clear_line(trained, capsys):
    args = ["generate", "--model", str(trained), "hi", "--quantize", "int8", "--dtype", "bf16"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "drop --dtype bf16" in err


@pytest.mark.slow
def test_compiled_generation_prints_what_the_engine_does(trained, capsys):
    """--compile runs a torch.compile'd decode step (infer/compiled.py); greedy, its text equals
    the streamed Engine's, and --plain with it is refused."""
    args = ["generate", "--model", str(trained), "To be", "--max-new-tokens", "12",
            "--temperature", "0"]  # fmt: skip
    assert main(args) == 0
    expected = capsys.readouterr().out
    assert main([*args, "--compile"]) == 0
    out, err = capsys.readouterr()
    assert out == expected and "compiling" in err
    assert main([*args, "--compile", "--plain"]) == 2
    assert "drop --plain" in capsys.readouterr().err
