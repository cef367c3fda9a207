"""Gradient accumulation with loss scaling, built on ``optax.MultiSteps``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.loss_scaling import wrap_with_loss_scaling
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
    updates, state = accumulate.update(updates, state, params, **extra_args)
    emitted = state.mini_step == 0
    acc_grads = optax.tree.where(
        emitted, optax.tree.zeros_like(state.acc_grads), state.acc_grads)
    return updates, state._replace(acc_grads=acc_grads)

  return optax.GradientTransformationExtraArgs(accumulate.init, update_fn)
