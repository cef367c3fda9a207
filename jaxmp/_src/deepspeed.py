"""Reading a DeepSpeed config, and the Hugging Face Trainer's arguments, once.

:func:`read_deepspeed_config` parses and checks the whole config into one
:class:`DeepSpeedRun`; :func:`from_deepspeed_config` returns its policy and
loss scale, and ``jaxmp convert`` (``_src/cli.py``) prints all of it as code.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import json
import os
import re
import warnings
from typing import Any

import numpy as np

from jaxmp._src.loss_scale import (
    INT32_MAX, DynamicLossScale, LossScale, NoOpLossScale, StaticLossScale)
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import caller_stacklevel, check_bool, check_number, listing

_OWNER = "DeepSpeed config"
_TRAINER = "Trainer arguments"
_BOOL = "Write true or false, without quotes."

# DeepSpeed's fp16 loss-scale keys: its default, and how jaxmp checks a value.
_FP16_SETTINGS: dict[str, tuple[Any, dict[str, Any]]] = {
    "loss_scale": (0, dict(minimum=0, maximum=float(np.finfo(np.float32).max),
                           advice="Use 0 (dynamic loss scaling) or a positive static scale.")),
    "initial_scale_power": (16, dict(
        integer=True, minimum=-126, maximum=127,
        advice="The scale 2**power is a float32; 16 is the usual value.")),
    "loss_scale_window": (1000, dict(integer=True, minimum=1, maximum=INT32_MAX,
                                     advice="1000 is DeepSpeed's default.")),
    "hysteresis": (2, dict(integer=True, minimum=1, maximum=INT32_MAX,
                           advice="1 backs off on every overflow; DeepSpeed's default is 2.")),
    "consecutive_hysteresis": (False, {}),
    "min_loss_scale": (1, dict(minimum=0, exclusive_minimum=True,
                               advice="DeepSpeed's default is 1.")),
}
DEEPSPEED_FP16_DEFAULTS = {key: default for key, (default, _) in _FP16_SETTINGS.items()}

# The keys DeepSpeed accepts inside fp16/bf16 (it refuses others); for a key
# jaxmp does not read, what to do instead (noted when the block is enabled).
FP16_KEYS: dict[str, str | None] = {
    "enabled": None,
    **dict.fromkeys(_FP16_SETTINGS),
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
_PRECISION_BLOCKS = ("fp16", "bf16", "bfloat16")
_HANDLED = (*_PRECISION_BLOCKS, "optimizer", "gradient_clipping", "gradient_accumulation_steps")

# Top-level keys with no jaxmp counterpart, and what to do instead.
_NO_EQUIVALENT = {
    "zero_optimization": "ZeRO partitioning has no jaxmp equivalent; shard "
    "params and optimizer state with jax.sharding (NamedSharding) under jit",
    "zero_allow_untested_optimizer": "ZeRO has no jaxmp equivalent",
    "zero_force_ds_cpu_optimizer": "ZeRO has no jaxmp equivalent",
    "amp": "apex AMP has no jaxmp equivalent; the dtype policy replaces it",
    "activation_checkpointing": "use jax.checkpoint (flax: nn.remat)",
    "scheduler": "use an optax schedule, e.g. "
    "optax.warmup_cosine_decay_schedule, as the learning rate",
    "train_batch_size": "the batch size is set by your data pipeline",
    "train_micro_batch_size_per_gpu": "the batch size is set by your data pipeline",
    "communication_data_type": "JAX chooses collective dtypes from the arrays",
    "prescale_gradients": "no jaxmp equivalent",
    "gradient_predivide_factor": "no jaxmp equivalent",
    "sparse_gradients": "no jaxmp equivalent",
    "data_types": "use a jaxmp.Policy for dtypes",
}
_OFFLOAD = "offloading has no jaxmp equivalent"

# DeepSpeed's optimizer types -> the optax family, and the params each maps.
_OPTIMIZERS = {**dict.fromkeys(("adam", "adamw", "fusedadam", "cpuadam", "deepspeedcpuadam"), "adam"),
               "lamb": "lamb", "onebitlamb": "lamb", "lion": "lion", "sgd": "sgd"}
_MAPPED = {"adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode"),
           "lamb": ("lr", "betas", "eps", "weight_decay"),
           "lion": ("lr", "betas", "weight_decay"),
           "sgd": ("lr", "momentum", "weight_decay")}
_PARAM_CHECKS = {"lr": dict(minimum=0, advice='Give the learning rate, e.g. 1e-3, or "auto".'),
                 "eps": dict(minimum=0), "weight_decay": dict(minimum=0),
                 "momentum": dict(minimum=0), "adam_w_mode": dict(boolean=True)}

# The Trainer's arguments that decide what "auto" becomes, with its defaults.
TRAINER_DEFAULTS: dict[str, Any] = {
    "fp16": False, "bf16": False, "fp16_full_eval": False, "bf16_full_eval": False,
    "half_precision_backend": "auto", "max_grad_norm": 1.0,
    "gradient_accumulation_steps": 1, "learning_rate": 5e-5, "adam_beta1": 0.9,
    "adam_beta2": 0.999, "adam_epsilon": 1e-8, "weight_decay": 0.0,
}
# Read for the apex refusal only; fp16_backend is the older name of the backend.
_TRAINER_ALSO_READ = {"fp16_backend": "auto", "fp16_opt_level": "O1"}
# Each "auto" the Trainer fills in, and the arguments it takes it from.
_FILLS = (("fp16.enabled", ("fp16",)), ("bf16.enabled", ("bf16",)),
          ("bfloat16.enabled", ("bf16",)), ("gradient_clipping", ("max_grad_norm",)),
          ("gradient_accumulation_steps", ("gradient_accumulation_steps",)),
          ("optimizer.params.lr", ("learning_rate",)),
          ("optimizer.params.betas", ("adam_beta1", "adam_beta2")),
          ("optimizer.params.eps", ("adam_epsilon",)),
          ("optimizer.params.weight_decay", ("weight_decay",)))
_ONE_MODE = (
    "jaxmp has one mixed-precision mode, DeepSpeed's fp16/bf16 one: float32 "
    "master params, float16 or bfloat16 compute, and a dynamic loss scale "
    "for float16; there is no apex opt_level to choose.")


def suggestion(key: str, known: Any) -> str:
  """`` Did you mean 'x'?`` for the known key closest to ``key``, or ``""``."""
  lowered = {k.lower(): k for k in known}
  match = difflib.get_close_matches(str(key).lower(), lowered, n=1, cutoff=0.75)
  return f" Did you mean '{lowered[match[0]]}'?" if match else ""


def _checked(name: str, value: Any, *, owner: str = _OWNER, boolean: bool = False,
             **bounds: Any) -> Any:
  """A value read from a config, checked; any bad value is a ``ValueError``, as in json."""
  try:
    if boolean:
      return check_bool(owner, name, value, advice=_BOOL)
    if isinstance(value, str):
      bounds["advice"] = f"Write a JSON number, without quotes. {bounds.get('advice', '')}".strip()
    return check_number(owner, name, value, **bounds)
  except TypeError as e:
    raise ValueError(str(e)) from None


# A JSON string, a comment, an unterminated comment, or a comma that follows
# a value and only whitespace and comments separate from a closing bracket.
_NOISE = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/\*.*?\*/|/\*|'
                    r'(?<![,{\[\s])\s*,(?=(?:\s|//[^\n]*|/\*.*?\*/)*[}\]])', re.S)


def _strict_json(match: re.Match[str]) -> str:
  """A JSON string as it is; comments and trailing commas as blanks, keeping line numbers."""
  text = match.group()
  if text == "/*":
    raise ValueError(f"unterminated /* comment in the {_OWNER}: close it with */")
  if text[0] == "/":
    return "\n" * text.count("\n") or " "
  return text if text[0] == '"' else text[:-1] + " "


def load_deepspeed_config(config: Any, what: str = "a DeepSpeed config",
                          source: str | None = None) -> dict[str, Any]:
  """A config as a dict, from a dict, JSON text or bytes, or a path.

  JSON may carry ``//`` and ``/* */`` comments, trailing commas and a
  byte-order mark; a key given twice in one object is refused, as DeepSpeed
  refuses it. ``source`` names text read elsewhere (e.g. standard input).

  Example:
    >>> load_deepspeed_config('{"fp16": {"enabled": true,}  // fp16 on\\n}')
    {'fp16': {'enabled': True}}
  """
  if isinstance(config, dict):
    return config
  if isinstance(config, (bytes, bytearray)):
    try:
      config = bytes(config).decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"the bytes of {what} are not UTF-8: {e}") from None
  if isinstance(config, str) and (source or config.startswith("\ufeff") or "\n" in config
                                  or config.lstrip().startswith(("{", "[", "//", "/*"))):
    text, source = config, source or "the JSON string"
  elif isinstance(config, (str, os.PathLike)):
    path = os.fspath(config)
    try:
      with open(path, encoding="utf-8-sig") as f:
        text, source = f.read(), repr(path)
    except FileNotFoundError:
      raise ValueError(f"no such file: {path!r}; pass a dict, a JSON string or the "
                       f"path of a file that holds {what}") from None
    except (OSError, UnicodeDecodeError) as e:
      raise ValueError(f"cannot read {path!r}: {e}") from None
  else:
    raise TypeError(f"from_deepspeed_config expects a dict, a JSON string or a path "
                    f"for {what}, got a {type(config).__name__}.")

  def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    twice = [key for key in keys if keys.count(key) > 1]
    if twice:
      raise ValueError(
          f"{source} gives the key {twice[0]!r} twice in one object (the object with "
          f"the keys {', '.join(map(repr, dict.fromkeys(keys)))}); JSON keeps only the "
          "last one, and DeepSpeed refuses duplicate keys. Keep one of them.")
    return dict(pairs)

  try:
    config = json.loads(_NOISE.sub(_strict_json, text.removeprefix("\ufeff")),
                        object_pairs_hook=unique)
  except json.JSONDecodeError as e:
    raise ValueError(f"{source} is not valid JSON: {e.msg} at line {e.lineno}, "
                     f"column {e.colno}") from None
  except RecursionError:
    raise ValueError(f"{source} is nested too deeply to parse; {what} is an object a "
                     "few levels deep: check that this is the right file") from None
  if not isinstance(config, dict):
    raise ValueError(f"{source} must hold a JSON object ({what}), got a "
                     f"{type(config).__name__}")
  return config


# ---------------------------------------------------------------------------
# The Hugging Face Trainer's arguments, which fill in the config's "auto".


def _trainer_bool(text: str) -> bool:
  """A bool flag's value, as the Trainer's argument parser reads it."""
  if text.lower() in ("yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"):
    return text.lower() in ("yes", "true", "t", "y", "1")
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def add_trainer_flags(parser: argparse.ArgumentParser) -> None:
  """Adds a flag for each Trainer argument that is read, typed by its default.

  The one parser of the Trainer's command line, for ``training_args=[...]``
  and for ``jaxmp convert``: every key the dict form reads is a flag.
  """
  for name, default in {**TRAINER_DEFAULTS, **_TRAINER_ALSO_READ}.items():
    names = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
    kind = dict(nargs="?", const=True, type=_trainer_bool, metavar="BOOL") if isinstance(
        default, bool) else dict(type=type(default), metavar="VALUE")
    parser.add_argument(*names, dest=name, default=None,
                        help=f"the Trainer's --{name} (default {default})", **kind)


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
    raise ValueError(f"{_TRAINER}: the command line {list(argv)!r} holds a "
                     f"value that is not a string. {advice}")
  try:
    namespace, rest = parser.parse_known_args(list(argv))
  except argparse.ArgumentError as e:
    flag = (e.argument_name or "").split("/")[0]
    raise ValueError(f"{_TRAINER}: {flag}: {e.message}. {advice}") from None
  unread = [token.split("=")[0] for token in rest if token.startswith("-")]
  for name in unread:
    if suggestion(name, flags):
      raise ValueError(f"{_TRAINER}: the flag {name} is not one the conversion reads "
                       f"({', '.join(flags)}).{suggestion(name, flags)}")
  if unread:
    warnings.warn(
        f"{_TRAINER}: {listing(unread)} not read: they do not decide precision, "
        f"clipping, accumulation or the optimizer's settings. The flags read are "
        f"{', '.join(flags)}.", UserWarning, stacklevel=caller_stacklevel())
  return {key: value for key, value in vars(namespace).items() if value is not None}


def _trainer_values(training_args: Any) -> dict[str, Any]:
  """The Trainer's arguments that fill in "auto", checked, defaults included."""
  if isinstance(training_args, (list, tuple)):
    given = trainer_flags(training_args)
  else:
    given = load_deepspeed_config(training_args, "the Trainer's arguments")
  if "fp16_backend" in given and "half_precision_backend" not in given:
    given = {**given, "half_precision_backend": given["fp16_backend"]}
  args = {key: given.get(key, default) for key, default in TRAINER_DEFAULTS.items()}
  for key, default in TRAINER_DEFAULTS.items():
    if not isinstance(default, str):
      beta = key.startswith("adam_beta")
      args[key] = _checked(
          key, args[key], owner=_TRAINER, boolean=isinstance(default, bool),
          integer=isinstance(default, int), minimum=1 if isinstance(default, int) else 0,
          maximum=1 if beta else None, exclusive_maximum=beta,
          advice=f"The Trainer's default is {default!r}.")
  if args["fp16"] and args["bf16"]:
    raise ValueError(
        f"{_TRAINER}: fp16 and bf16 are both true, which the Trainer refuses too; "
        "keep one (bf16 needs no loss scaling where the hardware runs it, see "
        "`jaxmp doctor`).")
  if (args["fp16"] or args["fp16_full_eval"]) and args["half_precision_backend"] == "apex":
    raise ValueError(
        f"{_TRAINER}: fp16 with half_precision_backend 'apex' makes the Trainer fill "
        "in amp.enabled (NVIDIA apex, opt_level from fp16_opt_level "
        f"{given.get('fp16_opt_level', 'O1')!r}) instead of fp16.enabled. {_ONE_MODE} "
        "Drop the apex backend (the Trainer's default then fills in fp16.enabled: "
        "mixed_float16 with a dynamic loss scale).")
  return args


