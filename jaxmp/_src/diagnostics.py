"""Diagnostics: which leaves overflowed, gradient statistics, dtype headroom.

:func:`nonfinite_paths` is host-side (inside ``jit``, call it from a
``jax.debug.callback`` in the non-finite branch of a ``lax.cond``, so that
good steps transfer nothing). :func:`grad_stats`, :func:`dtype_headroom` and
:func:`suggest_loss_scale` work inside ``jit``. Paths are written as
``jax.tree_util.keystr`` writes them, e.g. ``['dense']['kernel']``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.loss_scale import at_least_float32
from jaxmp._src.policy import floating_dtype, is_floating_array


def _is_inexact(x: Any) -> bool:
  """Whether ``x`` is a floating or complex array, or a Python float or complex."""
  return is_floating_array(x, include_complex=True) or isinstance(x, (float, complex))


def _float_leaves(tree: Any) -> list[jax.Array]:
  """The floating (and complex) leaves of ``tree``, as arrays."""
  return [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree) if _is_inexact(x)]


def _wide(x: jax.Array) -> jax.Array:
  """``x`` in at least float32 (float64 stays), magnitudes for complex."""
  if jnp.issubdtype(x.dtype, jnp.complexfloating):
    x = jnp.abs(x)
  return x.astype(at_least_float32(x.dtype))


def nonfinite_paths(tree: Any) -> list[str]:
  """Returns the paths of the leaves of ``tree`` that hold inf or nan.

  Host-side: it reads every floating leaf from the device. Call it outside
  ``jit`` (on a batch, or on gradients kept from a skipped step), or inside a
  jitted step from a ``jax.debug.callback`` in the non-finite branch of a
  ``lax.cond``, so that only a step with inf or nan transfers anything (second
  example). Integer, boolean and non-array leaves are never reported.

  Args:
    tree: a pytree.

  Returns:
    The paths, as ``jax.tree_util.keystr`` writes them, in leaf order.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.zeros(2)},
    ...          "norm": {"scale": jnp.array([jnp.nan])}}
    >>> jaxmp.nonfinite_paths(grads)
    ["['dense']['kernel']", "['norm']['scale']"]
    >>> import jax
    >>> seen = []
    >>> @jax.jit
    ... def check(grads):
    ...   report = lambda g: seen.append(jaxmp.nonfinite_paths(g))
    ...   jax.lax.cond(jaxmp.all_finite(grads), lambda g: None,
    ...                lambda g: jax.debug.callback(report, g), grads)
    >>> check({"w": jnp.ones(2)}); check(grads); jax.effects_barrier(); seen
    [["['dense']['kernel']", "['norm']['scale']"]]
  """
  paths = []
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not _is_inexact(leaf):
      continue
    value = np.asarray(jax.device_get(leaf))
    if not np.all(np.isfinite(value)):
      paths.append(jax.tree_util.keystr(path))
  return paths


def grad_stats(tree: Any) -> dict[str, jax.Array]:
  """Returns summary statistics of the floating leaves of ``tree``; jit-safe.

  Computed in float32 (float64 leaves stay float64), so float16 gradients do
  not overflow while squared. Non-floating leaves are ignored.

  Args:
    tree: a pytree, e.g. the gradients.

  Returns:
    A dict of scalar arrays:

    * ``global_norm``: the L2 norm over all leaves (inf or nan when a value
      is);
    * ``max_abs``: the largest absolute value (nan when a value is nan);
    * ``nonfinite_count``: the number of inf and nan values (int32);
    * ``zero_fraction``: the fraction of values that are exactly zero (0 for
      an empty tree).

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> stats = jax.jit(jaxmp.grad_stats)(
    ...     {"a": jnp.array([3.0, 0.0]), "b": jnp.array([4.0, 0.0], jnp.float16)})
    >>> {k: float(v) for k, v in stats.items()}
    {'global_norm': 5.0, 'max_abs': 4.0, 'nonfinite_count': 0.0, 'zero_fraction': 0.5}
  """
  leaves = [_wide(x) for x in _float_leaves(tree)]
  if not leaves:
    return {
        "global_norm": jnp.zeros([], jnp.float32),
        "max_abs": jnp.zeros([], jnp.float32),
        "nonfinite_count": jnp.zeros([], jnp.int32),
        "zero_fraction": jnp.zeros([], jnp.float32),
    }
  dtype = jnp.result_type(*[x.dtype for x in leaves])
  leaves = [x.astype(dtype) for x in leaves]
  size = sum(x.size for x in leaves)
  sum_squares = sum(jnp.sum(jnp.square(x)) for x in leaves)
  max_abs = jnp.max(jnp.stack([
      jnp.max(jnp.abs(x), initial=0.0) if x.size else jnp.zeros([], dtype)
      for x in leaves
  ]))
  # Propagate nan explicitly, whatever the reduction does with it.
  any_nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in leaves]))
  nonfinite = sum(jnp.sum(~jnp.isfinite(x), dtype=jnp.int32) for x in leaves)
  zeros = sum(jnp.sum(x == 0, dtype=jnp.int32) for x in leaves)
  return {
      "global_norm": jnp.sqrt(sum_squares),
      "max_abs": jnp.where(any_nan, jnp.asarray(jnp.nan, dtype), max_abs),
      "nonfinite_count": jnp.asarray(nonfinite, jnp.int32),
      "zero_fraction": zeros.astype(dtype) / np.asarray(max(size, 1), dtype),
  }


def _thresholds(dtype: Any) -> tuple[float, float, float]:
  """Magnitudes at which a cast to ``dtype`` (round to nearest) overflows,
  flushes to zero, or stops being subnormal."""
  info = jnp.finfo(dtype)
  largest = float(info.max)
  half_ulp_at_max = math.ldexp(float(info.eps), info.maxexp - 1) / 2
  half_smallest = float(info.smallest_subnormal) / 2
  return largest + half_ulp_at_max, half_smallest, float(info.tiny) - half_smallest


def dtype_headroom(tree: Any, dtype: Any) -> dict[str, jax.Array]:
  """Fractions of the values of ``tree`` that a cast to ``dtype`` would spoil.

  Jit-safe. Each finite value is classified by the magnitude at which
  round-to-nearest would turn it into inf (or nan for formats without inf),
  into zero, or into a subnormal of ``dtype``. Comparisons are made in float32
  (float64 inputs in float64); backends that flush float32 subnormals treat
  such inputs as zero.

  Args:
    tree: a pytree; only its floating leaves are counted.
    dtype: the target dtype, e.g. ``jnp.float16``.

  Returns:
    A dict of float32 scalar fractions of all floating values:

    * ``overflow``: finite values that would become inf or nan;
    * ``underflow``: non-zero values that would become zero;
    * ``subnormal``: values that would become subnormal (losing precision);
    * ``nonfinite``: values that already are inf or nan.

  Raises:
    ValueError: if ``dtype`` is a dtype but not a floating one (``jnp.int8``).
    TypeError: if ``dtype`` is not a dtype at all.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> x = jnp.array([1e5, 1e-8, 1e-6, 1.0])
    >>> {k: float(v) for k, v in jaxmp.dtype_headroom(x, jnp.float16).items()}
    {'overflow': 0.25, 'underflow': 0.25, 'subnormal': 0.25, 'nonfinite': 0.0}
  """
  target = floating_dtype(dtype, "dtype_headroom")
  overflow_at, zero_at, normal_at = _thresholds(target)
  counts = {"overflow": 0, "underflow": 0, "subnormal": 0, "nonfinite": 0}
  size = 0
  for x in _float_leaves(tree):
    x = _wide(x)
    size += x.size
    magnitude = jnp.abs(x)
    finite = jnp.isfinite(x)
    # Thresholds beyond the compared dtype's range become inf (never reached).
    over = np.asarray(
        np.inf if overflow_at > float(jnp.finfo(x.dtype).max) else overflow_at,
        x.dtype,
    )
    zero = np.asarray(zero_at, x.dtype)
    normal = np.asarray(normal_at, x.dtype)
    masks = {
        "overflow": finite & (magnitude >= over),
        "underflow": (magnitude != 0) & (magnitude <= zero),
        "subnormal": (magnitude > zero) & (magnitude < normal),
        "nonfinite": ~finite,
    }
    for key, mask in masks.items():
      counts[key] = counts[key] + jnp.sum(mask, dtype=jnp.int32)
  denominator = np.float32(max(size, 1))
  return {
      key: jnp.asarray(count, jnp.float32) / denominator
      for key, count in counts.items()
  }


def suggest_loss_scale(grads: Any, dtype: Any = jnp.float16) -> jax.Array:
  """The largest power of two that keeps the largest gradient finite in ``dtype``.

  Jit-safe. ``grads`` are the gradients of the *unscaled* loss (computed in
  float32, for instance on a few batches before training); the result ``s``
  is the largest ``2**k`` with ``max|g| * s <= finfo(dtype).max``, clipped to
  float32's normal range ``[2**-126, 2**127]`` (so all-zero gradients give
  ``2**127``). Gradients holding inf or nan give nan. Start a
  :class:`jaxmp.DynamicLossScale` at or below it.

  Args:
    grads: a pytree of gradients; non-floating leaves are ignored.
    dtype: the dtype the scaled gradients must fit, by default float16.

  Returns:
    A float32 scalar array.

  Raises:
    ValueError: if ``dtype`` is a dtype but not a floating one (``jnp.int8``).
    TypeError: if ``dtype`` is not a dtype at all.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> float(jaxmp.suggest_loss_scale({"w": jnp.array([1e-3, -0.5])}))
    65536.0
  """
  largest = float(jnp.finfo(floating_dtype(dtype, "suggest_loss_scale")).max)
  stats = grad_stats(grads)
  max_abs = stats["max_abs"].astype(jnp.float32)
  estimate = jnp.floor(np.float32(math.log2(largest)) - jnp.log2(max_abs))
  power = jnp.clip(jnp.nan_to_num(estimate, posinf=127.0), -126, 127).astype(jnp.int32)
  # Correct the float rounding of the logarithms by one step either way.
  power = jnp.where(jnp.ldexp(max_abs, power + 1) <= largest, power + 1, power)
  power = jnp.where(jnp.ldexp(max_abs, power) > largest, power - 1, power)
  power = jnp.clip(power, -126, 127)
  scale = jnp.ldexp(jnp.ones([], jnp.float32), power)
  return jnp.where(jnp.isfinite(max_abs), scale, jnp.float32(jnp.nan))
