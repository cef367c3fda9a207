"""Gradient accumulation with loss scaling, built on ``optax.MultiSteps``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import wrap_with_loss_scaling
from jaxmp._src.recovery import check_recovery, backed_off_after_fallback
from jaxmp._src.validation import check_number


def multi_steps(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    every_k_schedule: int | Callable[[jax.Array], jax.Array],
    *,
    axis_name: Any = None,
    clip_global_norm: float | None = None,
    guard: bool = True,
    **multi_steps_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps(jaxmp.loss_scaling(inner, loss_scale), k)``, made safe.

  Call ``update`` once per micro-batch with the gradients of the *scaled*
  loss, exactly as with ``optax.MultiSteps``. The loss scale stays constant
  within an accumulation, so the accumulated gradients share one scale; on the
  k-th micro-batch they are unscaled and checked. If any micro-batch of the
  accumulation was non-finite, the whole accumulated step is skipped (zero
  updates, inner state bit-identical), the scale backs off once, and the next
  accumulation starts from a clean, zero accumulator.

  **Recovery.** With gradients from
  ``jaxmp.scaled_value_and_grad(..., recover=jaxmp.Recover())``, pass
  ``update(grads, state, params, recovery=recovery)`` for each micro-batch. A
  micro-batch recovered at a backed-off scale makes the whole accumulation
  adopt that scale at once: the accumulator is rescaled by ``new / old`` (a
  power of two for the default factors, so exact barring underflow), the
  fallback's gradients (computed at scale 1) are multiplied by the new scale,
  both in float32, and the next micro-batches are computed at the new scale.
  ``recovered_steps`` and ``fallback_steps`` count micro-batches;
  ``skipped_steps`` and ``lost_steps`` count optimizer steps (a micro-batch
  lost even after recovery loses its accumulation, as above).

  ``optax.MultiSteps`` alone resets its accumulator by multiplying it by zero,
  which keeps a nan (``0 * nan = nan``): one bad micro-batch would make every
  later accumulated step non-finite. This wrapper zeroes the accumulator with
  ``jnp.where`` after each emitted step instead.

  The state is ``optax.MultiStepsState``: ``jaxmp.get_loss_scale``,
  ``jaxmp.loss_scaling_metrics`` and ``optax.MultiSteps.has_updated`` read it.

  Args:
    inner: the optimizer to wrap (clipping and schedules inside).
    loss_scale: the initial loss scale.
    every_k_schedule: the number of micro-batches per step, an int or a
      function of the step count, as in ``optax.MultiSteps``.
    axis_name: as in :func:`jaxmp.loss_scaling`.
    clip_global_norm: as in :func:`jaxmp.loss_scaling`: the accumulated,
      unscaled gradients are clipped to this global norm, and checked in the
      same reduction, on the k-th micro-batch.
    guard: as in :func:`jaxmp.loss_scaling` (``False`` only with
      :class:`jaxmp.NoOpLossScale`).
    **multi_steps_kwargs: passed to ``optax.MultiSteps`` (e.g.
      ``use_grad_mean``).

  Raises:
    TypeError: if ``every_k_schedule`` is neither a function nor an integer.
    ValueError: if it is an integer below 1; from ``init``, if ``inner`` is
      already wrapped with :func:`jaxmp.loss_scaling` (pass the bare
      optimizer).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.StaticLossScale(4.0), 2)
    >>> params = {"w": jnp.zeros(2)}
    >>> state = tx.init(params)
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 4.0])}, state, params)
    >>> updates, state = tx.update({"w": jnp.array([4.0, 4.0])}, state, params)
    >>> updates["w"], int(state.inner_opt_state.skipped_steps)  # step skipped
    (Array([-0., -0.], dtype=float32), 1)
    >>> state.acc_grads["w"]  # and the accumulator starts clean
    Array([0., 0.], dtype=float32)
  """
  if not callable(every_k_schedule):
    every_k_schedule = check_number(
        "multi_steps", "every_k_schedule", every_k_schedule, integer=True,
        minimum=1, advice="Pass the number of micro-batches per step, or a "
        "function of the step count.")
  accumulate = optax.MultiSteps(
      wrap_with_loss_scaling(
          inner, loss_scale, axis_name=axis_name, owner="jaxmp.multi_steps",
          clip_global_norm=clip_global_norm, guard=guard,
          nested_fix="jaxmp.multi_steps wraps the optimizer with "
          "jaxmp.loss_scaling itself: pass the bare optimizer, "
          "jaxmp.multi_steps(optax.adamw(1e-3), loss_scale, k)."),
      every_k_schedule,
      **multi_steps_kwargs,
  )

  def update_fn(updates, state, params=None, **extra_args):
    recovery = extra_args.pop("recovery", None)
    if recovery is not None:
      updates, state = _adopt_recovery(updates, state, recovery)
    updates, state = accumulate.update(updates, state, params, **extra_args)
    emitted = state.mini_step == 0
    acc_grads = optax.tree.where(
        emitted, optax.tree.zeros_like(state.acc_grads), state.acc_grads)
    return updates, state._replace(acc_grads=acc_grads)

  return optax.GradientTransformationExtraArgs(accumulate.init, update_fn)


def _times(tree: Any, factor: jax.Array) -> Any:
  """Each leaf times the float32 ``factor``, computed in at least float32."""
  return jax.tree_util.tree_map(
      lambda x: (x.astype(jnp.promote_types(x.dtype, jnp.float32)) * factor
                 ).astype(x.dtype), tree)


def _adopt_recovery(grads: Any, state: optax.MultiStepsState,
                    recovery: Any) -> tuple[Any, optax.MultiStepsState]:
  """Puts a recovered micro-batch and the accumulator in the same scale units.

  The accumulation adopts the recovered, backed-off scale at once: the
  accumulator is multiplied by ``new / old`` (at most 1, a power of two for
  the default factors, so exact barring underflow), the fallback's gradients
  (computed at scale 1) by the new scale, both in float32, and the
  loss-scaling state takes the new scale, so that the next micro-batches are
  computed at it. ``recovered_steps`` and ``fallback_steps`` count
  micro-batches; ``skipped_steps`` and ``lost_steps`` optimizer steps.
  """
  scaling = state.inner_opt_state
  recovery = check_recovery(recovery, scaling.loss_scale, "jaxmp.multi_steps")
  new_scale = backed_off_after_fallback(recovery)
  old_value = jnp.asarray(scaling.loss_scale.loss_scale, jnp.float32)
  new_value = jnp.asarray(new_scale.loss_scale, jnp.float32)
  fell_back = jnp.asarray(recovery.fell_back)
  finite = jnp.asarray(recovery.finite)
  recovered = (jnp.asarray(recovery.retries) > 0) | fell_back
  grads = _times(grads, jnp.where(fell_back, new_value, jnp.float32(1)))
  acc_grads = _times(state.acc_grads, new_value / old_value)
  scaling = scaling._replace(
      loss_scale=new_scale,
      recovered_steps=scaling.recovered_steps
      + (recovered & finite).astype(jnp.int32),
      fallback_steps=scaling.fallback_steps + (fell_back & finite).astype(jnp.int32),
  )
  return grads, state._replace(inner_opt_state=scaling, acc_grads=acc_grads)