def _fill_auto(config: dict[str, Any], training_args: Any) -> dict[str, Any]:
  """``config`` as the Trainer hands it to DeepSpeed: each "auto" filled in.

  Without ``training_args``, with the Trainer's defaults, and a warning. With
  them, a value that differs from the Trainer's is refused, as the Trainer
  refuses it, and an enabled fp16 or bf16 block the config lacks is added.
  """
  given = training_args is not None
  args = _trainer_values(training_args) if given else TRAINER_DEFAULTS
  args = {**args, "fp16": args["fp16"] or args["fp16_full_eval"],
          "bf16": args["bf16"] or args["bf16_full_eval"]}
  config = copy.deepcopy(config)
  if given:
    config.update({name: {"enabled": True} for name in ("fp16", "bf16")
                   if args[name] and name not in config})
    config.setdefault("gradient_accumulation_steps", args["gradient_accumulation_steps"])
  filled, mismatches = [], []
  for key, names in _FILLS:
    *parents, leaf = key.split(".")
    node = config
    for parent in parents:
      node = node.get(parent) if isinstance(node, dict) else None
    if not isinstance(node, dict) or node.get(leaf) is None:
      continue
    value = [args[n] for n in names] if len(names) > 1 else args[names[0]]
    if node[leaf] == "auto":
      node[leaf] = value
      filled.append(f"{key} as {json.dumps(value)}")
    elif given and node[leaf] != value:
      mismatches.append(f"{key} is {json.dumps(node[leaf])} in the config and "
                        f"{', '.join(names)} {value!r} in the Trainer's arguments")
  if mismatches:
    raise ValueError(
        f"{_OWNER}: {listing(mismatches, '; ')}. The Hugging Face Trainer refuses a "
        'config value that differs from its argument. Set the value to "auto" in the '
        "config (it then takes the Trainer's), or give the Trainer the config's value.")
  if filled and not given:
    warnings.warn(
        f'{_OWNER}: "auto" read as the Hugging Face Trainer\'s defaults: '
        f"{listing(filled)}. The Trainer fills it in from its arguments: pass them "
        "to resolve it as the Trainer does (training_args=..., or `jaxmp convert "
        "--training-args args.json`, --bf16, --fp16), or write the values.",
        UserWarning, stacklevel=caller_stacklevel())
  return config


