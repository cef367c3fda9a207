"""Reading DeepSpeed configs: the ``fp16``/``bf16`` blocks as a jaxmp policy and loss scale.

:func:`from_deepspeed_config` returns jaxmp objects with the behaviour of
DeepSpeed's (the differences from DeepSpeed's own scaler are listed in the
docs and in its docstring). The reader refuses what DeepSpeed refuses:
duplicate keys, and keys inside ``fp16``/``bf16`` that DeepSpeed does not
know. ``jaxmp convert`` (``_src/codegen.py``) builds on the same reader.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import warnings
from typing import Any, Callable

import numpy as np

from jaxmp._src.loss_scale import (
    INT32_MAX,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import (
    caller_stacklevel, check_bool, check_number, listing)

# DeepSpeed's defaults for the fp16 block (its precision config).
DEEPSPEED_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}

# The keys that DeepSpeed accepts inside fp16/bf16 (it refuses any other),
# mapped to what jaxmp does with them: None for a key jaxmp reads, else the
# advice printed by `jaxmp convert` when the block is enabled.
FP16_KEYS: dict[str, str | None] = {
    "enabled": None,
    **{key: None for key in DEEPSPEED_FP16_DEFAULTS},
    "auto_cast": "the policy casts inputs: call policy.cast_to_compute on the "
    "batch inside the loss",
    "fp16_master_weights_and_grads": "jaxmp keeps float32 master params "
    "(p=f32); a policy with param_dtype float16 stores them in float16",
}
BF16_KEYS: dict[str, str | None] = {
    "enabled": None,
    "immediate_grad_update": "no jaxmp equivalent: optax applies each update "
    "when it is computed",
    "check_grad_overflow": "jaxmp.loss_scaling always checks the gradients "
    "and skips non-finite steps",
    "bf16_master_weights_and_grads": "jaxmp keeps float32 master params "
    "(p=f32); a policy with param_dtype bfloat16 stores them in bfloat16",
    "bf16_optimizer_states": "choose the optimizer state dtype in optax, e.g. "
    "optax.adamw(..., mu_dtype=jnp.bfloat16)",
}

# The top-level keys whose misspelling would silently give float32.
_PRECISION_BLOCKS = ("fp16", "bf16", "bfloat16")

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # 2**-126

_OWNER = "DeepSpeed config"


class _ConfigError(ValueError):
  pass


def suggestion(key: str, known: Any) -> str:
  """`` Did you mean 'x'?`` for the known key closest to ``key``, or ``""``."""
  lowered = {k.lower(): k for k in known}
  match = difflib.get_close_matches(str(key).lower(), lowered, n=1, cutoff=0.75)
  return f" Did you mean '{lowered[match[0]]}'?" if match else ""


def checked(check: Callable[..., Any], name: str, value: Any, *,
            owner: str = _OWNER, **kwargs: Any) -> Any:
  """Runs a validator of ``_src/validation.py`` on a value read from a config.

  Everything wrong inside a config raises ``ValueError`` (as ``json`` and
  DeepSpeed do), with the validator's wording; ``TypeError`` is kept for a
  ``config`` argument that is not a config at all.
  """
  if isinstance(value, str) and check is check_number:
    kwargs["advice"] = " ".join(
        ["Write a JSON number, without quotes.", kwargs.get("advice", "")]).strip()
  try:
    return check(owner, name, value, **kwargs)
  except TypeError as e:
    raise _ConfigError(str(e)) from None


# ---------------------------------------------------------------------------
# Reading the config.


def _to_strict_json(text: str) -> str:
  """Removes comments and trailing commas that lie outside JSON strings.

  ``//`` and ``/* */`` comments, and a comma that follows a value and comes
  just before ``}`` or ``]`` (possibly with whitespace or comments between),
  as many published configs carry. Line numbers are kept, so JSON errors
  point at the right line; a comma that follows another comma or an opening
  bracket is left for the JSON parser to report.
  """
  out: list[str] = []
  i, n = 0, len(text)
  in_string = False
  pending_comma = -1  # index in `out` of a comma that may be trailing
  last = ""  # the last significant character outside strings and comments
  while i < n:
    c = text[i]
    if in_string:
      out.append(c)
      if c == "\\" and i + 1 < n:
        out.append(text[i + 1])
        i += 2
        continue
      if c == '"':
        in_string = False
        last = '"'
      i += 1
    elif text.startswith("//", i):
      end = text.find("\n", i)
      i = n if end < 0 else end  # keep the newline, so line numbers hold
    elif text.startswith("/*", i):
      end = text.find("*/", i + 2)
      if end < 0:
        raise _ConfigError(
            "unterminated /* comment in the DeepSpeed config: close it with */")
      # Keep the newlines of the comment, so JSON error line numbers hold.
      out.append("\n" * text.count("\n", i, end) or " ")
      i = end + 2
    elif c.isspace():
      out.append(c)
      i += 1
    else:
      if c in "}]" and pending_comma >= 0:
        out[pending_comma] = " "  # a trailing comma: drop it, keep the column
      pending_comma = -1
      if c == ",":
        if last not in ",{[":
          pending_comma = len(out)
      elif c == '"':
        in_string = True
      out.append(c)
      last = c
      i += 1
  return "".join(out)


class _DuplicateKey(Exception):
  pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  """A ``json`` object hook that refuses a key given twice, as DeepSpeed does."""
  config: dict[str, Any] = {}
  for key, value in pairs:
    if key in config:
      raise _DuplicateKey(key, [k for k, _ in pairs])
    config[key] = value
  return config


def parse_deepspeed_json(text: str, source: str,
                         what: str = "a DeepSpeed config") -> dict[str, Any]:
  """Parses the text of a DeepSpeed config (comments, trailing commas, a BOM).

  Args:
    text: the JSON text.
    source: how the text is named in errors, e.g. ``"standard input"``.
    what: what the text should hold, for errors.

  Returns:
    The config dict.

  Raises:
    ValueError: if the text is not a JSON object, holds a key twice in one
      object, or is nested too deeply to parse.
  """
  text = text.removeprefix("\ufeff")
  try:
    config = json.loads(_to_strict_json(text), object_pairs_hook=_refuse_duplicate_keys)
  except json.JSONDecodeError as e:
    raise _ConfigError(
        f"{source} is not valid JSON: {e.msg} at line {e.lineno}, column "
        f"{e.colno}"
    ) from None
  except _DuplicateKey as e:
    key, keys = e.args
    raise _ConfigError(
        f"{source} gives the key {key!r} twice in one object (the object with "
        f"the keys {', '.join(map(repr, dict.fromkeys(keys)))}); JSON keeps "
        "only the last one, and DeepSpeed refuses duplicate keys. Keep one of "
        "them."
    ) from None
  except RecursionError:
    raise _ConfigError(
        f"{source} is nested too deeply to parse; {what} is an object a few "
        "levels deep: check that this is the right file"
    ) from None
  if not isinstance(config, dict):
    raise _ConfigError(
        f"{source} must hold a JSON object ({what}), got a "
        f"{type(config).__name__}"
    )
  return config


def load_deepspeed_config(config: Any, what: str = "a DeepSpeed config") -> dict[str, Any]:
  """Returns a DeepSpeed config as a dict, from a dict, a JSON string or a path.

  JSON text may carry ``//`` and ``/* */`` comments and trailing commas
  outside strings, and a byte-order mark, as many published configs do. A key
  given twice in one object is refused, as DeepSpeed refuses it.

  Args:
    config: a dict, JSON text (a string that starts with a byte-order mark,
      ``{``, ``[`` or a comment, or spans several lines), or a path to a file.
    what: what ``config`` holds, for errors.

  Returns:
    The config dict (a dict passed in is returned as is).

  Raises:
    ValueError: if the file is missing or unreadable, or the text is not a
      JSON object or holds a duplicate key.
    TypeError: for any other kind of ``config``.

  Example:
    >>> from jaxmp._src.deepspeed import load_deepspeed_config
    >>> load_deepspeed_config('{"fp16": {"enabled": true,}  // fp16 on\\n}')
    {'fp16': {'enabled': True}}
  """
  if isinstance(config, dict):
    return config
  if isinstance(config, (bytes, bytearray)):
    try:
      config = bytes(config).decode("utf-8")
    except UnicodeDecodeError as e:
      raise _ConfigError(f"the bytes of {what} are not UTF-8: {e}") from None
  if isinstance(config, str) and (
      config.startswith("\ufeff")
      or "\n" in config
      or config.lstrip().startswith(("{", "[", "//", "/*"))
  ):
    return parse_deepspeed_json(config, "the JSON string", what)
  if isinstance(config, (str, os.PathLike)):
    path = os.fspath(config)
    try:
      with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    except FileNotFoundError:
      raise _ConfigError(
          f"no such file: {path!r}; pass a dict, a JSON string or the path of "
          f"a file that holds {what}"
      ) from None
    except (OSError, UnicodeDecodeError) as e:
      raise _ConfigError(f"cannot read {path!r}: {e}") from None
    return parse_deepspeed_json(text, repr(path), what)
  raise TypeError(
      f"from_deepspeed_config expects a dict, a JSON string or a path for {what}, "
      f"got a {type(config).__name__}."
  )


# ---------------------------------------------------------------------------
# Validating the fp16 / bf16 blocks.


def _block(config: dict[str, Any], name: str, known: dict[str, str | None]) -> dict[str, Any]:
  block = config.get(name, {})
  if not isinstance(block, dict):
    raise _ConfigError(
        f"DeepSpeed config: '{name}' must be an object such as "
        f'{{"enabled": true}}, got {block!r}'
    )
  for key in block:
    if key not in known:
      raise _ConfigError(
          f"DeepSpeed config: {name}.{key} is not a key of the {name} block, "
          f"and DeepSpeed refuses it too.{suggestion(key, known)} The keys of "
          f"{name} are: {', '.join(known)}."
      )
  return block


def _enabled(block: dict[str, Any], name: str) -> bool:
  value = block.get("enabled", False)
  if value == "auto":
    warnings.warn(
        f'DeepSpeed config: {name}.enabled is "auto" (the Hugging Face '
        "Trainer fills it in from --fp16/--bf16); read as DeepSpeed's default, "
        "false. Pass the Trainer's arguments to resolve it as the Trainer "
        "does (training_args=..., or `jaxmp convert --training-args "
        f"args.json`, --bf16, --fp16), or set {name}.enabled to true or false.",
        UserWarning,
        stacklevel=4,
    )
    return False
  return checked(check_bool, f"{name}.enabled", value,
                 advice="Write true or false, without quotes.")


def _setting(block: dict[str, Any], key: str) -> Any:
  """The value of an fp16 key, with DeepSpeed's default where absent or "auto"."""
  value = block.get(key, "auto")
  return DEEPSPEED_FP16_DEFAULTS[key] if value == "auto" or value is None else value


@dataclasses.dataclass(frozen=True)
class _Precision:
  policy: Policy
  loss_scale: LossScale
  mode: str  # "fp16-dynamic", "fp16-static", "bf16" or "float32"
  ignored: tuple[tuple[str, str], ...]  # (key, advice) inside fp16/bf16


def _warn_misspelt_blocks(config: dict[str, Any]) -> None:
  for key in config:
    if key in _PRECISION_BLOCKS:
      continue
    hint = suggestion(key, _PRECISION_BLOCKS)
    if hint:
      warnings.warn(
          f"DeepSpeed config: the key {key!r} is not read (DeepSpeed ignores "
          f"it too).{hint} Without an fp16 or bf16 block the run is float32.",
          UserWarning,
          stacklevel=4,
      )


def _precision(config: dict[str, Any]) -> _Precision:
  _warn_misspelt_blocks(config)
  amp = config.get("amp")
  if isinstance(amp, dict) and _enabled(amp, "amp"):
    raise _ConfigError(
        "DeepSpeed config: amp.enabled is true: DeepSpeed hands mixed "
        f"precision to NVIDIA apex (opt_level {amp.get('opt_level', 'O1')!r}). "
        f"{_ONE_MODE} Replace the amp block with \"fp16\": {{\"enabled\": true}} "
        "(mixed_float16 with a dynamic loss scale) or, where the hardware runs "
        "bfloat16, \"bf16\": {\"enabled\": true} (mixed_bfloat16)."
    )
  fp16 = _block(config, "fp16", FP16_KEYS)
  bf16_name = "bf16" if "bf16" in config or "bfloat16" not in config else "bfloat16"
  bf16 = _block(config, bf16_name, BF16_KEYS)
  fp16_on = _enabled(fp16, "fp16")
  bf16_on = _enabled(bf16, bf16_name)
  ignored = []
  if fp16_on:
    ignored += [(f"fp16.{k}", FP16_KEYS[k]) for k in fp16 if FP16_KEYS[k]]
  if bf16_on:
    ignored += [(f"{bf16_name}.{k}", BF16_KEYS[k]) for k in bf16 if BF16_KEYS[k]]
  if fp16_on and bf16_on:
    raise _ConfigError(
        f"DeepSpeed config: fp16 and {bf16_name} are both enabled, which "
        "DeepSpeed does not support either; keep one (bf16 needs no loss "
        "scaling where the hardware runs it, see `jaxmp doctor`)"
    )
  if bf16_on:
    return _Precision(
        get_policy("mixed_bfloat16"), NoOpLossScale(), "bf16", tuple(ignored)
    )
  if not fp16_on:
    return _Precision(get_policy("float32"), NoOpLossScale(), "float32", ())

  policy = get_policy("mixed_float16")
  static = checked(
      check_number, "fp16.loss_scale", _setting(fp16, "loss_scale"),
      minimum=0, maximum=_FLOAT32_MAX,
      advice="Use 0 (dynamic loss scaling) or a positive static scale.")
  if 0 < static < _FLOAT32_TINY:
    raise _ConfigError(
        f"DeepSpeed config: fp16.loss_scale must be 0 or at least 2**-126, the "
        f"smallest normal float32, got {static!r}; smaller scales are flushed "
        "to 0 and every step would be skipped. Use 0 (dynamic loss scaling) "
        "or a positive static scale."
    )
  if static > 0:
    return _Precision(policy, StaticLossScale(static), "fp16-static", tuple(ignored))

  power = checked(
      check_number, "fp16.initial_scale_power", _setting(fp16, "initial_scale_power"),
      integer=True, minimum=-126, maximum=127,
      advice="The scale 2**power is a float32; 16 is the usual value.")
  window = checked(
      check_number, "fp16.loss_scale_window", _setting(fp16, "loss_scale_window"),
      integer=True, minimum=1, maximum=INT32_MAX,
      advice="1000 is DeepSpeed's default.")
  hysteresis = checked(
      check_number, "fp16.hysteresis", _setting(fp16, "hysteresis"),
      integer=True, minimum=1, maximum=INT32_MAX,
      advice="1 backs off on every overflow; DeepSpeed's default is 2.")
  consecutive = checked(
      check_bool, "fp16.consecutive_hysteresis",
      _setting(fp16, "consecutive_hysteresis"),
      advice="Write true or false, without quotes.")
  min_scale = checked(
      check_number, "fp16.min_loss_scale", _setting(fp16, "min_loss_scale"),
      minimum=0, exclusive_minimum=True,
      advice="DeepSpeed's default is 1.")
  initial = 2.0**power
  if min_scale > initial:
    raise _ConfigError(
        f"DeepSpeed config: fp16.min_loss_scale ({min_scale!r}) is above the "
        f"initial scale 2**{power} = {initial!r}; lower min_loss_scale or raise "
        "initial_scale_power"
    )
  loss_scale = DynamicLossScale(
      initial,
      period=window,
      factor=2.0,
      min_loss_scale=min_scale,
      hysteresis=hysteresis,
      consecutive_hysteresis=consecutive,
  )
  return _Precision(policy, loss_scale, "fp16-dynamic", tuple(ignored))


# ---------------------------------------------------------------------------
# The Hugging Face Trainer's arguments, which fill in the config's "auto" values.

# The TrainingArguments that decide what "auto" becomes, with the Trainer's
# defaults (a run that does not give one uses its default).
TRAINER_DEFAULTS: dict[str, Any] = {
    "fp16": False,
    "bf16": False,
    "fp16_full_eval": False,
    "bf16_full_eval": False,
    "half_precision_backend": "auto",
    "max_grad_norm": 1.0,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "weight_decay": 0.0,
}
# Read for the apex refusal only; the Trainer's older name of the backend.
_TRAINER_ALSO_READ = {"fp16_backend": "auto", "fp16_opt_level": "O1"}
_TRAINER = "Trainer arguments"
_ONE_MODE = (
    "jaxmp has one mixed-precision mode, DeepSpeed's fp16/bf16 one: float32 "
    "master params, float16 or bfloat16 compute, and a dynamic loss scale "
    "for float16; there is no apex opt_level to choose."
)


def _trainer_bool(text: str) -> bool:
  """A bool flag's value, as the Trainer's argument parser reads it."""
  if text.lower() in ("yes", "true", "t", "y", "1"):
    return True
  if text.lower() in ("no", "false", "f", "n", "0"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
  """Adds a flag for each Trainer argument that is read, typed by its default.

  The one parser of the Trainer's command line, for ``training_args=[...]``
  and for ``jaxmp convert``: every key the dict form reads is a flag.
  """
  for name, default in {**TRAINER_DEFAULTS, **_TRAINER_ALSO_READ}.items():
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    if isinstance(default, bool):
      parser.add_argument(*names, dest=name, nargs="?", const=True, default=None,
                          type=_trainer_bool, metavar="BOOL",
                          help=f"the Trainer's --{name} (default {default})")
    else:
      parser.add_argument(*names, dest=name, type=type(default), default=None,
                          metavar="VALUE", help=f"the Trainer's --{name} (default {default})")


def trainer_flags(argv: list[str] | tuple[str, ...]) -> dict[str, Any]:
  """The Trainer's arguments read from its command line.

  A flag that is not read warns, by name; one spelt close to a flag that is
  read is refused.
  """
  parser = argparse.ArgumentParser(
      prog="training_args", add_help=False, allow_abbrev=False, exit_on_error=False)
  add_trainer_flags(parser)
  flags = [f"--{name}" for name in {**TRAINER_DEFAULTS, **_TRAINER_ALSO_READ}]
  advice = ("Write the flags as the Trainer's command line takes them, each a "
            "string: ['--bf16', '--max_grad_norm', '1.0', "
            "'--gradient_accumulation_steps', '4'].")
  if not all(isinstance(token, str) for token in argv):
    raise _ConfigError(f"{_TRAINER}: the command line {list(argv)!r} holds a "
                       f"value that is not a string. {advice}")
  try:
    namespace, rest = parser.parse_known_args(list(argv))
  except argparse.ArgumentError as e:
    flag = (e.argument_name or "").split("/")[0]
    raise _ConfigError(f"{_TRAINER}: {flag}: {e.message}. {advice}") from None
  unread = [token.split("=")[0] for token in rest if token.startswith("-")]
  for name in unread:
    hint = suggestion(name, flags)
    if hint:
      raise _ConfigError(
          f"{_TRAINER}: the flag {name} is not one the conversion reads "
          f"({', '.join(flags)}).{hint}")
  if unread:
    warnings.warn(
        f"{_TRAINER}: {listing(unread)} not read: they do not decide "
        f"precision, clipping, accumulation or the optimizer's settings. The "
        f"flags read are {', '.join(flags)}.", UserWarning,
        stacklevel=caller_stacklevel())
  return {key: value for key, value in vars(namespace).items() if value is not None}


def _trainer_values(training_args: Any) -> dict[str, Any]:
  """The Trainer's arguments that fill in "auto", checked, defaults included."""
  if isinstance(training_args, (list, tuple)):
    given = trainer_flags(training_args)
  else:
    given = load_deepspeed_config(training_args, "the Trainer's arguments")
  if "fp16_backend" in given and "half_precision_backend" not in given:
    given = {**given, "half_precision_backend": given["fp16_backend"]}
  args = {**TRAINER_DEFAULTS, **{k: v for k, v in given.items() if k in TRAINER_DEFAULTS}}
  for key, default in TRAINER_DEFAULTS.items():
    if isinstance(default, bool):
      args[key] = checked(check_bool, key, args[key], owner=_TRAINER,
                          advice="Write true or false, without quotes.")
    elif not isinstance(default, str):
      args[key] = checked(
          check_number, key, args[key], owner=_TRAINER,
          integer=isinstance(default, int), minimum=1 if isinstance(default, int) else 0,
          maximum=1 if key.startswith("adam_beta") else None,
          exclusive_maximum=key.startswith("adam_beta"),
          advice=f"The Trainer's default is {default!r}.")
  if args["fp16"] and args["bf16"]:
    raise _ConfigError(
        f"{_TRAINER}: fp16 and bf16 are both true, which the Trainer refuses "
        "too; keep one (bf16 needs no loss scaling where the hardware runs "
        "it, see `jaxmp doctor`).")
  if (args["fp16"] or args["fp16_full_eval"]) and args["half_precision_backend"] == "apex":
    raise _ConfigError(
        f"{_TRAINER}: fp16 with half_precision_backend 'apex' makes the "
        "Trainer fill in amp.enabled (NVIDIA apex, opt_level from "
        f"fp16_opt_level {given.get('fp16_opt_level', 'O1')!r}) instead of "
        f"fp16.enabled. {_ONE_MODE} Drop the apex backend (the Trainer's "
        "default then fills in fp16.enabled: mixed_float16 with a dynamic "
        "loss scale).")
  return args


def with_trainer_args(config: dict[str, Any], training_args: Any) -> dict[str, Any]:
  """``config`` with its "auto" values filled in as the Hugging Face Trainer does.

  The Trainer replaces each "auto" with its argument (``fp16.enabled`` with
  ``fp16`` or ``fp16_full_eval``, ``bf16.enabled`` with ``bf16`` or
  ``bf16_full_eval``, ``gradient_clipping`` with ``max_grad_norm``,
  ``gradient_accumulation_steps``, the optimizer's ``lr``, ``betas``,
  ``eps`` and ``weight_decay``), refuses a value that differs from its
  argument, and adds an enabled fp16 or bf16 block that the config lacks.
  A ``gradient_accumulation_steps`` that the config lacks is the Trainer's.
  """
  args = _trainer_values(training_args)
  config = copy.deepcopy(config)
  fp16 = args["fp16"] or args["fp16_full_eval"]
  bf16 = args["bf16"] or args["bf16_full_eval"]
  for name, on in (("fp16", fp16), ("bf16", bf16)):
    if on and name not in config:
      config[name] = {"enabled": True}
  config.setdefault("gradient_accumulation_steps", args["gradient_accumulation_steps"])
  amp = config.get("amp")
  if isinstance(amp, dict) and amp.get("enabled") == "auto":
    amp["enabled"] = False  # the Trainer's apex backend is refused above
  fills = [
      ("fp16.enabled", fp16, "fp16"),
      ("bf16.enabled", bf16, "bf16"),
      ("gradient_clipping", args["max_grad_norm"], "max_grad_norm"),
      ("gradient_accumulation_steps", args["gradient_accumulation_steps"],
       "gradient_accumulation_steps"),
      ("optimizer.params.lr", args["learning_rate"], "learning_rate"),
      ("optimizer.params.betas", [args["adam_beta1"], args["adam_beta2"]],
       "adam_beta1, adam_beta2"),
      ("optimizer.params.eps", args["adam_epsilon"], "adam_epsilon"),
      ("optimizer.params.weight_decay", args["weight_decay"], "weight_decay"),
  ]
  mismatches = []
  for key, value, name in fills:
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
      node = node.get(parent) if isinstance(node, dict) else None
    if not isinstance(node, dict) or node.get(leaf) is None:
      continue
    if node[leaf] == "auto":
      node[leaf] = value
    elif node[leaf] != value:
      mismatches.append(f"{key} is {json.dumps(node[leaf])} in the config and "
                        f"{name} {value!r} in the Trainer's arguments")
  if mismatches:
    raise _ConfigError(
        f"DeepSpeed config: {listing(mismatches, '; ')}. The Hugging Face "
        "Trainer refuses a config value that differs from its argument. Set "
        'the value to "auto" in the config (it then takes the Trainer\'s), or '
        "give the Trainer the config's value.")
  return config


def from_deepspeed_config(config: Any, *, training_args: Any = None) -> tuple[Policy, LossScale]:
  """Returns the jaxmp policy and loss scale equivalent to a DeepSpeed config.

  Only the ``fp16`` and ``bf16`` blocks are read (``bfloat16`` is accepted as
  the older name of ``bf16``); other keys are ignored here (``jaxmp convert``
  warns about them).

  * ``fp16.enabled`` with ``loss_scale: 0`` gives ``mixed_float16`` and a
    :class:`jaxmp.DynamicLossScale` with ``loss_scale=2**initial_scale_power``,
    ``period=loss_scale_window``, ``factor=2``, ``min_loss_scale``,
    ``hysteresis`` and ``consecutive_hysteresis``; absent or ``"auto"`` values
    take DeepSpeed's defaults (16, 1000, 2, false, 1).
  * ``fp16.enabled`` with ``loss_scale > 0`` gives a
    :class:`jaxmp.StaticLossScale`.
  * ``bf16.enabled`` gives ``mixed_bfloat16`` and :class:`jaxmp.NoOpLossScale`.
  * Neither gives ``float32`` and :class:`jaxmp.NoOpLossScale`. An
    ``enabled: "auto"`` is read as false, with a warning, unless
    ``training_args`` are given; a top-level key that looks like a misspelt
    ``fp16`` or ``bf16`` also warns.
  * ``amp.enabled`` (NVIDIA apex) is refused: jaxmp has no apex mode, and
    the error says which block to write instead.

  With ``training_args``, the Hugging Face Trainer's arguments, the config is
  read as the Trainer hands it to DeepSpeed: each ``"auto"`` takes the
  Trainer's value (``fp16.enabled`` from ``fp16`` or ``fp16_full_eval``,
  ``bf16.enabled`` from ``bf16`` or ``bf16_full_eval``, and, for ``jaxmp
  convert``, ``gradient_clipping`` from ``max_grad_norm``,
  ``gradient_accumulation_steps`` and the optimizer's ``lr``, ``betas``,
  ``eps``, ``weight_decay``); an argument not given takes the Trainer's
  default; a config value that differs from the Trainer's is refused, as
  the Trainer refuses it; and ``--fp16``/``--bf16`` enable a block the
  config lacks. ``fp16`` with ``half_precision_backend="apex"`` is refused
  as ``amp.enabled`` is.

  What DeepSpeed refuses is refused: a key given twice in one object (JSON
  would keep the last one), and a key inside ``fp16``/``bf16`` that DeepSpeed
  does not know (the error suggests the closest one). Values are read as JSON
  types: a number must be a number, not a quoted string.

  The hysteresis budget, the minimum clamp and the overflows at the minimum
  (DeepSpeed's "Current loss scale already at minimum" error, which
  :func:`jaxmp.check_loss_scale` raises) follow DeepSpeed exactly. Two
  differences: DeepSpeed grows the scale on the ``window + 1``-th clean step
  after an overflow (and after the start), jaxmp on the ``window``-th; and
  DeepSpeed has no maximum, while jaxmp stops growing at the largest float32.

  Args:
    config: a dict, a JSON string or the path of a JSON file; ``//`` and
      ``/* */`` comments, trailing commas and a byte-order mark are accepted.
    training_args: the Trainer's ``TrainingArguments``, as a dict (its
      ``to_dict()``), the JSON text its ``to_json_string()`` writes or the
      path of a file holding it, or the command line as a list of strings
      (``["--bf16", "--gradient_accumulation_steps", "4"]``), read by the
      same rules as the dict: a flag for each key read; other flags warn,
      by name. ``None``: the config alone.

  Returns:
    ``(policy, loss_scale)``.

  Raises:
    ValueError: when the file cannot be read or parsed, a key is duplicated
      or unknown, fp16 and bf16 are both enabled, apex AMP is, a value is
      ill-typed or makes no sense (``hysteresis: 0``, ``min_loss_scale``
      above the initial scale, a negative ``loss_scale``), or a config value
      differs from the Trainer's argument.
    TypeError: when ``config`` is not a dict, a string or a path.

  Example:
    >>> import jaxmp
    >>> policy, loss_scale = jaxmp.from_deepspeed_config(
    ...     '{"fp16": {"enabled": true, "loss_scale": 0, // dynamic\\n'
    ...     '          "initial_scale_power": 12, "hysteresis": 2,}}')
    >>> str(policy), float(loss_scale.loss_scale), loss_scale.period
    ('p=f32,c=f16,o=f32', 4096.0, 1000)
    >>> policy, _ = jaxmp.from_deepspeed_config(
    ...     {"bf16": {"enabled": "auto"}}, training_args=["--bf16"])
    >>> str(policy)
    'p=f32,c=bf16,o=f32'
  """
  config = load_deepspeed_config(config)
  if training_args is not None:
    config = with_trainer_args(config, training_args)
  precision = _precision(config)
  return precision.policy, precision.loss_scale
