"""The ``jaxmp`` command line: ``jaxmp doctor``, and ``jaxmp convert``, which
prints the code of a DeepSpeed config as :func:`read_deepspeed_config` reads it.

Each subcommand is an entry of :data:`SUBCOMMANDS`: its help, a function that
adds its arguments and a function that runs it and returns an exit code.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, Callable, Sequence

from jaxmp._src.deepspeed import (
    DeepSpeedRun, add_trainer_flags, load_deepspeed_config, read_deepspeed_config)
from jaxmp._src.hardware import hardware_report
from jaxmp._src.loss_scale import DynamicLossScale, StaticLossScale


def _run_doctor(args: argparse.Namespace) -> int:
  report = hardware_report()
  print(json.dumps(report.as_dict(), indent=2) if args.json else report)
  return 0


def _call(name: str, *args: Any, **kwargs: Any) -> str:
  """``name(args, key=value)`` with the values as Python literals."""
  text = [repr(float(a)) if isinstance(a, float) else a for a in args]
  text += [f"{k}={float(v)!r}" if isinstance(v, float) else f"{k}={v!r}" for k, v in kwargs.items()]
  return f"{name}({', '.join(text)})"


def run_to_code(run: DeepSpeedRun, source: str) -> str:
  """The jaxmp code that builds ``run``: policy, loss scale, optimizer and ``tx``."""
  ls = run.loss_scale
  lines = [f"# jaxmp equivalent of {source}.", "import jaxmp", "import optax", "",
           f'policy = jaxmp.get_policy("{run.preset}")']
  if isinstance(ls, DynamicLossScale):
    lines += [
        "loss_scale = " + _call(
            "jaxmp.DynamicLossScale", float(ls.loss_scale), period=ls.period,
            min_loss_scale=ls.min_loss_scale, hysteresis=ls.hysteresis,
            consecutive_hysteresis=ls.consecutive_hysteresis),
        "# Where the hardware runs bfloat16 (see `jaxmp doctor`), prefer:",
        '#   policy = jaxmp.get_policy("mixed_bfloat16")',
        "#   loss_scale = jaxmp.NoOpLossScale()"]
  elif isinstance(ls, StaticLossScale):
    lines.append("loss_scale = " + _call("jaxmp.StaticLossScale", float(ls.loss_scale)))
  else:
    lines.append("loss_scale = jaxmp.NoOpLossScale()")
  steps = [_call(f"optax.{name}", **kwargs) for name, kwargs in run.optimizer]
  lines += ["", "optimizer = " + (steps[0] if len(steps) == 1 else _call("optax.chain", *steps)),
            "# Wrap the whole optimizer: it then sees unscaled gradients and skips "
            "non-finite steps."]
  clip = {} if run.clip is None else {"clip_global_norm": run.clip}
  if clip:
    lines.append(f"# Clips the unscaled gradients to a global norm of {run.clip}, "
                 "checking them in the same reduction.")
  if run.accumulation > 1:
    lines += [f"# Accumulates {run.accumulation} micro-batches per step; a non-finite "
              "micro-batch skips its whole step.",
              "tx = " + _call("jaxmp.multi_steps", "optimizer", "loss_scale",
                              every_k_schedule=run.accumulation, **clip)]
  else:
    lines.append("tx = " + _call("jaxmp.loss_scaling", "optimizer", "loss_scale", **clip))
  lines += [
      "", f"# In the training step, once per {'micro-batch' if run.accumulation > 1 else 'batch'}:",
      "#   loss, grads = jaxmp.scaled_value_and_grad(loss_fn, "
      "jaxmp.get_loss_scale(opt_state))(params, batch)",
      "#   updates, opt_state = tx.update(grads, opt_state, params)",
      "#   params = optax.apply_updates(params, updates)",
      "# with loss_fn running the model on policy.cast_to_compute(params) and",
      "# returning a float32 loss. Every N steps, outside jit: jaxmp.check_loss_scale(opt_state)"]
  return "\n".join(lines) + "\n"


def _add_convert(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
      "config", metavar="CONFIG.json",
      help="a DeepSpeed config file, or - to read it from standard input "
      "(JSON; // and /* */ comments and trailing commas are accepted)")
  parser.add_argument(
      "--training-args", metavar="ARGS.json",
      help="the Hugging Face Trainer's arguments (what TrainingArguments."
      "to_json_string() writes): the config's \"auto\" values are filled in from "
      "them, as the Trainer does; the flags below override them")
  add_trainer_flags(parser)


def _run_convert(args: argparse.Namespace) -> int:
  flags = {name: value for name, value in vars(args).items()
           if name not in ("command", "config", "training_args") and value is not None}
  source = ("the DeepSpeed config read from standard input" if args.config == "-"
            else f"the DeepSpeed config {args.config}")
  if args.training_args is not None:
    source += f" with the Trainer's arguments {args.training_args}"
  if flags:
    source += " and " if args.training_args else " with "
    source += " ".join(f"--{k}" if v is True else f"--{k} {v}" for k, v in flags.items())
  try:
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      config = args.config
      if config == "-":
        config = load_deepspeed_config(sys.stdin.read(), source="standard input")
      training_args = None
      if args.training_args is not None or flags:
        training_args = {**load_deepspeed_config(
            args.training_args or {}, "the Trainer's arguments"), **flags}
      run = read_deepspeed_config(config, training_args)
  except (ValueError, TypeError) as e:
    print(f"jaxmp convert: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  for warning in caught:
    print(f"jaxmp convert: warning: {' '.join(str(warning.message).split())}", file=sys.stderr)
  for key, advice in run.left_out:
    print(f"jaxmp convert: warning: '{key}' is not converted: {advice}", file=sys.stderr)
  sys.stdout.write(run_to_code(run, source))
  return 0


# name -> (help, add_arguments, run)
SUBCOMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int]]] = {
    "doctor": ("report the hardware, its native low-precision dtypes and the "
               "recommended policy and loss scale",
               lambda parser: parser.add_argument(
                   "--json", action="store_true", help="print the report as JSON"),
               _run_doctor),
    "convert": ("print the jaxmp code equivalent to a DeepSpeed config "
                "(fp16/bf16, optimizer, clipping, accumulation)", _add_convert, _run_convert),
}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="jaxmp", description="Mixed-precision training for JAX.")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
    add_arguments(sub.add_parser(name, help=help_text, description=help_text))
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  args = build_parser().parse_args(argv)
  return SUBCOMMANDS[args.command][2](args)


if __name__ == "__main__":
  sys.exit(main())
