"""The ``jaxmp`` command line: ``jaxmp doctor`` and friends.

Each subcommand registers itself in :data:`SUBCOMMANDS` with a function that
adds its arguments and a function that runs it and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence


def _add_doctor(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "--json", action="store_true", help="print the report as JSON"
  )


def _run_doctor(args: argparse.Namespace) -> int:
  from jaxmp.hardware import hardware_report  # pylint: disable=g-import-not-at-top

  report = hardware_report()
  if args.json:
    print(json.dumps(report.as_dict(), indent=2))
  else:
    print(report)
  return 0


# name -> (help, add_arguments, run)
SUBCOMMANDS: dict[
    str,
    tuple[str, Callable[[argparse.ArgumentParser], None],
          Callable[[argparse.Namespace], int]],
] = {
    "doctor": (
        "report the hardware, its native low-precision dtypes and the "
        "recommended policy and loss scale",
        _add_doctor,
        _run_doctor,
    ),
}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="jaxmp", description="Mixed-precision training for JAX."
  )
  sub = parser.add_subparsers(dest="command", metavar="COMMAND")
  sub.required = True
  for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
    add_arguments(sub.add_parser(name, help=help_text, description=help_text))
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  args = build_parser().parse_args(argv)
  _, _, run = SUBCOMMANDS[args.command]
  return run(args)


if __name__ == "__main__":
  sys.exit(main())