# ---------------------------------------------------------------------------
# The description of the run.


@dataclasses.dataclass(frozen=True)
class DeepSpeedRun:
  """What a DeepSpeed config asks for: what ``jaxmp convert`` prints."""

  preset: str  # the policy's name
  loss_scale: LossScale
  optimizer: tuple[tuple[str, dict[str, Any]], ...]  # optax functions, chained
  clip: float | None  # clip_global_norm
  accumulation: int  # micro-batches per step
  left_out: tuple[tuple[str, str], ...]  # (key, what to do instead)


def _precision(config: dict[str, Any], left_out: list[tuple[str, str]]) -> tuple[str, LossScale]:
  """The policy's name and the loss scale of the fp16/bf16 blocks."""
  enabled = {}
  bf16 = "bf16" if "bf16" in config or "bfloat16" not in config else "bfloat16"
  for name, known in (("fp16", FP16_KEYS), (bf16, BF16_KEYS)):
    block = config.get(name, {})
    if not isinstance(block, dict):
      raise ValueError(f"{_OWNER}: '{name}' must be an object such as "
                       f'{{"enabled": true}}, got {block!r}')
    for key in block:
      if key not in known:
        raise ValueError(
            f"{_OWNER}: {name}.{key} is not a key of the {name} block, and DeepSpeed "
            f"refuses it too.{suggestion(key, known)} The keys of {name} are: "
            f"{', '.join(known)}.")
    if _checked(f"{name}.enabled", block.get("enabled", False), boolean=True):
      enabled[name] = block
      left_out += [(f"{name}.{key}", known[key]) for key in block if known[key]]
  if len(enabled) == 2:
    raise ValueError(
        f"{_OWNER}: fp16 and {bf16} are both enabled, which DeepSpeed does not "
        "support either; keep one (bf16 needs no loss scaling where the hardware "
        "runs it, see `jaxmp doctor`)")
  if "fp16" not in enabled:
    return ("mixed_bfloat16" if enabled else "float32"), NoOpLossScale()
  fp16 = enabled["fp16"]
  values = {key: _checked(f"fp16.{key}", default if fp16.get(key) in (None, "auto") else fp16[key],
                          boolean=isinstance(default, bool), **bounds)
            for key, (default, bounds) in _FP16_SETTINGS.items()}
  static, initial = values["loss_scale"], 2.0**values["initial_scale_power"]
  if 0 < static < np.finfo(np.float32).tiny:
    raise ValueError(
        f"{_OWNER}: fp16.loss_scale must be 0 or at least 2**-126, the smallest "
        f"normal float32, got {static!r}; smaller scales are flushed to 0 and every "
        "step would be skipped. Use 0 (dynamic loss scaling) or a positive static scale.")
  if static:
    return "mixed_float16", StaticLossScale(static)
  if values["min_loss_scale"] > initial:
    raise ValueError(
        f"{_OWNER}: fp16.min_loss_scale ({values['min_loss_scale']!r}) is above the "
        f"initial scale 2**{values['initial_scale_power']} = {initial!r}; lower "
        "min_loss_scale or raise initial_scale_power")
  return "mixed_float16", DynamicLossScale(
      initial, period=values["loss_scale_window"], factor=2.0,
      min_loss_scale=values["min_loss_scale"], hysteresis=values["hysteresis"],
      consecutive_hysteresis=values["consecutive_hysteresis"])


