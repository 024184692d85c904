"""The command line: `glassformer train | generate | chat | info | ...` (also
`python -m glassformer`).

One module per command group; each registers its commands with `add_parser(subparsers)`, and
each command is a typed handler that takes the parsed flags and whose docstring is its help
(common.add_command). Errors a user can fix print one clear line (--debug or GLASSFORMER_DEBUG=1
for the traceback).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from glassformer.interrupts import interrupt_exits

with interrupt_exits():  # Ctrl-C while the commands' modules load: exit 130, not a traceback
    from glassformer.cli import (
        bert,
        calc,
        chat,
        finetune,
        generate,
        inspect,
        lab,
        merge,
        models,
        rag,
        serve,
        tokenize,
        train,
        translate,
    )

# In the order `glassformer --help` lists them.
COMMAND_GROUPS = (
    train,
    finetune,
    generate,
    chat,
    serve,
    rag,
    models,
    merge,
    bert,
    translate,
    calc,
    inspect,
    lab,
    tokenize,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glassformer",
        description="The Transformer of the tutorials, built from scratch: train, generate, "
        "inspect.",
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the full traceback of an error (before the command: glassformer --debug ...)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A user's mistake (a bad value, a missing or damaged file, a full disk)
    is one line on stderr and exit code 2; a bug keeps its traceback. --debug (or
    GLASSFORMER_DEBUG=1) shows the traceback of a user error too."""
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt as err:  # Ctrl-C, or train/signals.Stopped (SIGINT, SIGTERM)
        signum = getattr(err, "signum", signal.SIGINT)
        print(f"\ninterrupted ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum
    except (ValueError, OSError) as err:  # ConfigError, CheckpointError, InteropError too
        if args.debug or os.environ.get("GLASSFORMER_DEBUG"):
            raise
        print(f"error{_on_rank()}: {one_line(err)}", file=sys.stderr)
        return 2
    return 0


def _on_rank() -> str:
    """ " on rank R of N" in a process that torchrun started with others, so that each error
    says which process it came from; nothing alone."""
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    return f" on rank {rank} of {world}" if world not in ("", "1") else ""


def one_line(err: BaseException) -> str:
    """The message of a user error on one line; an OSError names its file (errno text alone
    says "Is a directory" without saying which)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        message = f"{err.filename}: {err.strerror}"
    else:
        message = str(err) or type(err).__name__
    return " ".join(message.split())
