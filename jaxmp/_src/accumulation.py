"""Gradient accumulation with loss scaling, in the state of ``optax.MultiSteps``."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.loss_scale import LossScale, all_finite
from jaxmp._src.loss_scaling import (
    LossScalingState,
    agree_on_finite,
    check_grads_match_params,
    check_guard_options,
    clip_and_check,
    global_norm_and_finite,
    keyed_transformation,
    step_or_skip,
    wrap_with_loss_scaling,
)
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

  Call ``update`` once per micro-batch with the gradients of the *scaled*
  loss, exactly as with ``optax.MultiSteps``. The loss scale stays constant
  within an accumulation. On the k-th micro-batch the accumulated gradients
  are checked and, if finite, passed to ``inner``. If any micro-batch of the
  accumulation was non-finite, the whole accumulated step is skipped (zero
  updates, inner state bit-identical), the scale backs off once, and the next
  accumulation starts from a clean, zero accumulator.

  **The accumulator** (``state.acc_grads``) holds the running *sum* of the
  *unscaled* gradients, in float32 (in the gradients' dtype where it is wider,
  such as float64): each micro-batch is unscaled by the scale it was computed
  at and added. On the k-th micro-batch the sum (divided by k with
  ``use_grad_mean``) goes to ``inner`` in the gradients' dtype, and the
  accumulator is set to zero with ``jnp.where``: a nan in it does not survive
  (``optax.MultiSteps`` multiplies it by zero, and ``0 * nan = nan``). An inf
  or nan in any micro-batch makes the sum non-finite, so checking the sum
  decides for the whole accumulation; finite micro-batches whose sum
  overflows float32 are skipped too.

  The micro-batches in between cost what those of ``optax.MultiSteps`` cost:
  the inner update runs on every micro-batch, as in ``optax.MultiSteps``, and
  its state is selected in place, with no ``lax.cond``, no host
  synchronisation and no copy of the state. Their updates are ``-0.0``.

  **Recovery.** :func:`jaxmp.retry_skipped` refuses accumulation: a skip
  drops every micro-batch of the accumulated step, and a retry could only
  recompute the last one.

  The state is ``optax.MultiStepsState``: ``jaxmp.get_loss_scale``,
  ``jaxmp.loss_scaling_metrics`` and ``optax.MultiSteps.has_updated`` read it.
  Its ``skip_state`` is ``{"should_skip": flag}``, as with
  ``optax.skip_not_finite``: whether this micro-batch's gradients were not
  finite (on any device of ``axis_name``), which :func:`jaxmp.keep_on_skip`
  reads; the metrics (``last_finite``, ``skipped``) are about completed steps.

  Args:
    inner: the optimizer to wrap (schedules and weight decay inside).
    loss_scale: the initial loss scale.
    every_k_schedule: the number of micro-batches per step, an int or a
      function of the step count, as in ``optax.MultiSteps``.
    axis_name: as in :func:`jaxmp.loss_scaling`.
    clip_global_norm: as in :func:`jaxmp.loss_scaling`: the accumulated,
      unscaled gradients are clipped to this global norm, and checked in the
      same reduction, on the k-th micro-batch.
    guard: as in :func:`jaxmp.loss_scaling` (``False`` only with
      :class:`jaxmp.NoOpLossScale`).
    use_grad_mean: as in ``optax.MultiSteps``: pass the mean of the
      micro-batches' gradients to ``inner`` (the default), else their sum.
      ``optax.MultiSteps``' other options are not taken: the guard is what
      skips (no ``should_skip_update_fn``), and the accumulator is float32
      (no ``accumulator_dtype``).

  Raises:
    TypeError: if ``every_k_schedule`` is neither a function nor an integer,
      or ``use_grad_mean`` is not a bool.
    ValueError: if ``every_k_schedule`` is an integer below 1; from ``init``,
      if ``inner`` is already wrapped with :func:`jaxmp.loss_scaling` (pass
      the bare optimizer).

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
  scaling = wrap_with_loss_scaling(
      inner, loss_scale, axis_name=axis_name, owner=OWNER,
      clip_global_norm=clip_global_norm, guard=guard,
      nested_fix="jaxmp.multi_steps wraps the optimizer with "
      "jaxmp.loss_scaling itself: pass the bare optimizer, "
      "jaxmp.multi_steps(optax.adamw(1e-3), loss_scale, k).")
  clip_global_norm, guard = check_guard_options(
      OWNER, loss_scale, clip_global_norm, guard)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return optax.MultiStepsState(
        mini_step=jnp.zeros([], jnp.int32),
        gradient_step=jnp.zeros([], jnp.int32),
        inner_opt_state=scaling.init(params),
        acc_grads=jax.tree_util.tree_map(
            lambda p: jnp.zeros(jnp.shape(p), _accumulator_dtype(p)), params),
        skip_state=_skip_state(jnp.ones([], jnp.bool_)),
    )

  def update_fn(grads, state, params=None, **extra_args):
    _check_state(state)
    check_grads_match_params(grads, params, OWNER)
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
      # The flag of the norm's reduction, as with clipping (the same
      # decision as jaxmp.all_finite). XLA:CPU fuses the boolean reduction of
      # all_finite with the sum, which it then recomputes in every reader,
      # one of which zeroes the accumulator in place: so it would copy the
      # accumulator first. With the norm's reduction, it writes the sum once.
      finite = global_norm_and_finite(checked)[2]
    else:
      checked, finite = clip_and_check(checked, clip_global_norm)
    skip_state = state.skip_state
    if guard:
      # This micro-batch's flag, for jaxmp.keep_on_skip: made one across
      # devices in the same reduction as the accumulation's.
      finite, micro_finite = agree_on_finite(
          jnp.stack([finite, all_finite(grads)]), axis_name, OWNER)
      skip_state = _skip_state(micro_finite)
      applies = emit & finite
    else:
      applies = emit
    updates, inner_state = step_or_skip(
        lambda g, s, p: inner.update(g, s, p, **extra_args),
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
          lost_steps=scaling_state.lost_steps + lost,
      )
    new_state = optax.MultiStepsState(
        mini_step=jnp.where(emit, jnp.zeros([], jnp.int32), state.mini_step + 1),
        gradient_step=jnp.where(
            emit, optax.safe_increment(state.gradient_step), state.gradient_step),
        inner_opt_state=scaling_state,
        # Zeroed with a select, not a product: a nan does not survive.
        acc_grads=jax.tree_util.tree_map(
            lambda t: jnp.where(emit, jnp.zeros_like(t), t), total),
        skip_state=skip_state,
    )
    return updates, new_state

  return keyed_transformation(init_fn, update_fn, OWNER, inner, loss_scale,
                              every_k_schedule, axis_name, clip_global_norm,
                              guard, use_grad_mean)


def _skip_state(finite: jax.Array) -> dict[str, jax.Array]:
  """The skip state of ``optax.skip_not_finite``'s form: this micro-batch's flag."""
  return {"should_skip": jnp.logical_not(finite)}


def _accumulator_dtype(param: Any) -> Any:
  """float32, or the param's dtype where it is a wider float (or complex)."""
  dtype = jnp.dtype(jnp.result_type(param))
  if jnp.issubdtype(dtype, jnp.complexfloating):
    return dtype if dtype.itemsize > 8 else jnp.dtype(jnp.complex64)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize > 4:
    return dtype
  return jnp.dtype(jnp.float32)


def _check_state(state: Any) -> None:
  if not (isinstance(state, optax.MultiStepsState)
          and isinstance(state.inner_opt_state, LossScalingState)):
    raise TypeError(
        f"The state passed to the update of {OWNER} is a "
        f"{type(state).__name__}, not the optax.MultiStepsState holding a "
        "LossScalingState that its init returned. Pass the state returned "
        "by tx.init(params).")

