"""The optax wrapper: unscale, check, update or skip, adjust the loss scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.inplace_select import update_or_keep
from jaxmp._src.loss_scale import LossScale, all_finite

AxisName = Any  # a hashable axis name or a tuple of them


class LossScalingState(NamedTuple):
  """State of :func:`loss_scaling`.

  Attributes:
    inner_state: the wrapped optimizer's state; kept bit-identical on skipped
      steps.
    loss_scale: the current loss scale (a :class:`jaxmp.LossScale`).
    skipped_steps: int32, the number of steps skipped so far.
    last_finite: bool, whether the last step's gradients were finite.
  """

  inner_state: optax.OptState
  loss_scale: LossScale
  skipped_steps: jax.Array
  last_finite: jax.Array


def _to_device_state(loss_scale: LossScale) -> LossScale:
  return jax.tree_util.tree_map(jnp.asarray, loss_scale)


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: AxisName | None = None,
) -> optax.GradientTransformationExtraArgs:
  """Wraps an optimizer for loss-scaled training; skips non-finite steps.

  ``update`` receives the gradients of the *scaled* loss (see
  :func:`jaxmp.scaled_value_and_grad`). It unscales them, checks that they
  are all finite, runs ``inner`` on the unscaled gradients, and returns the
  inner updates when finite. When any gradient is inf or nan the step is
  skipped: the returned updates are ``-0.0`` (so ``optax.apply_updates``
  leaves every parameter bit-identical, signed zeros included), the inner state
  (moments, step counts, schedules) is kept bit-identical, and
  ``skipped_steps`` grows by one. In both cases the loss scale is then adjusted.

  The choice is made with ``jnp.where`` inside the inner update's elementwise
  pass: no host synchronisation, no ``lax.cond``, no extra copy of the
  parameters or of the optimizer state.

  Wrap the whole optimizer (clipping, weight decay and schedules inside), so
  that clipping sees the unscaled gradients.

  Args:
    inner: the optimizer to wrap.
    loss_scale: the initial loss scale (:class:`jaxmp.DynamicLossScale`,
      :class:`jaxmp.StaticLossScale` or :class:`jaxmp.NoOpLossScale`).
    axis_name: inside ``pmap`` or ``shard_map``, the axis name (or tuple of
      names) over which the gradients are split, so that all devices agree on
      skipping. Not needed under plain ``jit`` with sharded arrays, where the
      finiteness check is already global.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; extra keyword arguments of
    ``update`` are passed through to ``inner``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale(2.0**10))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([jnp.inf, 1.0])}  # an overflow: skipped
    >>> updates, state = tx.update(grads, state, params)
    >>> optax.apply_updates(params, updates)["w"]
    Array([1., 1.], dtype=float32)
    >>> float(jaxmp.get_loss_scale(state).loss_scale), int(state.skipped_steps)
    (512.0, 1)
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        "loss_scaling expects a loss scale such as jaxmp.DynamicLossScale(), "
        f"jaxmp.StaticLossScale(2.0**15) or jaxmp.NoOpLossScale(); got "
        f"{loss_scale!r}."
    )
  if not (hasattr(inner, "init") and hasattr(inner, "update")):
    raise TypeError(
        "loss_scaling expects an optax.GradientTransformation to wrap, e.g. "
        f"optax.adamw(1e-3); got {inner!r}."
    )
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    return LossScalingState(
        inner_state=inner.init(params),
        loss_scale=_to_device_state(loss_scale),
        skipped_steps=jnp.zeros([], jnp.int32),
        last_finite=jnp.ones([], jnp.bool_),
    )

  def update_fn(updates, state, params=None, **extra_args):
    if not isinstance(state, LossScalingState):
      raise TypeError(
          "The state passed to the update of jaxmp.loss_scaling is a "
          f"{type(state).__name__}, not the LossScalingState its init "
          "returned. Pass the state returned by tx.init(params)."
      )
    if params is not None:
      _check_same_structure(updates, params)
    current = state.loss_scale
    grads = current.unscale(updates)
    finite = all_finite(grads)
    if axis_name is not None:
      try:
        finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name)
      except NameError:
        raise ValueError(
            f"jaxmp.loss_scaling(axis_name={axis_name!r}): that axis name is "
            "not bound where update runs. Call update inside jax.shard_map or "
            "jax.pmap over that axis, or drop axis_name under plain jax.jit, "
            "where the finiteness check over sharded arrays is already global."
        ) from None
      finite = finite.astype(jnp.bool_)
    # The old inner state is selected where each new leaf is produced, so that
    # XLA writes it once, in place (see jaxmp/_fold.py).
    inner_updates, inner_state = update_or_keep(
        lambda g, s, p: inner.update(g, s, p, **extra_args),
        finite, grads, state.inner_state, params,
    )
    # On a skipped step, -0.0 is the exact identity of `p + u` (even for p=-0.0).
    updates = jax.tree_util.tree_map(
        lambda u: jnp.where(finite, u, jnp.asarray(-0.0, u.dtype)), inner_updates
    )
    new_state = LossScalingState(
        inner_state=inner_state,
        loss_scale=current.adjust(finite),
        skipped_steps=state.skipped_steps
        + jnp.logical_not(finite).astype(jnp.int32),
        last_finite=finite,
    )
    return updates, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _check_same_structure(updates: Any, params: Any) -> None:
  struct_u = jax.tree_util.tree_structure(updates)
  struct_p = jax.tree_util.tree_structure(params)
  if struct_u != struct_p:
    raise ValueError(
        "The gradients passed to jaxmp.loss_scaling's update do not have the "
        f"tree structure of the params:\n  gradients: {struct_u}\n  params:    "
        f"{struct_p}\nDifferentiate with respect to the same params you pass "
        "to update (e.g. jaxmp.scaled_value_and_grad(loss_fn, loss_scale)(params))."
    )
  for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates),
                          jax.tree_util.tree_leaves(params)):
    u_shape, p_shape = getattr(u, "shape", None), getattr(p, "shape", None)
    if u_shape is not None and p_shape is not None and tuple(u_shape) != tuple(p_shape):
      raise ValueError(
          "The gradients passed to jaxmp.loss_scaling's update do not have the "
          f"shapes of the params: at {jax.tree_util.keystr(path)} the gradient "
          f"has shape {tuple(u_shape)} and the param {tuple(p_shape)}. "
          "Differentiate with respect to the same params you pass to update."
      )


