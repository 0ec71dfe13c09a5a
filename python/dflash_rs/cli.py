"""The ``dflash-rs`` command line (also ``python -m dflash_rs``)."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from dflash_rs import demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-rs", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo_parser = sub.add_parser(
        "demo", help="admit a few requests, allocate with DFlash lookahead, print block tables"
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
