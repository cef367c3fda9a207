"""PyTorch ``GradScaler`` settings as a jaxmp loss scale."""

from __future__ import annotations

from jaxmp._src.loss_scale import INT32_MAX, DynamicLossScale, LossScale, NoOpLossScale
from jaxmp._src.validation import check_bool, check_number

# PyTorch never grows when ``growth_interval <= 0``; jaxmp's period is an
# int32 step count, so "never" is the largest one.
NEVER_GROW_PERIOD = INT32_MAX

# torch.device types, which GradScaler takes as its first argument.
_DEVICE_TYPES = ("cuda", "cpu", "mps", "xpu", "xla", "hpu", "npu", "mtia", "meta")


def from_torch_grad_scaler(
    init_scale: float = 65536.0,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    enabled: bool = True,
) -> LossScale:
  """Returns a loss scale that follows ``torch.amp.GradScaler`` step for step.

  The arguments are ``GradScaler``'s (without ``device``). The result is a
  :class:`jaxmp.DynamicLossScale` with ``factor=growth_factor``,
  ``backoff_factor``, ``period=growth_interval`` and no floor; the factors
  are applied in double precision and rounded once, as PyTorch does.
  ``growth_interval <= 0`` (never grow) gives a period of
  :data:`NEVER_GROW_PERIOD`; ``enabled=False`` gives
  :class:`jaxmp.NoOpLossScale`. One difference: the scale stops at
  ``2**-126``, where PyTorch walks on through the subnormals.

  Raises:
    TypeError: for a non-number (a device name, a number in quotes), a
      fractional ``growth_interval`` or a non-bool ``enabled``.
    ValueError: for a value out of range, also with ``enabled=False``.

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
    if isinstance(value, str):
      advice = ("It looks like a device name: jaxmp takes no device argument, drop it."
                if value.split(":")[0].lower() in _DEVICE_TYPES
                else f"Pass a number, not a string: {name}={value.strip()}.")
    values[name] = check_number(owner, name, value, advice=advice, **bounds)
  if not enabled:
    return NoOpLossScale()
  period = values["growth_interval"]
  return DynamicLossScale(
      values["init_scale"], period=period if 0 < period <= NEVER_GROW_PERIOD else NEVER_GROW_PERIOD,
      factor=values["growth_factor"], min_loss_scale=0.0, backoff_factor=values["backoff_factor"])
