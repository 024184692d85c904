"""`glassformer lab list | run | report`: the claims lab (issue 7). Each experiment tests one
claim quoted from the tutorials and says whether it holds here (glassformer/lab/)."""

from __future__ import annotations

import argparse

from glassformer.cli.common import add_command, add_command_group, positive_int, seed


def cmd_lab_list(args: argparse.Namespace) -> None:
    """the experiments, their claims and sources"""
    from glassformer.lab.base import discover

    for exp in discover().values():
        print(f"{exp.number:>3}  {exp.name:<24} {exp.title}")
        print(f"     source: {exp.source}")
        print(f"     claim:  {exp.claim.splitlines()[0][:90]}")


def cmd_lab_run(args: argparse.Namespace) -> None:
    """run one experiment (NAME) or all (--all)

    Run experiments; write OUT/NAME.json and OUT/NAME.png and print the table, the checks and
    the verdict.
    """
    from glassformer.lab.base import RunContext
    from glassformer.lab.runner import run_many

    if bool(args.name) == bool(args.all):
        raise ValueError("give one experiment NAME or --all (glassformer lab list shows them)")
    if args.full + args.quick + args.tiny > 1:
        raise ValueError("give one of --full, --quick and --tiny (full is the default)")
    ctx = RunContext(
        out_dir=args.out, quick=args.quick, tiny=args.tiny, threads=args.threads, seed=args.seed
    )
    if ctx.mode == "full":
        print(
            "full mode: the sizes the claims deserve, at least 3 seeds per training experiment; "
            f"on 2 CPU cores {'--all takes hours' if args.all else 'up to about 15 minutes'} "
            "(--resume skips results that are current; --quick: small sizes, for development)",
            flush=True,
        )
    records = run_many(None if args.all else [args.name], ctx, resume=args.resume)
    if len(records) > 1:
        for rec in records:
            print(f"{rec['name']:<24} {rec['verdict']:<20} {rec['seconds']:>7} s")


def cmd_lab_report(args: argparse.Namespace) -> None:
    """write docs/claims.md and docs/claims.zh.md from the results folder"""
    from pathlib import Path

    from glassformer.lab.report import load_records, update_readme, write_report, write_report_zh

    english = Path(args.to)
    print(f"wrote {write_report(args.out, english)}")
    print(f"wrote {write_report_zh(args.out, english.with_suffix('.zh.md'))}")
    # The README of the tree the report is written into (docs/claims.md -> ./README.md), so a
    # report written elsewhere never rewrites the README of the folder it was run from.
    readme = english.resolve().parent.parent / "README.md" if args.readme is None else args.readme
    if readme and Path(readme).is_file() and update_readme(load_records(args.out), readme):
        print(f"updated the lab summary in {readme}")


GROUP_HELP = """the claims lab: run the tutorials' checkable claims (lab list | run | report)

Each experiment tests one claim quoted from the tutorials: it prints the numbers, writes a figure
and a JSON, and says whether the claim holds here.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    lab_sub = add_command_group(sub, "lab", GROUP_HELP, dest="lab_command")
    add_command(lab_sub, "list", cmd_lab_list)
    q = add_command(lab_sub, "run", cmd_lab_run)
    q.add_argument("name", nargs="?", metavar="NAME", help="an experiment (see lab list)")
    q.add_argument("--all", action="store_true", help="run every experiment")
    q.add_argument(
        "--full", action="store_true", help="the published sizes, >= 3 seeds (the default)"
    )
    q.add_argument("--quick", action="store_true", help="small sizes, 2 seeds: for development")
    q.add_argument(
        "--resume",
        action="store_true",
        help="skip experiments whose result in --out is current (same code, mode and seed)",
    )
    q.add_argument("--tiny", action="store_true", help="smallest sizes (what the tests run)")
    q.add_argument("--out", default="docs/lab", help="results folder (default docs/lab)")
    q.add_argument("--threads", type=positive_int, help="torch threads (default: torch's)")
    q.add_argument("--seed", type=seed, default=0, help="random seed (default 0)")
    q = add_command(lab_sub, "report", cmd_lab_report)
    q.add_argument("--out", default="docs/lab", help="results folder to read (default docs/lab)")
    q.add_argument(
        "--to",
        default="docs/claims.md",
        help="markdown file (default docs/claims.md; the Chinese report goes beside it as "
        "NAME.zh.md)",
    )
    q.add_argument(
        "--readme",
        default=None,
        help="README whose LAB SUMMARY block is rewritten from the same results (default: the "
        "README.md one folder above --to's, as docs/claims.md -> README.md; '' for none)",
    )
