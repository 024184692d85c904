"""--device on the command line: generate, chat, inspect attention and train run where they are
told, refuse a device the machine lacks in one line, and keep the C decode kernels (--quantize,
--compile) on the CPU they serve."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from glassformer.calc import kv_bytes_per_token
from glassformer.cli import common, main
from glassformer.cli.common import DecodeOptions, prepare_for_decode
from glassformer.infer.optimize import DecodeLinear
from glassformer.interop.pretrained import from_pretrained

NO_GPU = "error: device='cuda' but torch sees no CUDA GPU"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@pytest.fixture
def checkpoint(tiny_run_config) -> Path:
    config = tiny_run_config(max_steps=2)
    assert main(["train", "--config", str(config), "--device", "cpu", "--no-progress"]) == 0
    return config.parent / "run"


def generate(checkpoint: Path, *flags: str) -> list[str]:
    return ["generate", "--model", str(checkpoint), "To be", "--max-new-tokens", "8", *flags]


def test_train_device_overrides_the_config(checkpoint):
    saved = json.loads((checkpoint / "run_config.json").read_text())
    assert saved["train"]["device"] == "cpu"


@pytest.mark.parametrize("sampling", [["--temperature", "0"], ["--seed", "3"]])
def test_device_cpu_generates_what_the_default_does(checkpoint, capsys, sampling):
    texts = []
    for device in ([], ["--device", "cpu"]):
        assert main(generate(checkpoint, *sampling, *device)) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith("To be")


@no_cuda
@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--model", "MODEL", "hi", "--device", "cuda"],
        ["chat", "--model", "MODEL", "--device", "cuda"],
        ["inspect", "attention", "hi", "--model", "MODEL", "--device", "cuda"],
    ],
)
def test_a_missing_gpu_is_one_line_naming_the_fix(checkpoint, capsys, argv):
    argv = [str(checkpoint) if a == "MODEL" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_GPU) and err.count("\n") == 1
    assert "use --device cpu" in err


@no_cuda
def test_train_on_a_missing_gpu_is_one_line(tiny_run_config, capsys):
    config = tiny_run_config(max_steps=1)
    assert main(["train", "--config", str(config), "--device", "cuda", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(NO_GPU) and err.count("\n") == 1


@pytest.fixture
def gpu_machine(monkeypatch):
    """Pretend torch sees a GPU: resolve_device answers cuda for auto and cuda. Only the checks
    before loading may run on it; anything that reaches a tensor would fail."""

    def resolve(name: str = "auto") -> torch.device:
        return torch.device("cpu" if name == "cpu" else "cuda")

    monkeypatch.setattr(common, "resolve_device", resolve)


@pytest.mark.parametrize(
    "flags, named",
    [(["--quantize", "int8"], "--quantize int8"), (["--compile"], "--compile")],
)
def test_cpu_kernels_on_a_gpu_are_one_line_naming_device_cpu(
    checkpoint, capsys, gpu_machine, flags, named
):
    assert main(generate(checkpoint, *flags, "--device", "cuda")) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {named} runs on the CPU decode kernels, not on --device cuda")
    assert "use --device cpu" in err and err.count("\n") == 1


def test_auto_keeps_int8_on_the_cpu_when_a_gpu_is_there(checkpoint, capsys, request):
    args = generate(checkpoint, "--temperature", "0", "--quantize", "int8")
    assert main(args) == 0
    expected = capsys.readouterr().out
    request.getfixturevalue("gpu_machine")
    assert main(args) == 0  # auto: the int8 kernels' CPU, never the GPU
    assert capsys.readouterr().out == expected


def test_off_the_cpu_the_model_runs_as_built_on_that_device(checkpoint):
    # The meta device stands in for a GPU: shapes without storage, no decode kernels.
    model, _ = from_pretrained(checkpoint)
    prepared = prepare_for_decode(model, torch.device("meta"), DecodeOptions(dtype="bf16"))
    assert not any(isinstance(m, DecodeLinear) for m in prepared.modules())
    assert {p.device.type for p in prepared.parameters()} == {"meta"}
    assert {p.dtype for p in prepared.parameters()} == {torch.bfloat16}
    model, _ = from_pretrained(checkpoint)
    on_cpu = prepare_for_decode(model, torch.device("cpu"), DecodeOptions())
    assert any(isinstance(m, DecodeLinear) for m in on_cpu.modules())


@pytest.mark.parametrize("kv", ["fp32", "bf16", "fp16"])
def test_kv_cache_dtype_stores_the_keys_in_that_many_bytes(checkpoint, capsys, kv):
    # --stats reports the cache bytes the row holds: calc's closed form for the dtype asked,
    # times the positions held (prompt + generated, less the last token, sampled not fed).
    assert main(generate(checkpoint, "--kv-cache-dtype", kv, "--stats", "--seed", "1")) == 0
    err = capsys.readouterr().err
    prompt, generated = (int(n) for n in re.findall(r"(\d+) (?:prompt tokens|generated)", err))
    in_use = float(re.search(r"KV cache ([\d.]+) KiB in use", err)[1])
    model, _ = from_pretrained(checkpoint)
    per_token = kv_bytes_per_token(model.cfg, kv)
    assert in_use == round(per_token * (prompt + generated - 1) / 1024, 1)


def test_kv_cache_dtype_with_compile_is_one_line(checkpoint, capsys):
    assert main(generate(checkpoint, "--compile", "--kv-cache-dtype", "bf16")) == 2
    err = capsys.readouterr().err
    assert "--compile keeps its static cache in the model's dtype" in err
    assert err.count("\n") == 1