def _optimizer(block: Any, left_out: list[tuple[str, str]]) -> tuple[tuple[str, dict[str, Any]], ...]:
  """The optax functions, chained, equivalent to the ``optimizer`` block."""
  if block is None:
    left_out.append(("optimizer", "absent: optax.adam(learning_rate=0.001) is a "
                     "placeholder; choose your optimizer"))
    return (("adam", {"learning_rate": 1e-3}),)
  if not isinstance(block, dict):
    raise ValueError(f"{_OWNER}: 'optimizer' must be an object such as "
                     f'{{"type": "AdamW", "params": {{"lr": 1e-3}}}}, got {block!r}')
  kind, params = block.get("type", ""), block.get("params") or {}
  if not isinstance(kind, str):
    raise ValueError(f'{_OWNER}: optimizer.type must be a string such as "AdamW", got {kind!r}')
  if not isinstance(params, dict):
    raise ValueError(f"{_OWNER}: optimizer.params must be an object, got {params!r}")
  family = _OPTIMIZERS.get(kind.lower())
  if family is None:
    left_out.append(("optimizer", f"optimizer type {kind!r} is not mapped; pick the "
                     "optax optimizer by hand (Adam's is used as a placeholder)"))
  family = family or "adam"
  values: dict[str, Any] = {"lr": 1e-3}  # torch's default
  for key, value in params.items():
    if key not in _MAPPED[family]:
      left_out.append((f"optimizer.params.{key}", "not mapped to an optax argument; set "
                       "it by hand if it matters." + suggestion(key, _MAPPED[family])))
    if key == "betas" and not (isinstance(value, (list, tuple)) and len(value) == 2):
      raise ValueError(f"{_OWNER}: optimizer.params.betas must be a list of two "
                       f"numbers such as [0.9, 0.999], got {value!r}")
    if key == "betas":
      values[key] = [_checked(f"optimizer.params.betas[{i}]", beta, minimum=0, maximum=1,
                              exclusive_maximum=True) for i, beta in enumerate(value)]
    elif key in _PARAM_CHECKS:
      values[key] = _checked(f"optimizer.params.{key}", value, **_PARAM_CHECKS[key])
  args = {"learning_rate": values["lr"]}
  if "betas" in values and "betas" in _MAPPED[family]:
    args["b1"], args["b2"] = values["betas"]
  if "eps" in values and "eps" in _MAPPED[family]:
    args["eps"] = values["eps"]
  if values.get("momentum") and family == "sgd":
    args["momentum"] = values["momentum"]
  decay = values.get("weight_decay", 0)
  if family in ("lamb", "lion") or (decay and family == "adam" and (
      kind.lower() != "adam" or values.get("adam_w_mode") is not False)):
    return (("adamw" if family == "adam" else family, {**args, "weight_decay": decay}),)
  return ((("add_decayed_weights", {"weight_decay": decay}),) if decay else ()) + ((family, args),)


