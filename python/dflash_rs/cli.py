"""The ``dflash-rs`` command line (also ``python -m dflash_rs``).

``dflash-rs simulate`` is the main job: a serving simulation on the real scheduler, DFlash
kernel and a paged KV cache that proves KV integrity. ``dflash-rs demo`` shows block tables.
``dflash-rs bench`` times the scheduler per step, optionally next to vLLM's.
``dflash-rs soak`` pushes a million requests through the scheduler alone and checks for leaks.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from dflash_rs import demo
from dflash_rs.bench import cli as bench
from dflash_rs.sim import cli as simulate
from dflash_rs.sim import soak


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-rs", description=__doc__)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    simulate_parser = sub.add_parser(
        "simulate",
        help="serving simulation that proves KV integrity on a real paged KV cache "
        "(the default command)",
        description=simulate.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    simulate.add_arguments(simulate_parser)
    simulate_parser.set_defaults(run=simulate.run)
    demo_parser = sub.add_parser(
        "demo", help="admit a few requests, allocate with DFlash lookahead, print block tables"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    bench_parser = sub.add_parser(
        "bench",
        help="per-step scheduler benchmark, optionally side by side with vLLM's scheduler",
        description=bench.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(run=bench.run)
    soak_parser = sub.add_parser(
        "soak",
        help="push many requests through the scheduler alone under memory pressure; checks "
        "ownership, leaks and RSS growth",
        description=soak.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    soak.add_arguments(soak_parser)
    soak_parser.set_defaults(run=soak.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv or ["simulate"])
    if args.command is None:  # options only, e.g. ``dflash-rs --seed 3``: not accepted
        build_parser().error("a command is required (simulate, demo, bench or soak)")
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
