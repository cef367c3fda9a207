"""Migration: DeepSpeed configs and PyTorch ``GradScaler`` settings to jaxmp.

:func:`from_deepspeed_config` reads the ``fp16``/``bf16`` blocks of a
DeepSpeed config; :func:`from_torch_grad_scaler` takes the arguments of
``torch.amp.GradScaler``. Both return jaxmp objects with the same behaviour
(the differences from DeepSpeed's own scaler are listed in the docs and in the
docstring of :func:`from_deepspeed_config`). :func:`deepspeed_config_to_code`
is what ``jaxmp convert`` prints.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from typing import Any

from jaxmp._src.loss_scale import (
    INT32_MAX,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
    StaticLossScale,
)
from jaxmp._src.policy import Policy, get_policy

# DeepSpeed's defaults for the fp16 block (its precision config).
DEEPSPEED_FP16_DEFAULTS = {
    "loss_scale": 0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1,
}

# Keys of the fp16/bf16 blocks that jaxmp reads.
_FP16_KEYS = ("enabled", *DEEPSPEED_FP16_DEFAULTS)
_BF16_KEYS = ("enabled",)

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
    "train_micro_batch_size_per_gpu": "the batch size is set by your data "
    "pipeline",
    "communication_data_type": "JAX chooses collective dtypes from the arrays",
    "prescale_gradients": "no jaxmp equivalent",
    "gradient_predivide_factor": "no jaxmp equivalent",
    "sparse_gradients": "no jaxmp equivalent",
    "data_types": "use a jaxmp.Policy for dtypes",
}


class _ConfigError(ValueError):
  pass


# ---------------------------------------------------------------------------
# Reading the config.


def _strip_comments(text: str) -> str:
  """Removes ``//`` and ``/* */`` comments that lie outside JSON strings."""
  out = []
  i, n = 0, len(text)
  in_string = False
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
      i += 1
    elif c == '"':
      in_string = True
      out.append(c)
      i += 1
    elif text.startswith("//", i):
      end = text.find("\n", i)
      i = n if end < 0 else end  # keep the newline, so line numbers hold
    elif text.startswith("/*", i):
      end = text.find("*/", i + 2)
      if end < 0:
        raise _ConfigError("unterminated /* comment in the DeepSpeed config")
      # Keep the newlines of the comment, so JSON error line numbers hold.
      out.append("\n" * text.count("\n", i, end) or " ")
      i = end + 2
    else:
      out.append(c)
      i += 1
  return "".join(out)


def _parse_json(text: str, source: str) -> dict[str, Any]:
  try:
    config = json.loads(_strip_comments(text))
  except json.JSONDecodeError as e:
    raise _ConfigError(
        f"{source} is not valid JSON: {e.msg} at line {e.lineno}, column "
        f"{e.colno}"
    ) from None
  if not isinstance(config, dict):
    raise _ConfigError(
        f"{source} must hold a JSON object (a DeepSpeed config), got a "
        f"{type(config).__name__}"
    )
  return config


def load_deepspeed_config(config: Any) -> dict[str, Any]:
  """Returns a DeepSpeed config as a dict, from a dict, a JSON string or a path.

  JSON text may carry ``//`` and ``/* */`` comments outside strings, as many
  published configs do.

  Args:
    config: a dict, JSON text (a string that starts with ``{``, ``[`` or a
      comment, or spans several lines), or a path to a file.

  Returns:
    The config dict (a dict passed in is returned as is).

  Raises:
    ValueError: if the file is missing or unreadable, or the text is not a
      JSON object.
    TypeError: for any other kind of ``config``.

  Example:
    >>> from jaxmp._src.deepspeed import load_deepspeed_config
    >>> load_deepspeed_config('{"fp16": {"enabled": true}  // fp16 on\\n}')
    {'fp16': {'enabled': True}}
  """
  if isinstance(config, dict):
    return config
  if isinstance(config, (bytes, bytearray)):
    config = config.decode("utf-8")
  if isinstance(config, str) and (
      "\n" in config or config.lstrip().startswith(("{", "[", "//", "/*"))
  ):
    return _parse_json(config, "the JSON string")
  if isinstance(config, (str, os.PathLike)):
    path = os.fspath(config)
    try:
      with open(path, encoding="utf-8") as f:
        text = f.read()
    except FileNotFoundError:
      raise _ConfigError(
          f"no such file: {path!r}; pass a dict, a JSON string or the path of "
          "a DeepSpeed config file"
      ) from None
    except (OSError, UnicodeDecodeError) as e:
      raise _ConfigError(f"cannot read {path!r}: {e}") from None
    return _parse_json(text, repr(path))
  raise TypeError(
      "from_deepspeed_config expects a dict, a JSON string or a path, got a "
      f"{type(config).__name__}."
  )


# ---------------------------------------------------------------------------
# Validating the fp16 / bf16 blocks.


def _block(config: dict[str, Any], *names: str) -> dict[str, Any]:
  for name in names:
    if name in config:
      block = config[name]
      if not isinstance(block, dict):
        raise _ConfigError(
            f"DeepSpeed config: '{name}' must be an object such as "
            f'{{"enabled": true}}, got {block!r}'
        )
      return block
  return {}


def _enabled(block: dict[str, Any], name: str) -> bool:
  value = block.get("enabled", False)
  if value == "auto":
    warnings.warn(
        f'DeepSpeed config: {name}.enabled is "auto" (the Hugging Face '
        "Trainer fills it in from --fp16/--bf16); read as DeepSpeed's default, "
        f"false. Set {name}.enabled to true or false to choose.",
        UserWarning,
        stacklevel=4,
    )
    return False
  if not isinstance(value, bool):
    raise _ConfigError(
        f"DeepSpeed config: {name}.enabled must be true or false, got "
        f"{value!r}"
    )
  return value


