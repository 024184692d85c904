"""`calc memory` and `calc cost` (glassformer/calc/memory_cost.py; seed 000 §2.3, seed 002)
against what torch really does: the tensors autograd saves in a training forward, the gradients
and AdamW state after a step, torch's FLOP counter on prefill and decode, and a filled KV cache."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from glassformer import cli
from glassformer.calc.memory_cost import (
    activation_bytes,
    decode_flops,
    decode_step_bytes,
    measure_peaks,
    prefill_flops,
    training_memory,
)
from glassformer.config import ModelConfig
from glassformer.models import build_model

GPT2_LIKE = dict(
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    max_seq_len=128,
    position="learned",
    norm="layer",
    ffn="gelu",
    d_ff=256,
    dropout=0.0,
)
LLAMA_LIKE = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                  max_seq_len=128, position="rope", norm="rms", ffn="swiglu", d_ff=172,
                  dropout=0.0)  # fmt: skip
FAMILIES = {"gpt2-like": GPT2_LIKE, "llama-like": LLAMA_LIKE}

# The formula counts the standard saved tensors of a pre-norm block and leaves out the small
# ones (norm statistics, token ids, the causal mask, RoPE tables); torch also saves a little
# differently from the textbook list (eager GQA keeps keys/values expanded to H heads, not the
# projection's output). Measured with torch 2.x on CPU the gap is under 2% for every case here
# (under 4% with bf16 autocast), so 5% leaves room for another kernel's choices while one
# missing (B, T, C) tensor per layer (5-6% of a layer at C=64) or the T² softmax term (11-25%
# under eager) still fails.
TOLERANCE = 0.05


def saved_tensor_bytes(model: torch.nn.Module, batch: int, seq_len: int) -> int:
    """Bytes of the distinct tensors autograd saves for backward in one training forward + loss,
    weights excluded (they are the parameters' bytes, counted apart)."""
    vocab = model.cfg.vocab_size
    ids = torch.randint(0, vocab, (batch, seq_len))
    targets = torch.randint(0, vocab, (batch, seq_len))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()  # views (q, k, v of one qkv) share one storage
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.loss(ids, targets)  # saved tensors live as long as the graph: no address reused
    return sum(storages.values())


def measured_and_formula(family: str, backend: str, batch: int, seq_len: int, layers: int = 2):
    cfg = ModelConfig(**{**FAMILIES[family], "n_layers": layers}, attention_backend=backend)
    model = build_model(cfg).train()
    return saved_tensor_bytes(model, batch, seq_len), activation_bytes(cfg, batch, seq_len)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("batch,seq_len", [(1, 32), (2, 64), (3, 96)])
def test_activation_formula_is_within_tolerance_of_the_saved_tensors(
    family, backend, batch, seq_len
):
    measured, formula = measured_and_formula(family, backend, batch, seq_len)
    assert abs(formula - measured) <= TOLERANCE * measured, (measured, formula)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activations_grow_linearly_in_batch_and_layers_as_measured(family, backend):
    (one, one_f), (two, _), (three, three_f) = (
        measured_and_formula(family, backend, batch, 48) for batch in (1, 2, 3)
    )
    # every saved tensor but the shared mask and RoPE tables has a batch axis: each sequence
    # adds the same bytes, and the formula is B x its per-sequence bytes
    assert three - two == two - one
    assert three_f == 3 * one_f
    assert abs(one_f - (two - one)) <= TOLERANCE * (two - one)
    deep, deep_f = measured_and_formula(family, backend, 2, 48, layers=4)
    shallow, shallow_f = measured_and_formula(family, backend, 2, 48, layers=2)
    per_layer, per_layer_f = (deep - shallow) / 2, (deep_f - shallow_f) / 2
    assert abs(per_layer_f - per_layer) <= TOLERANCE * per_layer, (per_layer, per_layer_f)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_autocast_bytes_are_within_tolerance_of_the_saved_tensors(family, backend):
    cfg = ModelConfig(**FAMILIES[family], attention_backend=backend)
    model = build_model(cfg).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_tensor_bytes(model, 2, 64)  # with autocast's bf16 weight copies
    mem = training_memory(cfg, 2, 64, "bf16")
    formula = mem["activations"] + mem["bf16 copies"]
    assert abs(formula - measured) <= TOLERANCE * measured, (measured, formula)
    assert mem["activations"] < activation_bytes(cfg, 2, 64, "fp32")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_checkpointing_keeps_one_stream_tensor_per_layer_plus_one_layer(family):
    # the peak under checkpointing: every layer's (B, T, C) fp32 input, plus one layer's saved
    # tensors while backward recomputes it (measured: a real one-layer model, head included)
    B, T, layers = 2, 64, 8
    one_layer, _ = measured_and_formula(family, "sdpa", B, T, layers=1)
    measured = layers * B * T * FAMILIES[family]["d_model"] * 4 + one_layer
    cfg = ModelConfig(**{**FAMILIES[family], "n_layers": layers})
    kept = activation_bytes(cfg, B, T, checkpointing=True)
    assert abs(kept - measured) <= TOLERANCE * measured, (measured, kept)
    assert kept < activation_bytes(cfg, B, T) / 3


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_gradient_and_adamw_bytes_equal_a_real_step(family):
    cfg = ModelConfig(**FAMILIES[family])
    model = build_model(cfg).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    model.loss(ids, ids).loss.backward()
    optimizer.step()
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    state = sum(t.nbytes for s in optimizer.state.values() for t in s.values())
    for dtype in ("fp32", "bf16"):  # autocast keeps fp32 weights, grads and moments
        mem = training_memory(cfg, 2, 16, dtype, "adamw")
        assert (mem["parameters"], mem["gradients"], mem["optimizer"]) == (params, grads, state)
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    sgd.step()
    assert training_memory(cfg, 2, 16, "fp32", "sgd")["optimizer"] == 0 == len(sgd.state)


# --- cost -----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_flops_equal_torchs_flop_counter(family):
    # eager: torch's counter has no formula for the CPU flash-attention kernel sdpa picks, so
    # under sdpa it counts the matmuls only; eager's two bmm are counted in full
    cfg = ModelConfig(**FAMILIES[family], attention_backend="eager")
    model = build_model(cfg).eval()
    B, P = 2, 40
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.randint(0, cfg.vocab_size, (B, P)), last_token_only=True)
    assert prefill_flops(cfg, P, B) == counter.get_total_flops()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decode_flops_equal_torchs_flop_counter_step_by_step(family):
    cfg = ModelConfig(**FAMILIES[family], attention_backend="eager")
    model = build_model(cfg).eval()
    B, P, N = 2, 12, 5
    cache = model.new_cache(B, P + N)
    ids = torch.randint(0, cfg.vocab_size, (B, P))
    with torch.no_grad():
        model(ids, torch.arange(P), cache=cache, last_token_only=True)
        with FlopCounterMode(display=False) as counter:
            for position in range(P, P + N):
                model(ids[:, -1:], torch.tensor([position]), cache=cache, last_token_only=True)
    # exact: each step attends over the positions filled so far, not the cache's empty slots
    assert decode_flops(cfg, P, N, B) == counter.get_total_flops()


