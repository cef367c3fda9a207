"""Gradient accumulation with loss scaling, in the state of ``optax.MultiSteps``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.loss_scale import LossScale, all_finite
from jaxmp._src.loss_scaling import (
    LossScalingState, agree_on_finite, check_update, checked_wrapper, clip_and_check,
    global_norm_and_finite, keyed_transformation, step_or_skip)
from jaxmp._src.validation import check_bool, check_number

OWNER = "jaxmp.multi_steps"


def multi_steps(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    every_k_schedule: int | Callable[[jax.Array], jax.Array],
    *,
    axis_name: Any = None,
    clip_global_norm: float | None = None,
    guard: bool = True,
    use_grad_mean: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """``optax.MultiSteps(jaxmp.loss_scaling(inner, loss_scale), k)``, made safe.

  ``update`` takes each micro-batch's scaled gradients; ``acc_grads`` sums them
  unscaled, in float32, and the k-th checks the sum: a non-finite micro-batch
  skips the whole step (inner state bit-identical), backs the scale off once
  and leaves a zeroed accumulator. ``skip_state["should_skip"]`` is this
  micro-batch's flag (for :func:`jaxmp.keep_on_skip`). The other arguments
  are those of :func:`jaxmp.loss_scaling` and ``optax.MultiSteps``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.multi_steps(optax.sgd(1.0), jaxmp.StaticLossScale(4.0), 2)
    >>> params = {"w": jnp.zeros(2)}
    >>> _, state = tx.update({"w": jnp.array([jnp.nan, 4.0])}, tx.init(params), params)
    >>> updates, state = tx.update({"w": jnp.array([4.0, 4.0])}, state, params)
    >>> updates["w"], int(state.inner_opt_state.skipped_steps), state.acc_grads["w"]
    (Array([-0., -0.], dtype=float32), 1, Array([0., 0.], dtype=float32))
  """
  if callable(every_k_schedule):
    every_k = every_k_schedule
  else:
    k = check_number(
        OWNER, "every_k_schedule", every_k_schedule, integer=True,
        minimum=1, advice="Pass the number of micro-batches per step, or a "
        "function of the step count.")
    every_k = lambda _: k
  use_grad_mean = check_bool(
      OWNER, "use_grad_mean", use_grad_mean, advice="True passes the mean "
      "of the micro-batches' gradients to the optimizer, False their sum.")
  wrapped, clip_global_norm, guard, scaling_init = checked_wrapper(
      OWNER, inner, loss_scale, clip_global_norm, guard,
      nested_fix="jaxmp.multi_steps wraps the optimizer with "
      "jaxmp.loss_scaling itself: pass the bare optimizer, "
      "jaxmp.multi_steps(optax.adamw(1e-3), loss_scale, k).")

  def init_fn(params):
    return optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=scaling_init(params),
        acc_grads=jax.tree_util.tree_map(
            lambda p: jnp.zeros(jnp.shape(p), _accumulator_dtype(p)), params),
        skip_state={"should_skip": jnp.zeros([], jnp.bool_)},  # skip_not_finite's form
    )

  def update_fn(grads, state, params=None, **extra_args):
    check_update(OWNER, state, isinstance(state, optax.MultiStepsState) and isinstance(
        state.inner_opt_state, LossScalingState),
                 "optax.MultiStepsState holding a LossScalingState", grads, params)
    scaling_state = state.inner_opt_state
    scale_of_grads = scaling_state.loss_scale
    k_steps = jnp.asarray(every_k(state.gradient_step), jnp.int32)
    emit = state.mini_step == k_steps - 1
    # The sum so far, unscaled, in the accumulator's dtype. XLA writes it
    # once (see the check below); the check, the inner update and the select
    # that zeroes the accumulator read it.
    total = jax.tree_util.tree_map(
        lambda acc, g: acc + g, state.acc_grads,
        scale_of_grads.unscale(jax.tree_util.tree_map(
            lambda g, acc: g.astype(acc.dtype), grads, state.acc_grads)))

    def to_inner(t, g):
      if use_grad_mean:
        t = t / k_steps.astype(t.dtype)
      return t.astype(g.dtype)

    checked = jax.tree_util.tree_map(to_inner, total, grads)
    if clip_global_norm is None:
      # The norm's flag, as with clipping (all_finite's decision): XLA:CPU
      # fuses all_finite's reduction with the sum, which it then recomputes
      # in every reader and so copies the accumulator; not the norm's.
      finite = global_norm_and_finite(checked)[2]
    else:
      checked, finite = clip_and_check(checked, clip_global_norm)
    skip_state = state.skip_state
    if guard:
      # This micro-batch's flag, for keep_on_skip, agreed across devices in
      # the accumulation's reduction.
      finite, micro_finite = agree_on_finite(
          jnp.stack([finite, all_finite(grads)]), axis_name, OWNER)
      skip_state = {"should_skip": jnp.logical_not(micro_finite)}
      applies = emit & finite
    else:
      applies = emit
    updates, inner_state = step_or_skip(
        lambda g, s, p: wrapped.update(g, s, p, **extra_args),
        applies, checked, scaling_state.inner_state, params)
    scaling_state = scaling_state._replace(inner_state=inner_state)
    if guard:
      lost = (emit & jnp.logical_not(finite)).astype(jnp.int32)
      scaling_state = scaling_state._replace(
          loss_scale=optax.tree.where(
              emit, scaling_state.loss_scale.adjust(finite),
              scaling_state.loss_scale),
          skipped_steps=scaling_state.skipped_steps + lost,
          last_finite=jnp.where(emit, finite, scaling_state.last_finite),
          lost_steps=scaling_state.lost_steps + lost)
    new_state = optax.MultiStepsState(
        mini_step=jnp.where(emit, jnp.zeros([], jnp.int32), state.mini_step + 1),
        gradient_step=jnp.where(
            emit, optax.safe_increment(state.gradient_step), state.gradient_step),
        inner_opt_state=scaling_state,
        # Zeroed with a select, not a product: a nan does not survive.
        acc_grads=jax.tree_util.tree_map(
            lambda t: jnp.where(emit, jnp.zeros_like(t), t), total),
        skip_state=skip_state)
    return updates, new_state

  return keyed_transformation(init_fn, update_fn, OWNER, inner, loss_scale,
                              every_k_schedule, axis_name, clip_global_norm,
                              guard, use_grad_mean)


def _accumulator_dtype(param: Any) -> Any:
  """float32, or the param's dtype where it is a wider float (or complex)."""
  dtype = jnp.dtype(jnp.result_type(param))
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype if dtype.itemsize > 8 else jnp.dtype(jnp.complex64)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 4:
    return dtype
  return jnp.dtype(jnp.float32)
