"""The ``tritonspec`` command line."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tritonspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="validate hook points, spec providers and sample kernels (exit 0 = all good)")
    args = parser.parse_args(argv)
    if args.command == "check":
        from .check import main as check
        return check()
    return 2


if __name__ == "__main__":
    sys.exit(main())
