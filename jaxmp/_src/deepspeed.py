"""Reading DeepSpeed configs: the ``fp16``/``bf16`` blocks as a jaxmp policy and loss scale.

:func:`from_deepspeed_config` returns jaxmp objects with the behaviour of
DeepSpeed's (the differences from DeepSpeed's own scaler are listed in the
docs and in its docstring). The reader refuses what DeepSpeed refuses:
duplicate keys, and keys inside ``fp16``/``bf16`` that DeepSpeed does not
know. ``jaxmp convert`` (``_src/codegen.py``) builds on the same reader.
"""

from __future__ import annotations

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
from jaxmp._src.validation import check_bool, check_number

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


def checked(check: Callable[..., Any], name: str, value: Any, **kwargs: Any) -> Any:
  """Runs a validator of ``_src/validation.py`` on a value read from a config.

  Everything wrong inside a config raises ``ValueError`` (as ``json`` and
  DeepSpeed do), with the validator's wording; ``TypeError`` is kept for a
  ``config`` argument that is not a config at all.
  """
  if isinstance(value, str) and check is check_number:
    kwargs["advice"] = " ".join(
        ["Write a JSON number, without quotes.", kwargs.get("advice", "")]).strip()
  try:
    return check(_OWNER, name, value, **kwargs)
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


def parse_deepspeed_json(text: str, source: str) -> dict[str, Any]:
  """Parses the text of a DeepSpeed config (comments, trailing commas, a BOM).

  Args:
    text: the JSON text.
    source: how the text is named in errors, e.g. ``"standard input"``.

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
        f"{source} is nested too deeply to parse; a DeepSpeed config is an "
        "object a few levels deep: check that this is the right file"
    ) from None
  if not isinstance(config, dict):
    raise _ConfigError(
        f"{source} must hold a JSON object (a DeepSpeed config), got a "
        f"{type(config).__name__}"
    )
  return config


def load_deepspeed_config(config: Any) -> dict[str, Any]:
  """Returns a DeepSpeed config as a dict, from a dict, a JSON string or a path.

  JSON text may carry ``//`` and ``/* */`` comments and trailing commas
  outside strings, and a byte-order mark, as many published configs do. A key
  given twice in one object is refused, as DeepSpeed refuses it.

  Args:
    config: a dict, JSON text (a string that starts with a byte-order mark,
      ``{``, ``[`` or a comment, or spans several lines), or a path to a file.

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
      raise _ConfigError(f"the DeepSpeed config bytes are not UTF-8: {e}") from None
  if isinstance(config, str) and (
      config.startswith("\ufeff")
      or "\n" in config
      or config.lstrip().startswith(("{", "[", "//", "/*"))
  ):
    return parse_deepspeed_json(config, "the JSON string")
  if isinstance(config, (str, os.PathLike)):
    path = os.fspath(config)
    try:
      with open(path, encoding="utf-8-sig") as f:
        text = f.read()
    except FileNotFoundError:
      raise _ConfigError(
          f"no such file: {path!r}; pass a dict, a JSON string or the path of "
          "a DeepSpeed config file"
      ) from None
    except (OSError, UnicodeDecodeError) as e:
      raise _ConfigError(f"cannot read {path!r}: {e}") from None
    return parse_deepspeed_json(text, repr(path))
  raise TypeError(
      "from_deepspeed_config expects a dict, a JSON string or a path, got a "
      f"{type(config).__name__}."
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
        f"false. Set {name}.enabled to true or false to choose.",
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
    ``enabled: "auto"`` is read as false, with a warning, and so is a
    top-level key that looks like a misspelt ``fp16`` or ``bf16``.

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

  Returns:
    ``(policy, loss_scale)``.

  Raises:
    ValueError: when the file cannot be read or parsed, a key is duplicated
      or unknown, fp16 and bf16 are both enabled, or a value is ill-typed or
      makes no sense (``hysteresis: 0``, ``min_loss_scale`` above the initial
      scale, a negative ``loss_scale``).
    TypeError: when ``config`` is not a dict, a string or a path.

  Example:
    >>> import jaxmp
    >>> policy, loss_scale = jaxmp.from_deepspeed_config(
    ...     '{"fp16": {"enabled": true, "loss_scale": 0, // dynamic\\n'
    ...     '          "initial_scale_power": 12, "hysteresis": 2,}}')
    >>> str(policy), float(loss_scale.loss_scale), loss_scale.period
    ('p=f32,c=f16,o=f32', 4096.0, 1000)
  """
  precision = _precision(load_deepspeed_config(config))
  return precision.policy, precision.loss_scale