def read_deepspeed_config(config: Any, training_args: Any = None) -> DeepSpeedRun:
  """Reads and checks a whole DeepSpeed config, "auto" filled in as the Trainer does."""
  config = load_deepspeed_config(config)
  amp = config.get("amp")
  if isinstance(amp, dict) and amp.get("enabled", "auto") != "auto" and _checked(
      "amp.enabled", amp["enabled"], boolean=True):
    raise ValueError(
        f"{_OWNER}: amp.enabled is true: DeepSpeed hands mixed precision to NVIDIA "
        f"apex (opt_level {amp.get('opt_level', 'O1')!r}). {_ONE_MODE} Replace the amp "
        'block with "fp16": {"enabled": true} (mixed_float16 with a dynamic loss scale) '
        'or, where the hardware runs bfloat16, "bf16": {"enabled": true} (mixed_bfloat16).')
  config = _fill_auto(config, training_args)
  left_out: list[tuple[str, str]] = []
  preset, loss_scale = _precision(config, left_out)
  optimizer = _optimizer(config.get("optimizer"), left_out)
  clip = config.get("gradient_clipping")
  if clip is None:
    clip = 1.0  # DeepSpeed 0.19.8's default
    left_out.append(("gradient_clipping", "absent: DeepSpeed 0.19.8 then clips at 1.0 "
                     '(0.18.0 did not clip), and so does the code; write "gradient_clipping": '
                     "0 in the config to turn clipping off"))
  clip = _checked("gradient_clipping", clip, minimum=0,
                  advice="Use 0 for no clipping, or the max global norm, e.g. 1.0.")
  accumulation = _checked(
      "gradient_accumulation_steps", config.get("gradient_accumulation_steps", 1),
      integer=True, minimum=1, maximum=INT32_MAX,
      advice="Use the number of micro-batches per optimizer step.")
  for key, value in config.items():
    if key in _HANDLED:
      continue
    if suggestion(key, _PRECISION_BLOCKS):
      warnings.warn(
          f"{_OWNER}: the key {key!r} is not read (DeepSpeed ignores it too)."
          f"{suggestion(key, _PRECISION_BLOCKS)} Without an fp16 or bf16 block the "
          "run is float32.", UserWarning, stacklevel=caller_stacklevel())
    elif key in _NO_EQUIVALENT or "offload" in key:
      left_out.append((key, _NO_EQUIVALENT.get(key, _OFFLOAD)))
      if isinstance(value, dict):
        left_out += [(f"{key}.{k}", _OFFLOAD) for k in value if "offload" in k]
    else:
      left_out.append((key, "no jaxmp equivalent; ignored."
                       + suggestion(key, (*_HANDLED, *_NO_EQUIVALENT))))
  return DeepSpeedRun(preset, loss_scale, optimizer, clip or None,
                      accumulation, tuple(left_out))


