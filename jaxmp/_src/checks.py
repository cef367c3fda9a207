"""Host-side checks: :func:`check_loss_scale` and the one text of remedies."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import _find_state, _find_states


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


def check_loss_scale(x: Any, *, max_overflows_at_min: int = 0) -> None:
  """Raises when more overflows happened at the minimum scale than allowed.

  Host-side: call it outside ``jit``, every N steps, on an optimizer state, a
  loss scale or the dict of :func:`loss_scaling_metrics`. It reads one scalar
  from the device.

  Args:
    x: an optimizer state holding a :func:`loss_scaling` state, a loss scale,
      or the metrics dict.
    max_overflows_at_min: how many overflows at the minimum scale to tolerate.

  Raises:
    LossScaleAtMinimumError: with a message that says what to do.
    ValueError: if ``x`` holds no loss scale.

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
  if (isinstance(max_overflows_at_min, (bool, np.bool_))
      or not isinstance(max_overflows_at_min, (int, np.integer))
      or max_overflows_at_min < 0):
    raise ValueError(
        "check_loss_scale: max_overflows_at_min must be an integer >= 0 (the "
        "number of overflows at the minimum scale to tolerate), got "
        f"{max_overflows_at_min!r}."
    )
  if isinstance(x, dict) and "overflows_at_min" in x:
    metrics = x
  elif isinstance(x, LossScale):
    metrics = x.metrics()
  elif isinstance(x, dict) and "loss_scale" in x and not _find_states(x):
    raise ValueError(
        "check_loss_scale: the metrics dict has no 'overflows_at_min' key. Pass "
        "the dict returned by jaxmp.loss_scaling_metrics(opt_state)."
    )
  else:
    metrics = _find_state(x, "check_loss_scale").loss_scale.metrics()
  overflows, scale = jax.device_get(
      (metrics["overflows_at_min"], metrics["loss_scale"])
  )
  overflows = int(np.asarray(overflows))
  if overflows > max_overflows_at_min:
    raise LossScaleAtMinimumError(
        f"Current loss scale already at minimum ({float(np.asarray(scale))}): "
        f"{overflows} overflow(s) at the minimum scale.\n" + _REMEDIES
    )
