"""The optax wrapper: unscale, check, update or skip, adjust the loss scale."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._fold import update_or_keep
from jaxmp.loss_scale import LossScale
from jaxmp.tree import all_finite

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


def _metrics_of_scale(loss_scale: LossScale) -> dict[str, jax.Array]:
  overflows = getattr(loss_scale, "overflows_at_min", None)
  return {
      "loss_scale": jnp.asarray(loss_scale.loss_scale, jnp.float32),
      "overflows_at_min": jnp.zeros([], jnp.int32)
      if overflows is None
      else jnp.asarray(overflows),
  }


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
  metrics = _metrics_of_scale(state.loss_scale)
  counter = getattr(state.loss_scale, "counter", None)
  metrics["steps_since_adjustment"] = (
      jnp.zeros([], jnp.int32) if counter is None else jnp.asarray(counter)
  )
  metrics["skipped_steps"] = jnp.asarray(state.skipped_steps)
  metrics["last_finite"] = jnp.asarray(state.last_finite)
  return metrics


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
    metrics = _metrics_of_scale(x)
  elif isinstance(x, dict) and "loss_scale" in x and not _find_states(x):
    raise ValueError(
        "check_loss_scale: the metrics dict has no 'overflows_at_min' key. Pass "
        "the dict returned by jaxmp.loss_scaling_metrics(opt_state)."
    )
  else:
    metrics = _metrics_of_scale(_find_state(x, "check_loss_scale").loss_scale)
  overflows, scale = jax.device_get(
      (metrics["overflows_at_min"], metrics["loss_scale"])
  )
  overflows = int(np.asarray(overflows))
  if overflows > max_overflows_at_min:
    raise LossScaleAtMinimumError(
        f"Current loss scale already at minimum ({float(np.asarray(scale))}): "
        f"{overflows} overflow(s) at the minimum scale.\n" + _REMEDIES
    )


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, but differentiates the scaled loss.

  The returned function computes ``loss_scale.scale(fun(...))`` and its
  gradients. It returns the *unscaled* loss (with aux when ``has_aux``, as in
  JAX) and the gradients of the *scaled* loss, which is what
  :func:`loss_scaling` expects.

  Args:
    fun: the loss function; returns a scalar (and aux when ``has_aux``).
    loss_scale: the current loss scale, e.g. ``jaxmp.get_loss_scale(opt_state)``.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function with the signature of ``fun`` returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> loss_fn = lambda w: jnp.sum(w ** 2)
    >>> loss, grads = jaxmp.scaled_value_and_grad(
    ...     loss_fn, jaxmp.StaticLossScale(4.0))(jnp.array([1.0, 2.0]))
    >>> float(loss), grads
    (5.0, Array([ 8., 16.], dtype=float32))
  """
  return scale_then_differentiate(
      jax.value_and_grad, fun, loss_scale, argnums=argnums, has_aux=has_aux,
      caller="scaled_value_and_grad",
      state_hint="With an optimizer state, pass jaxmp.get_loss_scale(opt_state).")


def scale_then_differentiate(
    value_and_grad: Callable[..., Any],
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int],
    has_aux: bool,
    caller: str,
    state_hint: str,
) -> Callable[..., Any]:
  """``value_and_grad`` (JAX's or NNX's) of ``loss_scale.scale(fun(...))``.

  Returns the unscaled loss (with aux when ``has_aux``) and the gradients of
  the scaled loss. Shared by :func:`scaled_value_and_grad` and
  :func:`jaxmp.flax.nnx_scaled_value_and_grad`; errors name ``caller``.
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"{caller} expects a loss scale as its second argument, got a "
        f"{type(loss_scale).__name__}. {state_hint}"
    )

  def scaled(*args, **kwargs):
    out = fun(*args, **kwargs)
    if has_aux:
      if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"{caller}(has_aux=True) expects fun to return a pair (loss, aux); "
            f"got {type(out).__name__}."
        )
      loss, aux = out
    else:
      loss, aux = out, None
    if np.shape(loss) != ():
      raise TypeError(
          f"{caller} expects fun to return a scalar loss, got shape "
          f"{np.shape(loss)}. Reduce it first, e.g. with jnp.mean(...)."
      )
    return loss_scale.scale(loss), (loss, aux)

  grad_fn = value_and_grad(scaled, argnums=argnums, has_aux=True)

  def scaled_value_and_grad_fn(*args, **kwargs):
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return scaled_value_and_grad_fn


__all__ = [
    "LossScaleAtMinimumError",
    "LossScalingState",
    "check_loss_scale",
    "get_loss_scale",
    "loss_scaling",
    "loss_scaling_metrics",
    "scaled_value_and_grad",
]
