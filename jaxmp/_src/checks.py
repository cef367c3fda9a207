"""Host-side checks: :func:`check_loss_scale`, the metrics read to the host, and the one text of remedies."""

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

  DeepSpeed stops on this condition with "Current loss scale already at
  minimum - cannot decrease scale anymore".
  """


# What to do when float16 keeps overflowing (check_loss_scale, LossScaleMonitor).
REMEDIES = """\
What to do:
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
  """Reads the metrics ``keys`` of ``x`` to the host in one transfer.

  ``x`` is an optimizer state holding a :func:`jaxmp.loss_scaling` state, a
  loss scale or a metrics dict; each value comes back as a NumPy array (with
  the leading axes of a stacked state). Errors start with ``owner``.
  """
  if isinstance(x, LossScale):
    metrics, source = x.metrics(), "a loss scale"
  elif isinstance(x, dict) and any(k in x for k in keys) and not _find_states(x):
    metrics, source = x, "the metrics dict"
  else:
    metrics, source = metrics_of(_find_state(x, owner)), "the metrics"
  missing = [k for k in keys if k not in metrics]
  if missing:
    raise ValueError(
        f"{owner}: {source} has no {', '.join(repr(k) for k in missing)} "
        f"key{'s' if len(missing) > 1 else ''}. {_METRICS_FIX}")
  arrays = {k: np.asarray(v) for k, v in jax.device_get({k: metrics[k] for k in keys}).items()}
  for key, array in arrays.items():
    if array.dtype.kind not in "biuf":
      raise TypeError(
          f"{owner}: the metric {key!r} must be a number or an array of "
          f"numbers, got {metrics[key]!r}. {_METRICS_FIX}")
  return arrays


def check_loss_scale(x: Any, *, max_overflows_at_min: int = 0) -> None:
  """Raises when more overflows happened at the minimum scale than allowed.

  Host-side, outside ``jit``, every N steps: ``x`` is an optimizer state, a
  loss scale or the dict of :func:`loss_scaling_metrics` (two scalars are
  read). A stacked state (``pmap``, ``vmap``) is checked member by member and
  the error names the worst member.

  Raises:
    LossScaleAtMinimumError: with a message that says what to do.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> ls = jaxmp.DynamicLossScale(1.0, min_loss_scale=1.0)
    >>> jaxmp.check_loss_scale(ls)  # no overflow yet: nothing happens
    >>> try:
    ...   jaxmp.check_loss_scale(ls.adjust(jnp.array(False)))
    ... except jaxmp.LossScaleAtMinimumError as e:
    ...   print(str(e).splitlines()[0])
    Current loss scale already at minimum (1.0): 1 overflow(s) at the minimum scale.
  """
  max_overflows_at_min = check_number(
      "check_loss_scale", "max_overflows_at_min", max_overflows_at_min,
      integer=True, minimum=0,
      advice="It is the number of overflows at the minimum scale to tolerate.")
  values = metrics_on_host(x, ("overflows_at_min", "loss_scale"), "check_loss_scale")
  overflows, scales = np.broadcast_arrays(values["overflows_at_min"], values["loss_scale"])
  worst = np.unravel_index(np.argmax(overflows), overflows.shape)
  if int(overflows[worst]) <= max_overflows_at_min:
    return
  member = ""
  if overflows.shape:
    where = int(worst[0]) if len(worst) == 1 else tuple(int(i) for i in worst)
    member = f" (member {where} of the {'x'.join(map(str, overflows.shape))} stacked states)"
  raise LossScaleAtMinimumError(
      f"Current loss scale already at minimum ({float(scales[worst])}): "
      f"{int(overflows[worst])} overflow(s) at the minimum scale{member}.\n"
      "float16 cannot represent these gradients even at the smallest loss "
      f"scale. {REMEDIES}")
