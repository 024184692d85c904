"""Devices and precision: --device resolution, per-device autocast with a gradient scaler for
fp16, and generation that never leaves torch in inference mode between tokens."""

from __future__ import annotations

import pytest
import torch

from glassformer.config import ModelConfig
from glassformer.devices import grad_scaler, half_dtype, resolve_device
from glassformer.infer.engine import Engine
from glassformer.models import build_model
from glassformer.train.config import load_run_config
from glassformer.train.trainer import Trainer


def test_a_device_the_machine_lacks_is_a_clear_error():
    if torch.cuda.is_available():
        assert resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="device='tpu' is not known"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_fp16_needs_a_scaler_and_bf16_does_not():
    cpu = torch.device("cpu")
    assert half_dtype(cpu, "fp32") is None and grad_scaler(cpu, None) is None
    assert half_dtype(cpu, "bf16") == torch.bfloat16 and grad_scaler(cpu, torch.bfloat16) is None
    assert isinstance(grad_scaler(cpu, half_dtype(cpu, "fp16")), torch.amp.GradScaler)


def _losses(tiny_run_config, name: str, dtype: str) -> list[float]:
    path = tiny_run_config(name, max_steps=6, dtype=dtype, device="cpu", learning_rate=3e-3)
    trainer = Trainer(load_run_config(path), progress=False)
    assert next(trainer.model.parameters()).device.type == "cpu"
    return trainer.fit().train_losses


def test_mixed_precision_training_follows_the_fp32_run(tiny_run_config):
    reference = _losses(tiny_run_config, "fp32", "fp32")
    for dtype in ("bf16", "fp16"):
        losses = _losses(tiny_run_config, dtype, dtype)
        assert all(abs(a - b) < 0.05 for a, b in zip(losses, reference, strict=True)), dtype
        assert losses[-1] < losses[0]


def test_streaming_never_leaves_inference_mode_on():
    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=16)
    engine = Engine(build_model(cfg))
    stream = engine.stream([1, 2, 3], max_new_tokens=4, temperature=0)
    next(stream)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    assert len(list(stream)) == 3
    abandoned = engine.stream([1, 2, 3], max_new_tokens=4, temperature=0)
    next(abandoned)
    del abandoned
    assert not torch.is_inference_mode_enabled()
