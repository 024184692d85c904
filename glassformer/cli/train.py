"""`glassformer train`: a run from a TOML config, with --set overrides (train/trainer.py)."""

from __future__ import annotations

import argparse

from glassformer.cli.common import add_command
from glassformer.devices import DEVICES


def cmd_train(args: argparse.Namespace) -> None:
    """train a model from a TOML config

    Train a model. The TOML file has [model], [data] and [train] tables; see configs/ for
    examples. On several processes: torchrun --nproc-per-node N -m glassformer train --config C
    (train.strategy = "ddp" or "fsdp"; see docs/distributed.md).
    """
    from glassformer.train.config import load_run_config
    from glassformer.train.distributed import quiet_unless_main
    from glassformer.train.signals import StopRequests
    from glassformer.train.trainer import train

    quiet_unless_main()
    overrides = list(args.set or [])
    if args.device is not None:
        overrides.append(f"train.device={args.device}")  # after --set: the flag wins
    run = load_run_config(args.config, overrides)
    with StopRequests():  # Ctrl-C / SIGTERM: stop, keeping the checkpoints and freeing the lock
        result = train(
            run, resume=args.resume, progress=not args.no_progress, overwrite=args.overwrite
        )
    if result.val_loss is not None:
        print(
            f"done: {result.steps} steps | val loss {result.val_loss:.4f} nats/token vs "
            f"{result.baseline_loss:.4f} for the {result.baseline_name} baseline | "
            f"checkpoint in {result.out_dir}"
        )


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "train", cmd_train)
    p.add_argument("--config", help="TOML run config, e.g. configs/shakespeare-char.toml")
    p.add_argument(
        "--set",
        action="append",
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set train.max_steps=200 --set model.n_layers=2 "
        "(repeatable)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        help="where to train: auto (a CUDA GPU, then Apple's MPS, then the CPU), cpu, cuda or "
        "mps; overrides train.device (default: the config's, auto unless it says)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in train.out_dir, exactly where it stopped "
        "(only [train] values such as max_steps may change)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start a new run in a train.out_dir that already holds one; the old checkpoints "
        "are deleted once the new run has saved its first checkpoint, so a run that fails "
        "early loses nothing (without --resume or --overwrite such a folder is refused)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (for logs)")