def _find_states(tree: Any) -> list[LossScalingState]:
  is_state = lambda x: isinstance(x, LossScalingState)
  leaves = jax.tree_util.tree_leaves(tree, is_leaf=is_state)
  return [x for x in leaves if is_state(x)]


def _find_state(opt_state: Any, caller: str) -> LossScalingState:
  states = _find_states(opt_state)
  if not states:
    raise ValueError(
        f"{caller}: no jaxmp.loss_scaling state found in the given optimizer "
        f"state (a {type(opt_state).__name__}). Wrap the optimizer with "
        "jaxmp.loss_scaling(optax.adamw(...), jaxmp.DynamicLossScale()) and pass "
        "the state its init returned."
    )
  if len(states) > 1:
    raise ValueError(
        f"{caller}: the optimizer state holds {len(states)} jaxmp.loss_scaling "
        "states, so the loss scale is ambiguous. Wrap the whole optimizer once "
        "with jaxmp.loss_scaling instead of wrapping its parts."
    )
  return states[0]


def get_loss_scale(opt_state: Any) -> LossScale:
  """Returns the current loss scale held in an optimizer state.

  Finds the state of :func:`loss_scaling` anywhere in a nested optax state
  (``chain``, ``MultiSteps``, ``inject_hyperparams``, an NNX optimizer's
  state). Works inside ``jit``.

  Raises:
    ValueError: if the state holds no (or more than one) loss-scaling state.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = optax.MultiSteps(
    ...     jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.StaticLossScale(8.0)), 4)
    >>> float(jaxmp.get_loss_scale(tx.init(jnp.ones(3))).loss_scale)
    8.0
  """
  loss_scale = _find_state(opt_state, "get_loss_scale").loss_scale
  # An NNX optimizer wraps each leaf in a Variable: hand back plain arrays.
  return jax.tree_util.tree_map(
      jnp.asarray, loss_scale, is_leaf=lambda x: hasattr(x, "__jax_array__")
  )


def loss_scaling_metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Returns scalar arrays describing loss scaling, for logging; jit-safe.

  Keys: ``loss_scale`` (float32), ``skipped_steps`` (int32), ``last_finite``
  (bool), ``overflows_at_min`` (int32; 0 for static and no-op scales) and
  ``steps_since_adjustment`` (int32, the dynamic scale's counter; 0 for
  the others).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    >>> sorted(jaxmp.loss_scaling_metrics(tx.init(jnp.ones(2))))
    ['last_finite', 'loss_scale', 'overflows_at_min', 'skipped_steps', 'steps_since_adjustment']
  """
  state = _find_state(opt_state, "loss_scaling_metrics")
  metrics = state.loss_scale.metrics()
  metrics["skipped_steps"] = jnp.asarray(state.skipped_steps)
  metrics["last_finite"] = jnp.asarray(state.last_finite)
  return metrics