def from_deepspeed_config(config: Any, *, training_args: Any = None) -> tuple[Policy, LossScale]:
  """Returns the jaxmp policy and loss scale equivalent to a DeepSpeed config.

  ``fp16`` gives ``mixed_float16`` with a :class:`jaxmp.DynamicLossScale`
  (``loss_scale: 0``; ``2**initial_scale_power``, ``loss_scale_window`` as
  ``period``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale``,
  DeepSpeed's defaults where absent) or a :class:`jaxmp.StaticLossScale`;
  ``bf16`` (or ``bfloat16``) gives ``mixed_bfloat16`` with
  :class:`jaxmp.NoOpLossScale`; neither gives ``float32``. The whole config
  is read and checked, as ``jaxmp convert`` prints it: what DeepSpeed
  refuses is refused, and so are values that make no sense. Each ``"auto"``
  takes the Hugging Face Trainer's argument (its default, with a warning,
  without ``training_args``). docs/migration.md lists the differences from
  DeepSpeed's scaler.

  Args:
    config: a dict, JSON text (``//`` and ``/* */`` comments and trailing
      commas accepted) or the path of a JSON file.
    training_args: the Trainer's ``TrainingArguments``: a dict, its JSON or
      the path of a file holding it, or its command line as a list of strings.

  Returns:
    ``(policy, loss_scale)``.

  Raises:
    ValueError: for a config or arguments that cannot be read, or that
      DeepSpeed, the Trainer or jaxmp refuses.
    TypeError: when ``config`` is not a dict, a string or a path.

  Example:
    >>> import jaxmp
    >>> policy, loss_scale = jaxmp.from_deepspeed_config(
    ...     '{"fp16": {"enabled": true, "initial_scale_power": 12,}}  // dynamic')
    >>> str(policy), float(loss_scale.loss_scale), loss_scale.period
    ('p=f32,c=f16,o=f32', 4096.0, 1000)
  """
  run = read_deepspeed_config(config, training_args)
  return get_policy(run.preset), run.loss_scale
