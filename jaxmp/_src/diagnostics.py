"""Diagnostics: which leaves overflowed, gradient statistics, dtype headroom.

:func:`nonfinite_paths` runs on the host; :func:`grad_stats`,
:func:`dtype_headroom` and :func:`suggest_loss_scale` work inside ``jit``.
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


def _wide_leaves(tree: Any) -> list[jax.Array]:
  """The floating (and complex, as magnitudes) leaves in at least float32."""
  leaves = [jnp.asarray(x) for x in jax.tree_util.tree_leaves(tree) if _is_inexact(x)]
  leaves = [jnp.abs(x) if jnp.iscomplexobj(x) else x for x in leaves]
  return [x.astype(at_least_float32(x.dtype)) for x in leaves]


def nonfinite_paths(tree: Any) -> list[str]:
  """Returns the ``jax.tree_util.keystr`` paths of the leaves of ``tree`` holding inf or nan.

  Host-side: it reads every floating leaf. Inside a jitted step, call it from
  a ``jax.debug.callback`` in the non-finite branch of a ``lax.cond``, so
  that only a bad step transfers anything.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> grads = {"dense": {"kernel": jnp.array([1.0, jnp.inf]), "bias": jnp.zeros(2)},
    ...          "norm": {"scale": jnp.array([jnp.nan])}}
    >>> jaxmp.nonfinite_paths(grads)
    ["['dense']['kernel']", "['norm']['scale']"]
    >>> seen = []
    >>> @jax.jit
    ... def check(grads):
    ...   report = lambda g: seen.append(jaxmp.nonfinite_paths(g))
    ...   jax.lax.cond(jaxmp.all_finite(grads), lambda g: None,
    ...                lambda g: jax.debug.callback(report, g), grads)
    >>> check({"w": jnp.ones(2)}); check(grads); jax.effects_barrier(); seen
    [["['dense']['kernel']", "['norm']['scale']"]]
  """
  return [jax.tree_util.keystr(path)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
          if _is_inexact(leaf) and not np.all(np.isfinite(jax.device_get(leaf)))]


def grad_stats(tree: Any) -> dict[str, jax.Array]:
  """Returns ``global_norm``, ``max_abs``, ``nonfinite_count`` and ``zero_fraction``; jit-safe.

  Computed in float32 (float64 stays), so float16 gradients do not overflow
  when squared; non-floating leaves are ignored. ``max_abs`` is nan when a
  value is, ``nonfinite_count`` an int32, and an empty tree gives zeros.

  Example:
    >>> import jax, jax.numpy as jnp, jaxmp
    >>> stats = jax.jit(jaxmp.grad_stats)(
    ...     {"a": jnp.array([3.0, 0.0]), "b": jnp.array([4.0, 0.0], jnp.float16)})
    >>> {k: float(v) for k, v in stats.items()}
    {'global_norm': 5.0, 'max_abs': 4.0, 'nonfinite_count': 0.0, 'zero_fraction': 0.5}
  """
  leaves = _wide_leaves(tree)
  dtype = jnp.result_type(*[x.dtype for x in leaves]) if leaves else jnp.float32
  leaves = [x.astype(dtype) for x in leaves] or [jnp.zeros(0, dtype)]
  total = lambda f, **kw: sum(jnp.sum(f(x), **kw) for x in leaves)
  max_abs = jnp.max(jnp.stack([jnp.max(jnp.abs(x), initial=0.0) for x in leaves]))
  any_nan = jnp.any(jnp.stack([jnp.any(jnp.isnan(x)) for x in leaves]))
  size = sum(x.size for x in leaves)
  return {
      "global_norm": jnp.sqrt(total(jnp.square)),
      "max_abs": jnp.where(any_nan, jnp.asarray(jnp.nan, dtype), max_abs),
      "nonfinite_count": total(lambda x: ~jnp.isfinite(x), dtype=jnp.int32),
      "zero_fraction": total(lambda x: x == 0, dtype=jnp.int32).astype(dtype)
                       / np.asarray(max(size, 1), dtype),
  }


def dtype_headroom(tree: Any, dtype: Any) -> dict[str, jax.Array]:
  """Fractions of the floating values of ``tree`` that a cast to ``dtype`` would spoil.

  Jit-safe. By the round-to-nearest thresholds of ``dtype``: ``overflow``
  (finite values that would become inf or nan), ``underflow`` (non-zero
  values that would become zero), ``subnormal`` (kept with less precision)
  and ``nonfinite`` (already inf or nan), as float32 scalars. Compared in
  float32 (float64 stays float64).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> x = jnp.array([1e5, 1e-8, 1e-6, 1.0])
    >>> {k: float(v) for k, v in jaxmp.dtype_headroom(x, jnp.float16).items()}
    {'overflow': 0.25, 'underflow': 0.25, 'subnormal': 0.25, 'nonfinite': 0.0}
  """
  info = jnp.finfo(floating_dtype(dtype, "dtype_headroom"))
  half_smallest = float(info.smallest_subnormal) / 2
  # The magnitudes at which a cast overflows, flushes to zero, stays subnormal.
  overflow_at = float(info.max) + math.ldexp(float(info.eps), info.maxexp - 1) / 2
  normal_at = float(info.tiny) - half_smallest
  counts = dict.fromkeys(("overflow", "underflow", "subnormal", "nonfinite"), 0)
  size = 0
  for x in _wide_leaves(tree):
    size += x.size
    magnitude, finite = jnp.abs(x), jnp.isfinite(x)
    # A threshold beyond the compared dtype's range is never reached.
    over, zero, normal = (np.asarray(t, x.dtype) for t in (
        np.inf if overflow_at > float(jnp.finfo(x.dtype).max) else overflow_at,
        half_smallest, normal_at))
    masks = {
        "overflow": finite & (magnitude >= over),
        "underflow": (magnitude != 0) & (magnitude <= zero),
        "subnormal": (magnitude > zero) & (magnitude < normal),
        "nonfinite": ~finite,
    }
    counts = {k: counts[k] + jnp.sum(m, dtype=jnp.int32) for k, m in masks.items()}
  return {k: jnp.asarray(c, jnp.float32) / np.float32(max(size, 1)) for k, c in counts.items()}


def suggest_loss_scale(grads: Any, dtype: Any = jnp.float16) -> jax.Array:
  """The largest power of two that keeps the largest gradient finite in ``dtype``.

  Jit-safe. ``grads`` are gradients of the *unscaled* loss; the result is the
  largest ``2**k`` with ``max|g| * 2**k <= finfo(dtype).max``, clipped to
  ``[2**-126, 2**127]`` (all-zero gradients give ``2**127``, inf or nan
  give nan), as a float32 scalar. Start a :class:`jaxmp.DynamicLossScale` at
  or below it.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> float(jaxmp.suggest_loss_scale({"w": jnp.array([1e-3, -0.5])}))
    65536.0
  """
  largest = float(jnp.finfo(floating_dtype(dtype, "suggest_loss_scale")).max)
  max_abs = grad_stats(grads)["max_abs"].astype(jnp.float32)
  estimate = jnp.floor(np.float32(math.log2(largest)) - jnp.log2(max_abs))
  power = jnp.clip(jnp.nan_to_num(estimate, posinf=127.0), -126, 127).astype(jnp.int32)
  # Correct the float rounding of the logarithms by one step either way.
  power = jnp.where(jnp.ldexp(max_abs, power + 1) <= largest, power + 1, power)
  power = jnp.where(jnp.ldexp(max_abs, power) > largest, power - 1, power)
  scale = jnp.ldexp(jnp.ones([], jnp.float32), jnp.clip(power, -126, 127))
  return jnp.where(jnp.isfinite(max_abs), scale, jnp.float32(jnp.nan))
