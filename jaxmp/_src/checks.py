"""Host-side checks: :func:`check_loss_scale` and the one text of remedies."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import _find_state, _find_states, metrics_of
from jaxmp._src.validation import check_number


class LossScaleAtMinimumError(RuntimeError):
  """Raised by :func:`check_loss_scale` when fp16 training can no longer work.

  This is the condition on which DeepSpeed stops with "Current loss scale
  already at minimum - cannot decrease scale anymore".
  """


_REMEDIES = """\
float16 cannot represent these gradients even at the smallest loss scale. What to do:
  1. Switch to bfloat16, which has float32's range and needs no loss scaling,
     where the hardware runs it (TPU, NVIDIA compute capability >= 8.0):
     policy = jaxmp.auto_policy()  (or jaxmp.get_policy("mixed_bfloat16")),
     with jaxmp.NoOpLossScale(). Run `jaxmp doctor` to see what your hardware supports.
  2. Lower the learning rate, or add warm-up: diverging weights produce inf activations.
  3. Clip gradients inside the wrapped optimizer, e.g.
     jaxmp.loss_scaling(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)), scale).
  4. Look for bad data (inf/nan inputs or labels): jaxmp.nonfinite_paths(batch) lists them.
  5. Keep numerically sensitive layers (LayerNorm, softmax, the loss) in float32."""

_METRICS_FIX = ("Pass the dict returned by jaxmp.loss_scaling_metrics(opt_state), "
                "or the optimizer state itself.")


def metrics_on_host(x: Any, keys: Sequence[str], owner: str) -> dict[str, np.ndarray]:
  """Reads the loss-scaling metrics named ``keys`` from ``x`` to the host.

  One device-to-host transfer. Each value is a NumPy array: of shape ``()``
  for an ordinary state, or with the leading axes of a stacked state (a
  ``pmap``-replicated or ``vmap``-ped one).

  Args:
    x: an optimizer state holding a :func:`jaxmp.loss_scaling` state, a loss
      scale, or a dict of metrics (from :func:`jaxmp.loss_scaling_metrics`).
    keys: the metrics to read.
    owner: who reads; starts the error messages.

  Raises:
    ValueError: if ``x`` holds no loss-scaling state, or a metrics dict lacks
      one of ``keys``.
    TypeError: if a metric is not numeric.
  """
  if isinstance(x, LossScale):
    metrics, source = x.metrics(), "a loss scale"
  elif (isinstance(x, dict) and any(k in x for k in keys)
        and not _find_states(x)):
    metrics, source = x, "the metrics dict"
  else:
    metrics, source = metrics_of(_find_state(x, owner)), "the metrics"
  missing = [k for k in keys if k not in metrics]
  if missing:
    raise ValueError(
        f"{owner}: {source} has no {', '.join(repr(k) for k in missing)} "
        f"key{'s' if len(missing) > 1 else ''}. {_METRICS_FIX}"
    )
  values = jax.device_get({k: metrics[k] for k in keys})
  arrays = {}
  for key, value in values.items():
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
      raise TypeError(
          f"{owner}: the metric {key!r} must be a number or an array of "
          f"numbers, got {value!r}. {_METRICS_FIX}"
      )
    arrays[key] = array
  return arrays


def member_text(index: tuple[int, ...], shape: tuple[int, ...]) -> str:
  """`` (member 3 of the 8 stacked states)``, or ``""`` for an unstacked one."""
  if not shape:
    return ""
  where = index[0] if len(index) == 1 else index
  return f" (member {where} of the {'x'.join(map(str, shape))} stacked states)"


def check_loss_scale(x: Any, *, max_overflows_at_min: int = 0) -> None:
  """Raises when more overflows happened at the minimum scale than allowed.

  Host-side: call it outside ``jit``, every N steps, on an optimizer state, a
  loss scale or the dict of :func:`loss_scaling_metrics`. It reads two
  scalars from the device. A stacked state (``pmap``-replicated, or
  ``vmap``-ped over several runs) is checked member by member; the error
  names the worst member (the most overflows at the minimum).

  Args:
    x: an optimizer state holding a :func:`loss_scaling` state, a loss scale,
      or the metrics dict.
    max_overflows_at_min: how many overflows at the minimum scale to tolerate.

  Raises:
    LossScaleAtMinimumError: with a message that says what to do.
    ValueError: if ``x`` holds no loss scale, or a metrics dict lacks
      ``overflows_at_min`` or ``loss_scale``.
    TypeError: if ``max_overflows_at_min`` is not an integer.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.DynamicLossScale(1.0, min_loss_scale=1.0)
    >>> jaxmp.check_loss_scale(ls)  # no overflow yet: nothing happens
    >>> ls = ls.adjust(jnp.array(False))
    >>> try:
    ...   jaxmp.check_loss_scale(ls)
    ... except jaxmp.LossScaleAtMinimumError as e:
    ...   print(str(e).splitlines()[0])
    Current loss scale already at minimum (1.0): 1 overflow(s) at the minimum scale.
  """
  max_overflows_at_min = check_number(
      "check_loss_scale", "max_overflows_at_min", max_overflows_at_min,
      integer=True, minimum=0,
      advice="It is the number of overflows at the minimum scale to tolerate.")
  values = metrics_on_host(x, ("overflows_at_min", "loss_scale"), "check_loss_scale")
  overflows, scales = np.broadcast_arrays(
      values["overflows_at_min"], values["loss_scale"])
  worst = np.unravel_index(np.argmax(overflows), overflows.shape)
  if int(overflows[worst]) > max_overflows_at_min:
    raise LossScaleAtMinimumError(
        f"Current loss scale already at minimum ({float(scales[worst])}): "
        f"{int(overflows[worst])} overflow(s) at the minimum scale"
        f"{member_text(tuple(int(i) for i in worst), overflows.shape)}.\n"
        + _REMEDIES
    )
