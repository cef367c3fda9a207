"""Validation of configuration values: one checker per kind of value, one wording.

Every public constructor and factory of jaxmp validates its configuration
with these, so the same mistake gets the same exception class and the same
sentence everywhere: ``TypeError`` for a value of the wrong kind (a string,
``None``, a bool where a number is expected), ``ValueError`` for a value of
the right kind outside its range. :func:`listing` names the items an error
is about, the first few of them, in one wording.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _as_real(value: Any) -> Any:
  """A Python number for a real number given as Python, NumPy or a 0-d array.

  Returns None for anything else (strings, None, bools, tracers, complex
  numbers, arrays of another shape).
  """
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, jax.core.Tracer):
    return None
  if isinstance(value, numbers.Real):
    return value.item() if isinstance(value, np.generic) else value
  if isinstance(value, (np.ndarray, jax.Array)):
    if value.shape == () and _is_real_dtype(value.dtype):
      return np.asarray(value).item()
  return None


def _is_real_dtype(dtype: Any, *, integer: bool = False) -> bool:
  """Whether ``dtype`` is an integer dtype or (unless ``integer``) a floating one.

  ``jnp.issubdtype`` knows the dtypes NumPy does not (bfloat16, float8).
  """
  if jnp.issubdtype(dtype, jnp.integer):
    return True
  return not integer and jnp.issubdtype(dtype, jnp.floating)


def check_number(
    owner: str,
    name: str,
    value: Any,
    *,
    integer: bool = False,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    exclusive_maximum: bool = False,
    advice: str = "",
) -> Any:
  """Returns ``value`` as a Python ``int`` or ``float`` after checking it.

  Accepts Python and NumPy numbers and concrete 0-d arrays. Infinite values
  are refused unless ``maximum`` is ``math.inf``; nan is always refused.

  Args:
    owner: who checks, e.g. ``"DynamicLossScale"``; starts the message.
    name: the argument's name.
    value: the value.
    integer: whether the value must be a whole number.
    minimum: the smallest value allowed (or the bound, if exclusive).
    maximum: the largest value allowed (or the bound, if exclusive).
    exclusive_minimum: the minimum itself is not allowed.
    exclusive_maximum: the maximum itself is not allowed.
    advice: a sentence appended to the message, e.g. the usual choice.

  Raises:
    TypeError: if ``value`` is not a real number (or not whole when
      ``integer``).
    ValueError: if it is nan, infinite, or outside the range.
  """
  tail = f" {advice}" if advice else ""
  kind = "an integer" if integer else "a number"
  number = _as_real(value)
  if number is None:
    traced = isinstance(value, jax.core.Tracer)
    got = "a traced value (configuration is static: pass a Python number)" if (
        traced) else f"{value!r} of type {type(value).__name__}"
    raise TypeError(f"{owner}: {name} must be {kind}, got {got}.{tail}")
  if math.isnan(number):
    raise ValueError(f"{owner}: {name} must be {kind}, got nan.{tail}")
  if math.isinf(number) and maximum != math.inf:
    raise ValueError(f"{owner}: {name} must be finite, got {number}.{tail}")
  if integer:
    if not float(number).is_integer():
      raise TypeError(f"{owner}: {name} must be an integer, got {value!r}.{tail}")
    number = int(number)
  else:
    number = float(number)
  low_ok = minimum is None or (
      number > minimum if exclusive_minimum else number >= minimum)
  high_ok = maximum is None or (
      number < maximum if exclusive_maximum else number <= maximum)
  if not (low_ok and high_ok):
    raise ValueError(
        f"{owner}: {name} must be {_range_text(kind, minimum, maximum, exclusive_minimum, exclusive_maximum)}, "
        f"got {value!r}.{tail}"
    )
  return number


def _bound(x: float) -> str:
  return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


def _range_text(kind, minimum, maximum, exclusive_minimum, exclusive_maximum):
  parts = []
  if minimum is not None:
    parts.append(f"{'>' if exclusive_minimum else '>='} {_bound(minimum)}")
  if maximum is not None and maximum != math.inf:
    parts.append(f"{'<' if exclusive_maximum else '<='} {_bound(maximum)}")
  return f"{kind} {' and '.join(parts)}" if parts else kind


def check_bool(owner: str, name: str, value: Any, *, advice: str = "") -> bool:
  """Returns ``value`` as a Python bool; refuses anything but a bool.

  Raises:
    TypeError: if ``value`` is not a Python or NumPy bool.
  """
  if not isinstance(value, (bool, np.bool_)):
    tail = f" {advice}" if advice else ""
    raise TypeError(
        f"{owner}: {name} must be True or False, got {value!r} of type "
        f"{type(value).__name__}.{tail}"
    )
  return bool(value)


def check_state_value(
    owner: str,
    name: str,
    value: Any,
    dtype: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    advice: str = "",
) -> Any:
  """Returns ``value`` as a scalar state array of ``dtype`` after checking it.

  State values (a loss scale, a counter) may be Python or NumPy numbers or
  JAX arrays, concrete or traced. A concrete value is checked by value, as
  :func:`check_number` checks a number (a whole number when ``dtype`` is an
  integer dtype), within ``[minimum, maximum]`` and always within the range
  of ``dtype``. It is returned as a NumPy array of ``dtype``, or as the given
  JAX array when that already has ``dtype`` (and is not weakly typed), so
  that it stays where it is. A traced value (or an array spread over several
  processes) cannot be read here: its shape and the kind of its dtype are
  checked, and it is converted to ``dtype``.

  Args:
    owner: who checks, e.g. ``"DynamicLossScale"``; starts the message.
    name: the argument's name.
    value: the value.
    dtype: the dtype of the state array, e.g. ``np.float32`` or ``np.int32``.
    minimum: the smallest value allowed (default: the smallest of ``dtype``).
    maximum: the largest value allowed (default: the largest of ``dtype``).
    advice: a sentence appended to the message, e.g. the usual choice.

  Raises:
    TypeError: if ``value`` is not a scalar real number (a bool, a string,
      ``None``, a complex number, an array of another shape), is not whole
      when ``dtype`` is an integer dtype, or is traced with a dtype that does
      not convert to ``dtype`` without loss (a floating value for a counter).
    ValueError: if a concrete value is nan, infinite or outside the range.
  """
  dtype = np.dtype(dtype)
  integer = dtype.kind in "iu"
  info = np.iinfo(dtype) if integer else np.finfo(dtype)
  minimum = float(info.min) if minimum is None else max(minimum, float(info.min))
  maximum = float(info.max) if maximum is None else min(maximum, float(info.max))
  tail = f" {advice}" if advice else ""
  kind = "an integer" if integer else "a number"
  shape = getattr(value, "shape", ())
  if shape != ():
    raise TypeError(
        f"{owner}: {name} must be a scalar, got an array of shape "
        f"{tuple(shape)}.{tail}"
    )
  unreadable = isinstance(value, jax.core.Tracer) or (
      isinstance(value, jax.Array) and not value.is_fully_addressable)
  if unreadable:
    source = np.dtype(value.dtype)
    if not _is_real_dtype(source, integer=integer):
      raise TypeError(
          f"{owner}: {name} must be {kind}, got a traced {source} value. "
          f"Pass an array of dtype {dtype}.{tail}"
      )
    return jax.lax.convert_element_type(value, dtype)
  number = check_number(owner, name, value, integer=integer, minimum=minimum,
                        maximum=maximum, advice=advice)
  if isinstance(value, jax.Array) and value.dtype == dtype and not value.weak_type:
    return value
  return np.asarray(number, dtype)


def jmp_loss_scale_fix(value: Any) -> str:
  """How to write jmp's loss scale ``value`` as jaxmp's; ``""`` for anything else.

  Example:
    >>> import jmp
    >>> print(jmp_loss_scale_fix(jmp.StaticLossScale(np.float32(8.0))).split(". ")[0])
     That is jmp's StaticLossScale, which jaxmp does not run: write jaxmp.StaticLossScale(loss_scale=8.0)
  """
  kind = type(value).__name__
  if not (type(value).__module__.split(".")[0] == "jmp"
          and kind in ("DynamicLossScale", "StaticLossScale", "NoOpLossScale")):
    return ""

  def plain(field):
    field_value = getattr(value, field)
    if isinstance(field_value, jax.core.Tracer):
      return "..."
    return repr(np.asarray(field_value).item())

  fields = ("loss_scale", "counter", "period", "factor", "min_loss_scale")
  args = ", ".join(f"{f}={plain(f)}" for f in fields if hasattr(value, f))
  return (
      f" That is jmp's {kind}, which jaxmp does not run: write "
      f"jaxmp.{kind}({args}). Or import jaxmp as jmp instead of jmp, which "
      f"makes jmp.{kind}(...) jaxmp's."
  )


class PrecisionWarning(UserWarning):
  """A half-precision policy that does not take effect: the matmuls run in float32.

  :meth:`jaxmp.flax.TrainState.value_and_grad` with ``audit=True`` raises it
  at trace time (once per compilation), naming the cause and the layers; a
  wrapped Linen apply (``policy.wrap_apply``, ``state.apply_fn``) raises it
  for each trace in which a module's own ``dtype=`` wins over the policy.
  Filter or escalate it with the :mod:`warnings` module.

  Example:
    >>> import warnings, jaxmp
    >>> issubclass(jaxmp.PrecisionWarning, UserWarning)
    True
    >>> with warnings.catch_warnings():  # fail instead of warning, e.g. in CI
    ...   warnings.simplefilter("error", jaxmp.PrecisionWarning)
  """


def listing(items: Iterable[str], separator: str = ", ", shown: int = 6) -> str:
  """The first ``shown`` items joined by ``separator``, then "and N more".

  Example:
    >>> listing(["a", "b", "c"], shown=2)
    'a, b and 1 more'
  """
  items = list(items)
  text = separator.join(items[:shown])
  return text + (f" and {len(items) - shown} more" if len(items) > shown else "")


# Frames of these packages are skipped when a warning looks for the user's line.
_LIBRARY_PREFIXES = ("jaxmp.", "jax.", "flax.", "optax.")


def caller_stacklevel() -> int:
  """The ``stacklevel`` of the first frame outside jaxmp, JAX, Flax and optax.

  The one stack walk of jaxmp: a warning raised with it points at the user's
  line, however deep inside the libraries it was raised.
  """
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and (
      frame.f_globals.get("__name__", "") + ".").startswith(_LIBRARY_PREFIXES):
    frame, level = frame.f_back, level + 1
  return level
