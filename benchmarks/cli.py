"""One entry point per tool: ``python -m benchmarks.<tool> <subcommand> [options]``.

Each tool's ``__main__`` names its subcommands (module and one line each); ``run`` lists them on
``--help`` without importing any, and hands the rest of the command line to the chosen module's
``main(argv)``, under a program name that reads as the command a user typed. A subcommand writes
into ``$OUT``: unless the caller set it, that is a fresh directory whose files are folded into
``benchmarks/results/<tool>-<card>.json`` afterwards (``benchmarks.results.fold``). ``fold <dir>``
does the same for a directory that came back from another machine.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
from typing import Optional


def run(tool: str, summary: str, subcommands: dict[str, tuple[str, str]], argv: Optional[list[str]] = None) -> int:
    """``subcommands`` maps a name to (module, one-line description)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(tool, summary, subcommands))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name == "fold":
        return fold_command(tool, rest)
    if name not in subcommands:
        print(f"unknown subcommand {name!r}\n\n{usage(tool, summary, subcommands)}", file=sys.stderr)
        return 2
    module = importlib.import_module(subcommands[name][0])
    prog = sys.argv[0]
    sys.argv = [f"python -m benchmarks.{tool} {name}", *rest]  # argparse's prog
    scratch = None if os.environ.get("OUT") else tempfile.mkdtemp(prefix=f"kiln-{tool}-")
    if scratch:
        os.environ["OUT"] = scratch
    try:
        result = module.main(rest)
        if scratch:
            from benchmarks.results import fold

            for path in fold(tool, scratch):
                print(f"runs stored in {path} and {path.with_suffix('.md').name}")
    finally:
        sys.argv[0] = prog
        if scratch:
            del os.environ["OUT"]
            shutil.rmtree(scratch, ignore_errors=True)
    return result if isinstance(result, int) else 0


def fold_command(tool: str, argv: list[str]) -> int:
    from benchmarks.results import fold

    p = argparse.ArgumentParser(prog=f"python -m benchmarks.{tool} fold",
                                description="Store the files a run wrote (e.g. $OUT from a device machine) as runs "
                                            f"of benchmarks/results/{tool}-<card>.json.")
    p.add_argument("directory")
    p.add_argument("--card", default=None, help="for runs whose records name no device (default: this machine's)")
    args = p.parse_args(argv)
    for path in fold(tool, args.directory, card=args.card):
        print(f"runs stored in {path}")
    return 0


def usage(tool: str, summary: str, subcommands: dict[str, tuple[str, str]]) -> str:
    width = max(map(len, subcommands))
    lines = [f"usage: python -m benchmarks.{tool} <subcommand> [options]", "", summary, "",
             "subcommands (each takes --help):"]
    lines += [f"  {name.ljust(width)}  {line}" for name, (_, line) in subcommands.items()]
    lines += [f"  {'fold'.ljust(width)}  store the files of a run made elsewhere (a directory) as runs"]
    return "\n".join(lines)
