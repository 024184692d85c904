"""The GPU check: does glassformer train, generate and compute the same numbers on a CUDA GPU?

On one CUDA device (about a minute):
1. trains the `make demo` config (configs/shakespeare-char.toml) for --steps steps on the GPU,
   in fp32 and in bf16 autocast, and prints the val loss and training tokens/s of each;
2. generates 200 tokens from the fp32 checkpoint on the GPU;
3. runs SmolLM2-135M-Instruct in fp32 on the CPU and on the GPU over the same Hamlet prompt and
   prints the largest |logit difference| (the check passes at <= 1e-3; TF32 is switched off, as
   it would trade exactly these digits for speed);
4. times greedy batch-1 decode of SmolLM2 on the GPU and on the CPU (2 threads, decode kernels),
   the median of --runs;
5. with 2 or more GPUs: trains the same config with torchrun on every GPU (up to 8), DDP and
   then FSDP (nccl), and prints their val loss and tokens/s beside the 1-GPU fp32 run's (the
   same global batch, so the val losses should agree to GPU rounding).

    python benchmarks/gpu_check.py            # exits 2 with one line where torch sees no GPU
    python benchmarks/gpu_check.py --device cpu --steps 5   # the same path on the CPU (a smoke run)
    python benchmarks/gpu_check.py --device cpu --steps 5 --procs 2   # step 5 too, on gloo
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from glassformer.data import shakespeare_plays
from glassformer.devices import resolve_device, synchronize
from glassformer.infer.engine import Engine
from glassformer.infer.optimize import optimize_for_decode
from glassformer.infer.sampling import NO_EOS
from glassformer.interop.pretrained import from_pretrained
from glassformer.train.checkpoint import load
from glassformer.train.config import load_run_config
from glassformer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
LOGIT_TOLERANCE = 1e-3


def train_demo(device: str, dtype: str, steps: int, out_dir: Path) -> dict:
    overrides = [
        f"train.max_steps={steps}", f"train.out_dir='{out_dir}'", f"train.device='{device}'",
        f"train.dtype='{dtype}'", f"train.eval_interval={steps}",
        f"train.checkpoint_interval={steps}", f"train.warmup_steps={min(50, steps)}",
    ]  # fmt: skip
    run = load_run_config(REPO / "configs" / "shakespeare-char.toml", overrides)
    started = time.perf_counter()
    result = Trainer(run, progress=False).fit()
    return {
        "val_loss": result.val_loss,
        "baseline": result.baseline_loss,
        "tokens_per_s": result.tokens_per_s,
        "seconds": time.perf_counter() - started,
    }


def train_distributed(device: str, strategy: str, procs: int, steps: int, out_dir: Path) -> dict:
    """The demo config under torchrun on `procs` processes: (val loss, tokens/s) from rank 0's
    log (the eval line at the last step)."""
    sets = [
        f"train.max_steps={steps}", f"train.out_dir='{out_dir}'", f"train.device='{device}'",
        f"train.strategy='{strategy}'", f"train.eval_interval={steps}",
        f"train.checkpoint_interval={steps}", f"train.warmup_steps={min(50, steps)}",
    ]  # fmt: skip
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(procs),
               "--master-addr", "127.0.0.1", "--master-port", "29517", "-m", "glassformer",
               "train", "--config", str(REPO / "configs" / "shakespeare-char.toml"),
               "--no-progress", *[f"--set={s}" for s in sets]]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    found = re.findall(r"val loss ([\d.]+) .*\| ([\d,]+) tok/s", done.stdout)
    if done.returncode != 0 or not found:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    val_loss, tokens_per_s = found[-1]
    return {
        "val_loss": float(val_loss),
        "tokens_per_s": float(tokens_per_s.replace(",", "")),
        "seconds": time.perf_counter() - started,
    }


def generate_sample(out_dir: Path, device: torch.device) -> tuple[str, float]:
    model, tokenizer = load(out_dir)
    result = Engine(model.to(device)).generate(
        tokenizer.encode("ROMEO:"), max_new_tokens=200, temperature=0, eos_token_id=NO_EOS
    )
    return "ROMEO:" + tokenizer.decode(result.token_ids), result.stats.decode_tokens_per_s


def hamlet_ids(tokenizer, n_tokens: int) -> list[int]:
    plays = shakespeare_plays("modern")
    text = plays[next(k for k in plays if "hamlet" in k)]
    return tokenizer.encode(text[: 8 * n_tokens], add_special_tokens=False)[:n_tokens]


@torch.no_grad()
def logit_difference(cpu_model, gpu_model, ids: list[int], device: torch.device) -> float:
    batch = torch.tensor([ids])
    on_cpu = cpu_model(batch)
    on_gpu = gpu_model(batch.to(device)).float().cpu()
    return float((on_cpu - on_gpu).abs().max())


def decode_speed(model, ids: list[int], device: torch.device, new_tokens: int, runs: int) -> float:
    engine = Engine(model)
    speeds = []
    for _ in range(runs + 1):  # the first run warms up kernels and caches
        synchronize(device)
        result = engine.generate(ids, max_new_tokens=new_tokens, temperature=0, eos_token_id=NO_EOS)
        speeds.append(result.stats.decode_tokens_per_s)
    return statistics.median(speeds[1:])


def distributed_check(args, device: torch.device, single: dict, tmp: Path) -> None:
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    procs = args.procs or (min(gpus, 8) if gpus >= 2 else 0)
    if procs < 2:
        print(f"\n5. DDP/FSDP: skipped (torch sees {gpus} GPU(s); step 5 needs 2 or more)")
        return
    print(f"\n5. the demo config on {procs} processes with torchrun, {args.steps} steps, fp32")
    print(f"   {'strategy':<10} {'val loss':>9} {'vs 1 proc':>10} {'tok/s':>10} {'speedup':>8}")
    print(
        f"   {'1 process':<10} {single['val_loss']:>9.4f} {'':>10} "
        f"{single['tokens_per_s']:>10,.0f} {1.0:>7.2f}x"
    )
    for strategy in ("ddp", "fsdp"):
        row = train_distributed(args.device, strategy, procs, args.steps, tmp / strategy)
        if "error" in row:
            print(f"   {strategy:<10} failed: {row['error']}")
            continue
        print(
            f"   {strategy:<10} {row['val_loss']:>9.4f} "
            f"{row['val_loss'] - single['val_loss']:>+10.4f} {row['tokens_per_s']:>10,.0f} "
            f"{row['tokens_per_s'] / single['tokens_per_s']:>7.2f}x"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run")
    parser.add_argument("--steps", type=int, default=100, help="training steps per precision")
    parser.add_argument("--runs", type=int, default=3, help="decode timings per device (median)")
    parser.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per run")
    parser.add_argument(
        "--procs",
        type=int,
        default=None,
        help="processes for step 5 (default: every GPU, up to 8, when there are 2 or more)",
    )
    args = parser.parse_args()
    try:
        device = resolve_device(args.device)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(2)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"gpu_check on {name} | torch {torch.__version__}")

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        print(f"\n1. train the demo config for {args.steps} steps on {device.type}")
        print(f"   {'dtype':<6} {'val loss':>9} {'baseline':>9} {'tok/s':>10} {'seconds':>8}")
        for dtype in ("fp32", "bf16"):
            rows[dtype] = row = train_demo(args.device, dtype, args.steps, Path(tmp) / dtype)
            print(
                f"   {dtype:<6} {row['val_loss']:>9.4f} {row['baseline']:>9.4f} "
                f"{row['tokens_per_s']:>10,.0f} {row['seconds']:>8.1f}"
            )
        text, speed = generate_sample(Path(tmp) / "fp32", device)
        print(f"\n2. generate 200 tokens greedy on {device.type} ({speed:,.0f} tok/s):")
        print("   " + text[:300].replace("\n", "\n   "))

    cpu_model, tokenizer = from_pretrained("smollm2")
    gpu_model, _ = from_pretrained("smollm2")
    gpu_model.to(device)
    ids = hamlet_ids(tokenizer, 128)
    difference = logit_difference(cpu_model, gpu_model, ids, device)
    verdict = "PASS" if difference <= LOGIT_TOLERANCE else "FAIL"
    print(
        f"\n3. SmolLM2 fp32 logits, CPU vs {device.type}, {len(ids)} tokens: max |diff| "
        f"{difference:.2e} (<= {LOGIT_TOLERANCE:g}: {verdict})"
    )

    prompt = ids[:32]
    gpu_speed = decode_speed(gpu_model, prompt, device, args.new_tokens, args.runs)
    cpu_speed = decode_speed(optimize_for_decode(cpu_model), prompt, torch.device("cpu"),
                             args.new_tokens, args.runs)  # fmt: skip
    print(
        f"\n4. SmolLM2 greedy decode, batch 1, {args.new_tokens} tokens (median of {args.runs}):"
        f"\n   {device.type}: {gpu_speed:,.1f} tok/s | cpu (2 threads, decode kernels): "
        f"{cpu_speed:,.1f} tok/s | ratio {gpu_speed / cpu_speed:.2f}x"
    )
    with tempfile.TemporaryDirectory() as tmp:
        distributed_check(args, device, rows["fp32"], Path(tmp))
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
