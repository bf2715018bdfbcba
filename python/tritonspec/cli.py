"""The ``tritonspec`` command line (``tritonspec check``), its options declared here, in one place.

``python -m tritonspec.cli`` is the same command. With the layer disabled (``TRITONSPEC_DISABLE``) this
module reads the setting before anything imports Triton: Triton's backend discovery would otherwise take
every tritonspec module back out of ``sys.modules`` in the middle of the import.
"""

from __future__ import annotations

import argparse
import platform
import sys

from . import settings

DESCRIPTION = """\
FlagTree-style backend specialization installed into stock Triton, vendor backends, and LLM kernels
for Hugging Face models. "tritonspec check --help" describes the check and its options.

Settings are environment variables (TRITONSPEC_DISABLE, TRITONSPEC_DEFAULT_BACKEND,
TRITONSPEC_ALLOWED_BACKENDS, ...): the README lists them, tritonspec/settings.py declares them."""

CHECK_DESCRIPTION = """\
Validate the spec layer against the installed Triton and print what it found, in tables of at
most 100 columns: the spec providers, the hook points and where they are installed, the kernel
table and its launch configs, and sample kernels compiled offline for every backend target and
run in the Triton interpreter (a subprocess with TRITON_INTERPRET=1). Exit status 0 only when
everything that should apply did; 1 otherwise, or when the layer is disabled (TRITONSPEC_DISABLE).

With --kernels it checks the kernels instead: every kernel of the kernel table, forward and
backward at the layer shapes of Llama-3-8B, Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 (4096
tokens, and decode steps of 1 and 16) in bfloat16 and float16, under each backend's launch
configs, compiled offline for every target the backends declare; each binary's shared memory,
registers and scratch against the target's declared limits. A table per backend, then "kernel
resources: N compiles, M over a target's limits"; exit status 0 only when every compile
succeeded and M is 0. It takes minutes: one process per CPU."""


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tritonspec check``, passed to ``tritonspec.specialization.check.main``."""
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show every spec function of each provider, and each sample kernel on a row of its "
        "own, instead of summaries",
    )
    parser.add_argument(
        "--no-interpreter",
        dest="interpreter",
        action="store_false",
        help="skip running the sample kernels in the Triton interpreter (the slowest part: a "
        "subprocess with TRITON_INTERPRET=1); the offline compiles still run",
    )
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="check the kernel table's kernels against every backend target's resource limits instead",
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tritonspec", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    check = sub.add_parser(
        "check",
        help="validate the spec layer against the installed Triton (exit status 0: all good)",
        description=CHECK_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_check_arguments(check)
    return p


def _disabled() -> int:
    """``tritonspec check`` with the layer disabled: say so without importing Triton (see the module's doc)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        triton_version = version("triton")
    except PackageNotFoundError:
        triton_version = "not installed"
    print(f"tritonspec check: triton {triton_version}, python {platform.python_version()}")
    print(f"hooks are disabled ({settings.DISABLE.shown()}): nothing to check")
    return 1


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.command == "check":
        if settings.DISABLE.get():
            return _disabled()
        from .specialization.check import main as check

        return check(verbose=args.verbose, interpreter=args.interpreter, kernels=args.kernels)
    return 2


if __name__ == "__main__":
    sys.exit(main())
