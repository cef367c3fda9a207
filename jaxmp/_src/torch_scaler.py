"""PyTorch ``GradScaler`` settings as a jaxmp loss scale."""

from __future__ import annotations

from jaxmp._src.loss_scale import (
    INT32_MAX,
    DynamicLossScale,
    LossScale,
    NoOpLossScale,
)
from jaxmp._src.validation import check_bool, check_number

# PyTorch's GradScaler never grows when ``growth_interval <= 0``. jaxmp's
# period is an int32 step count, so "never" is represented by the largest
# one: growth would need 2**31 - 1 consecutive finite steps.
NEVER_GROW_PERIOD = INT32_MAX


# torch.device types, which GradScaler takes as its first argument.
_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "xla", "hpu", "npu", "mtia", "meta")


def _is_number(text: str) -> bool:
  try:
    float(text)
  except ValueError:
    return False
  return True


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
    TypeError: for non-numbers (e.g. a device name passed positionally, or
      a number in quotes), a non-integer ``growth_interval`` or a non-bool
      ``enabled``.
    ValueError: for a non-positive or non-finite ``init_scale``,
      ``growth_factor <= 1`` or ``backoff_factor`` outside (0, 1), also with
      ``enabled=False`` (PyTorch checks the factors only when enabled).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.from_torch_grad_scaler(init_scale=1024.0, growth_interval=2)
    >>> ls = ls.adjust(jnp.array(True)).adjust(jnp.array(True))
    >>> float(ls.loss_scale)
    2048.0
  """
  owner = "from_torch_grad_scaler"
  enabled = check_bool(owner, "enabled", enabled, advice="PyTorch's default is True.")
  values = {}
  for name, value, default, bounds in (
      ("init_scale", init_scale, "65536.0", dict(minimum=0, exclusive_minimum=True)),
      ("growth_factor", growth_factor, "2.0", dict(minimum=1, exclusive_minimum=True)),
      ("backoff_factor", backoff_factor, "0.5",
       dict(minimum=0, maximum=1, exclusive_minimum=True, exclusive_maximum=True)),
      ("growth_interval", growth_interval, "2000", dict(integer=True)),
  ):
    advice = f"PyTorch's default is {default}."
    if isinstance(value, str) and _is_number(value):
      advice = f"Pass a number, not a string: {name}={value.strip()}."
    elif isinstance(value, str) and value.split(":")[0].lower() in _DEVICE_TYPES:
      advice = "It looks like a device name: jaxmp takes no device argument, drop it."
    values[name] = check_number(owner, name, value, advice=advice, **bounds)
  if not enabled:
    return NoOpLossScale()
  period = values["growth_interval"]
  if period <= 0 or period > NEVER_GROW_PERIOD:
    period = NEVER_GROW_PERIOD
  return DynamicLossScale(
      values["init_scale"],
      period=period,
      factor=values["growth_factor"],
      min_loss_scale=0.0,
      backoff_factor=values["backoff_factor"],
  )