def test_decode_step_bytes_are_the_weights_and_a_filled_cache():
    cfg = ModelConfig(**LLAMA_LIKE)
    model = build_model(cfg).eval()
    B, P = 3, 20
    cache = model.new_cache(B, 64)
    with torch.no_grad():
        model(torch.randint(0, cfg.vocab_size, (B, P)), torch.arange(P), cache=cache)
    weights = sum(p.nbytes for p in model.parameters())
    written = cache.k.ne(0).any(dim=-1).any(dim=2).any(dim=0)  # (B, slots): a key was written
    assert decode_step_bytes(cfg, P, "fp32", B) == weights + int(written.sum()) * (
        cache.kv_bytes_per_token
    )


def test_measured_peaks_are_positive_and_quick():
    gflops, gbps = measure_peaks(0.2)
    assert gflops > 0.1 and gbps > 0.1


# --- CLI ------------------------------------------------------------------------------------


def test_cli_memory_and_cost_print_their_bills(capsys):
    args = ["calc", "memory", "--model", "smollm2-135m", "--batch", "4", "--seq-len", "512"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "optimizer" in out and "activations" in out and "seed 000 §2.3" in out
    assert cli.main([*args, "--dtype", "bf16", "--checkpointing", "--optimizer", "sgd"]) == 0
    assert "stay fp32" in capsys.readouterr().out
    cost = ["calc", "cost", "--preset", "smollm2-135m", "--prompt-tokens", "256"]
    assert cli.main([*cost, "--new-tokens", "32", "--peak-gflops", "100", "--peak-gbps", "20"]) == 0
    out = capsys.readouterr().out
    assert "matmul 100.0 GFLOP/s" in out and "prefill" in out and "decode / token" in out


@pytest.mark.parametrize(
    "argv,names",
    [
        (["memory", "--batch", "0", "--seq-len", "8"], ["batch=0", "--batch 1"]),
        (["memory", "--batch", "2", "--seq-len", "-4"], ["seq_len=-4", "--seq-len 1"]),
        (["memory", "--batch", "2", "--seq-len", "8", "--dtype", "fp16"], ["'fp16'", "bf16"]),
        (["memory", "--batch", "2", "--seq-len", "8", "--optimizer", "lion"], ["'lion'", "adamw"]),
        (["cost", "--prompt-tokens", "0", "--new-tokens", "3"], ["prompt_tokens=0"]),
        (["cost", "--prompt-tokens", "3", "--new-tokens", "3", "--batch", "-1"], ["batch=-1"]),
        (["cost", "--prompt-tokens", "3", "--new-tokens", "3", "--dtype", "int4"], ["'int4'"]),
    ],
)
def test_cli_rejects_bad_input_in_one_line_naming_the_fix(argv, names, capsys):
    assert cli.main(["calc", *argv, "--model", "smollm2-135m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and err.count("\n") == 1
    assert all(name in err for name in names)


def test_cli_memory_refuses_an_encoder():
    with pytest.raises(ValueError, match="family='gpt'"):
        training_memory(ModelConfig.preset("bert-base"), 1, 8)
