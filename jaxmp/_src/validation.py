"""Validation of configuration values: one checker per kind of value, one wording.

``TypeError`` for a value of the wrong kind (a string, ``None``, a bool where
a number is expected), ``ValueError`` for one of the right kind outside its
range; every message starts with its owner and may end with advice.
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
  """A Python number for a real Python, NumPy or concrete 0-d array number; else None."""
  if isinstance(value, (bool, np.bool_, jax.core.Tracer)):
    return None
  if isinstance(value, numbers.Real):
    return value.item() if isinstance(value, np.generic) else value
  if isinstance(value, (np.ndarray, jax.Array)) and value.shape == () and (
      _is_real_dtype(value.dtype)):
    return np.asarray(value).item()
  return None


def _is_real_dtype(dtype: Any, *, integer: bool = False) -> bool:
  """Whether ``dtype`` is an integer dtype or (unless ``integer``) a floating one."""
  return bool(jnp.issubdtype(dtype, jnp.integer) or (
      not integer and jnp.issubdtype(dtype, jnp.floating)))


def _bound(x: float) -> str:
  return str(int(x)) if float(x).is_integer() and abs(x) < 2**53 else f"{x:g}"


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
  """Returns ``value`` (a Python or NumPy number or a concrete 0-d array) as an int or float.

  nan is refused, and so is an infinite value unless ``maximum`` is
  ``math.inf``; ``advice`` ends every message.

  Raises:
    TypeError: if ``value`` is not a real number (or not whole when ``integer``).
    ValueError: if it is nan, infinite, or outside the range.
  """
  fail = lambda kind, error, got: error(f"{owner}: {name} must be {kind}, got {got}."
                                        + (f" {advice}" if advice else ""))
  kind = "an integer" if integer else "a number"
  number = _as_real(value)
  if number is None:
    raise fail(kind, TypeError, "a traced value (configuration is static: pass a "
               "Python number)" if isinstance(value, jax.core.Tracer)
               else f"{value!r} of type {type(value).__name__}")
  if math.isnan(number):
    raise fail(kind, ValueError, "nan")
  if math.isinf(number) and maximum != math.inf:
    raise fail("finite", ValueError, number)
  if integer and not float(number).is_integer():
    raise fail(kind, TypeError, repr(value))
  number = int(number) if integer else float(number)
  low_ok = minimum is None or (number > minimum if exclusive_minimum else number >= minimum)
  high_ok = maximum is None or (number < maximum if exclusive_maximum else number <= maximum)
  if not (low_ok and high_ok):
    parts = [] if minimum is None else [f"{'>' if exclusive_minimum else '>='} {_bound(minimum)}"]
    if maximum not in (None, math.inf):
      parts.append(f"{'<' if exclusive_maximum else '<='} {_bound(maximum)}")
    raise fail(f"{kind} {' and '.join(parts)}" if parts else kind, ValueError, repr(value))
  return number


def check_bool(owner: str, name: str, value: Any, *, advice: str = "") -> bool:
  """Returns ``value`` as a Python bool; a ``TypeError`` for anything but a bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"{owner}: {name} must be True or False, got {value!r} of type "
        f"{type(value).__name__}." + (f" {advice}" if advice else ""))
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
  """Returns ``value`` as a scalar state array of ``dtype`` (a loss scale, a counter).

  A concrete value is checked as :func:`check_number` checks it, within
  ``[minimum, maximum]`` and the range of ``dtype``, and returned as a NumPy
  array (or as the given JAX array when it already has ``dtype`` and is not
  weakly typed, so that it stays where it is). A traced value, or one spread
  over several processes, is checked by shape and dtype kind and converted.

  Raises:
    TypeError: for a non-scalar, a value of the wrong kind, or a traced
      value whose dtype does not convert without loss.
    ValueError: if a concrete value is nan, infinite or outside the range.
  """
  dtype = np.dtype(dtype)
  integer = dtype.kind in "iu"
  info = np.iinfo(dtype) if integer else np.finfo(dtype)
  minimum = float(info.min) if minimum is None else max(minimum, float(info.min))
  maximum = float(info.max) if maximum is None else min(maximum, float(info.max))
  tail = f" {advice}" if advice else ""
  shape = getattr(value, "shape", ())
  if shape != ():
    raise TypeError(
        f"{owner}: {name} must be a scalar, got an array of shape {tuple(shape)}.{tail}")
  if isinstance(value, jax.core.Tracer) or (
      isinstance(value, jax.Array) and not value.is_fully_addressable):
    if not _is_real_dtype(value.dtype, integer=integer):
      raise TypeError(
          f"{owner}: {name} must be {'an integer' if integer else 'a number'}, "
          f"got a traced {np.dtype(value.dtype)} value. Pass an array of dtype "
          f"{dtype}.{tail}")
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
  plain = lambda v: "..." if isinstance(v, jax.core.Tracer) else repr(np.asarray(v).item())
  fields = ("loss_scale", "counter", "period", "factor", "min_loss_scale")
  args = ", ".join(f"{f}={plain(getattr(value, f))}" for f in fields if hasattr(value, f))
  return (
      f" That is jmp's {kind}, which jaxmp does not run: write "
      f"jaxmp.{kind}({args}). Or import jaxmp as jmp instead of jmp, which "
      f"makes jmp.{kind}(...) jaxmp's.")


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


def caller_stacklevel() -> int:
  """The ``stacklevel`` of the first frame outside jaxmp, JAX, Flax and optax.

  The one stack walk of jaxmp: a warning raised with it points at the user's line.
  """
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None and (frame.f_globals.get("__name__", "") + ".").startswith(
      ("jaxmp.", "jax.", "flax.", "optax.")):
    frame, level = frame.f_back, level + 1
  return level
