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
  from jaxmp._src.hardware import hardware_report  # pylint: disable=g-import-not-at-top

  report = hardware_report()
  if args.json:
    print(json.dumps(report.as_dict(), indent=2))
  else:
    print(report)
  return 0


def _add_convert(parser: argparse.ArgumentParser) -> None:
  from jaxmp._src.deepspeed import add_trainer_flags  # pylint: disable=g-import-not-at-top

  parser.add_argument(
      "config", metavar="CONFIG.json",
      help="a DeepSpeed config file, or - to read it from standard input "
      "(JSON; // and /* */ comments and trailing commas are accepted)",
  )
  parser.add_argument(
      "--training-args", metavar="ARGS.json",
      help="the Hugging Face Trainer's arguments (what "
      "TrainingArguments.to_json_string() writes): the config's \"auto\" "
      "values are filled in from them, as the Trainer does; the flags below "
      "override them",
  )
  add_trainer_flags(parser)


def _run_convert(args: argparse.Namespace) -> int:
  import warnings  # pylint: disable=g-import-not-at-top

  from jaxmp._src.codegen import deepspeed_config_to_code  # pylint: disable=g-import-not-at-top
  from jaxmp._src.deepspeed import (  # pylint: disable=g-import-not-at-top
      load_deepspeed_config,
      parse_deepspeed_json,
  )

  def one_line(text: str) -> str:
    return " ".join(str(text).split())

  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      if args.config == "-":
        config = parse_deepspeed_json(sys.stdin.read(), "standard input")
        source = "the DeepSpeed config read from standard input"
      else:
        config, source = args.config, f"the DeepSpeed config {args.config}"
      training_args = None
      if args.training_args is not None:
        training_args = load_deepspeed_config(
            args.training_args, "the Trainer's arguments")
        source += f" with the Trainer's arguments {args.training_args}"
      flags = {name: value for name, value in vars(args).items()
               if name not in ("command", "config", "training_args")
               and value is not None}
      if flags:
        training_args = {**(training_args or {}), **flags}
        source += " and " if args.training_args else " with "
        source += " ".join(f"--{name}" if value is True else f"--{name} {value}"
                           for name, value in flags.items())
      code, left_out = deepspeed_config_to_code(
          config, source=source, training_args=training_args)
  except (ValueError, TypeError) as e:
    print(f"jaxmp convert: error: {one_line(e)}", file=sys.stderr)
    return 2
  for warning in caught:
    print(f"jaxmp convert: warning: {one_line(warning.message)}", file=sys.stderr)
  for key, advice in left_out:
    print(f"jaxmp convert: warning: '{key}' is not converted: {advice}",
          file=sys.stderr)
  sys.stdout.write(code)
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
    "convert": (
        "print the jaxmp code equivalent to a DeepSpeed config "
        "(fp16/bf16, optimizer, clipping, accumulation)",
        _add_convert,
        _run_convert,
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
