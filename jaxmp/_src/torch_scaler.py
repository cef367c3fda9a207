"""PyTorch ``GradScaler`` settings as a jaxmp loss scale."""

from __future__ import annotations

import math
import numbers

from jaxmp._src.loss_scale import (
    INT32_MAX,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
)

# PyTorch's GradScaler never grows when ``growth_interval <= 0``. jaxmp's
# period is an int32 step count, so "never" is represented by the largest
# one: growth would need 2**31 - 1 consecutive finite steps.
NEVER_GROW_PERIOD = INT32_MAX


def from_torch_grad_scaler(
    init_scale: float = 65536.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
) -> LossScale:
  """Returns a loss scale that follows ``torch.amp.GradScaler`` step for step.

  The arguments are those of ``torch.amp.GradScaler`` (without ``device``:
  JAX places the state). The result is a :class:`jaxmp.DynamicLossScale`
  with ``factor=growth_factor``, ``backoff_factor``, ``period=growth_interval``
  and ``min_loss_scale=0`` (PyTorch has no floor). As in PyTorch:

  * the scale grows on the ``growth_interval``-th consecutive finite step, and
    a growth whose result is not finite is refused (the counter still resets);
  * every overflow multiplies the scale by ``backoff_factor``;
  * the float32 scale is multiplied by the factor in double precision and
    rounded once, which matters for factors such as 0.1 or 1.1.

  ``growth_interval <= 0`` never grows in PyTorch; here it gives a period of
  ``2**31 - 1`` steps (:data:`NEVER_GROW_PERIOD`), which no run reaches.
  ``enabled=False`` gives :class:`jaxmp.NoOpLossScale`.

  One difference: the scale never backs off below ``2**-126``, the smallest
  normal float32 (backends such as the CPU flush smaller values to 0, after
  which no step could succeed); PyTorch walks on through the subnormals.
  Overflows at that floor are counted, so :func:`jaxmp.check_loss_scale`
  raises there.

  Args:
    init_scale: the initial scale.
    growth_factor: multiplier on growth, > 1.
    backoff_factor: multiplier on overflow, in (0, 1).
    growth_interval: consecutive finite steps before the scale grows.
    enabled: ``False`` disables loss scaling.

  Returns:
    A :class:`jaxmp.DynamicLossScale`, or :class:`jaxmp.NoOpLossScale` when
    ``enabled`` is false.

  Raises:
    TypeError: for non-numbers (e.g. a device name passed positionally).
    ValueError: for a non-positive or non-finite ``init_scale``,
      ``growth_factor <= 1`` or ``backoff_factor`` outside (0, 1).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.from_torch_grad_scaler(init_scale=1024.0, growth_interval=2)
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    2048.0
  """
  if not isinstance(enabled, bool):
    raise TypeError(f"from_torch_grad_scaler: enabled must be a bool, got {enabled!r}.")
  for name, value in (
      ("init_scale", init_scale),
      ("growth_factor", growth_factor),
      ("backoff_factor", backoff_factor),
      ("growth_interval", growth_interval),
  ):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      hint = (
          " It looks like a device name: jaxmp takes no device argument, drop it."
          if isinstance(value, str) else ""
      )
      raise TypeError(
          f"from_torch_grad_scaler: {name} must be a number, got {value!r}.{hint}"
      )
  if not enabled:
    return NoOpLossScale()
  if not (math.isfinite(init_scale) and init_scale > 0):
    raise ValueError(
        f"from_torch_grad_scaler: init_scale must be positive and finite, got "
        f"{init_scale!r}; PyTorch's default is 65536.0."
    )
  if not (math.isfinite(growth_factor) and growth_factor > 1):
    raise ValueError(
        f"from_torch_grad_scaler: growth_factor must be a finite number > 1, "
        f"got {growth_factor!r}; PyTorch's default is 2.0."
    )
  if not 0 < backoff_factor < 1:
    raise ValueError(
        f"from_torch_grad_scaler: backoff_factor must lie strictly between 0 "
        f"and 1, got {backoff_factor!r}; PyTorch's default is 0.5."
    )
  if not float(growth_interval).is_integer():
    raise TypeError(
        f"from_torch_grad_scaler: growth_interval must be an integer, got "
        f"{growth_interval!r}."
    )
  period = int(growth_interval)
  if period <= 0 or period > NEVER_GROW_PERIOD:
    period = NEVER_GROW_PERIOD
  return DynamicLossScale(
      float(init_scale),
      period=period,
      factor=float(growth_factor),
      min_loss_scale=0.0,
      backoff_factor=float(backoff_factor),
  )
