"""The ``dflash-rs`` command line (also ``python -m dflash_rs``).

``dflash-rs simulate`` is the main job: a serving simulation on the real scheduler, DFlash
kernel and a paged KV cache that proves KV integrity. ``dflash-rs demo`` shows block tables.
``dflash-rs bench`` times the scheduler per step, optionally next to vLLM's.
``dflash-rs soak`` pushes a million requests through the scheduler alone and checks for leaks.

A bad option value, or options that contradict each other, is a usage error (exit status 2)
found before anything runs.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType
from typing import Dict, Optional, Sequence, Tuple

from dflash_rs import demo
from dflash_rs._cli_types import HelpFormatter, check_or_exit
from dflash_rs.bench import cli as bench
from dflash_rs.sim import cli as simulate
from dflash_rs.soak import cli as soak

#: Each subcommand's module: ``add_arguments(parser)``, ``check_args(args)``, ``run(args)``.
COMMANDS: Dict[str, ModuleType] = {
    "simulate": simulate,
    "demo": demo,
    "bench": bench,
    "soak": soak,
}
_HELP = {
    "simulate": "serving simulation that proves KV integrity on a real paged KV cache "
    "(the default command)",
    "demo": "admit a few requests, allocate with DFlash lookahead, print block tables",
    "bench": "per-step scheduler benchmark, optionally side by side with vLLM's scheduler",
    "soak": "push many requests through the scheduler alone under memory pressure; checks "
    "ownership, leaks and RSS growth",
}


def build_parser() -> argparse.ArgumentParser:
    return _build_parsers()[0]


def _build_parsers() -> Tuple[argparse.ArgumentParser, Dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each subcommand's parser by name."""
    parser = argparse.ArgumentParser(prog="dflash-rs", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    command_parsers = {}
    for name, module in COMMANDS.items():
        command_parsers[name] = sub.add_parser(
            name, help=_HELP[name], description=module.__doc__, formatter_class=HelpFormatter
        )
        module.add_arguments(command_parsers[name])
    return parser, command_parsers


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, command_parsers = _build_parsers()
    args = parser.parse_args(argv or ["simulate"])
    if args.command is None:  # options only, e.g. ``dflash-rs --seed 3``: not accepted
        parser.error("a command is required (simulate, demo, bench or soak)")
    module = COMMANDS[args.command]
    check_or_exit(command_parsers[args.command], module.check_args, args)
    return int(module.run(args))


if __name__ == "__main__":
    sys.exit(main())