def _number(block: dict[str, Any], key: str, *, integer: bool = False) -> Any:
  value = block.get(key, "auto")
  if value == "auto" or value is None:
    return DEEPSPEED_FP16_DEFAULTS[key]
  kind = "an integer" if integer else "a number"
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise _ConfigError(f"DeepSpeed config: fp16.{key} must be {kind}, got {value!r}")
  if not math.isfinite(value):
    raise _ConfigError(f"DeepSpeed config: fp16.{key} must be finite, got {value!r}")
  if integer:
    if not float(value).is_integer():
      raise _ConfigError(
          f"DeepSpeed config: fp16.{key} must be an integer, got {value!r}"
      )
    return int(value)
  return value


@dataclasses.dataclass(frozen=True)
class _Precision:
  policy: Policy
  loss_scale: LossScale
  mode: str  # "fp16-dynamic", "fp16-static", "bf16" or "float32"
  ignored: tuple[tuple[str, str], ...]  # (key, advice) inside fp16/bf16


def _precision(config: dict[str, Any]) -> _Precision:
  fp16 = _block(config, "fp16")
  bf16_name = "bf16" if "bf16" in config or "bfloat16" not in config else "bfloat16"
  bf16 = _block(config, bf16_name)
  fp16_on = _enabled(fp16, "fp16")
  bf16_on = _enabled(bf16, bf16_name)
  ignored = []
  if fp16_on:
    ignored += [(f"fp16.{k}", "no jaxmp equivalent") for k in fp16 if k not in _FP16_KEYS]
  if bf16_on:
    ignored += [
        (f"{bf16_name}.{k}", "no jaxmp equivalent") for k in bf16 if k not in _BF16_KEYS
    ]
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
  static = _number(fp16, "loss_scale")
  if static < 0:
    raise _ConfigError(
        f"DeepSpeed config: fp16.loss_scale must be 0 (dynamic loss scaling) "
        f"or a positive static scale, got {static!r}"
    )
  if static > 0:
    if static > 3.4e38:
      raise _ConfigError(
          f"DeepSpeed config: fp16.loss_scale {static!r} exceeds float32's range"
      )
    return _Precision(policy, StaticLossScale(float(static)), "fp16-static", tuple(ignored))

  power = _number(fp16, "initial_scale_power", integer=True)
  if not -126 <= power <= 127:
    raise _ConfigError(
        "DeepSpeed config: fp16.initial_scale_power must lie in [-126, 127] "
        f"(the scale is a float32), got {power}; 16 is the usual value"
    )
  window = _number(fp16, "loss_scale_window", integer=True)
  if not 1 <= window <= INT32_MAX:
    raise _ConfigError(
        f"DeepSpeed config: fp16.loss_scale_window must be a positive integer, "
        f"got {window}; 1000 is DeepSpeed's default"
    )
  hysteresis = _number(fp16, "hysteresis", integer=True)
  if hysteresis < 1:
    raise _ConfigError(
        f"DeepSpeed config: fp16.hysteresis must be >= 1, got {hysteresis} "
        "(1 backs off on every overflow; DeepSpeed's default is 2)"
    )
  consecutive = fp16.get("consecutive_hysteresis", "auto")
  if consecutive == "auto" or consecutive is None:
    consecutive = DEEPSPEED_FP16_DEFAULTS["consecutive_hysteresis"]
  if not isinstance(consecutive, bool):
    raise _ConfigError(
        "DeepSpeed config: fp16.consecutive_hysteresis must be true or false, "
        f"got {consecutive!r}"
    )
  min_scale = _number(fp16, "min_loss_scale")
  initial = 2.0**power
  if min_scale <= 0:
    raise _ConfigError(
        f"DeepSpeed config: fp16.min_loss_scale must be > 0, got {min_scale!r}"
    )
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
      min_loss_scale=float(min_scale),
      hysteresis=hysteresis,
      consecutive_hysteresis=consecutive,
  )
  return _Precision(policy, loss_scale, "fp16-dynamic", tuple(ignored))


def from_deepspeed_config(config: Any) -> tuple[Policy, LossScale]:
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
    ``enabled: "auto"`` is read as false, with a warning.

  The hysteresis budget, the minimum clamp and the overflows at the minimum
  (DeepSpeed's "Current loss scale already at minimum" error, which
  :func:`jaxmp.check_loss_scale` raises) follow DeepSpeed exactly. Two
  differences: DeepSpeed grows the scale on the ``window + 1``-th clean step
  after an overflow (and after the start), jaxmp on the ``window``-th; and
  DeepSpeed has no maximum, while jaxmp stops growing at the largest float32.

  Args:
    config: a dict, a JSON string or the path of a JSON file; ``//`` and
      ``/* */`` comments are accepted.

  Returns:
    ``(policy, loss_scale)``.

  Raises:
    ValueError: when the file cannot be read or parsed, fp16 and bf16 are both
      enabled, or a value is ill-typed or makes no sense (``hysteresis: 0``,
      ``min_loss_scale`` above the initial scale, a negative ``loss_scale``).
    TypeError: when ``config`` is not a dict, a string or a path.

  Example:
    >>> import jaxmp
    >>> policy, loss_scale = jaxmp.from_deepspeed_config(
    ...     '{"fp16": {"enabled": true, "loss_scale": 0, // dynamic\\n'
    ...     '          "initial_scale_power": 12, "hysteresis": 2}}')
    >>> str(policy), float(loss_scale.loss_scale), loss_scale.period
    ('p=f32,c=f16,o=f32', 4096.0, 1000)
  """
  precision = _precision(load_deepspeed_config(config))
  return precision.policy, precision.loss_scale
