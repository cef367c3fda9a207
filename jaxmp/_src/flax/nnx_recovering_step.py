"""Recovering the batch with the whole NNX train step in the loop.

:func:`nnx_recovering_step` is :func:`jaxmp.recovering_step` for an NNX model
and its ``nnx.Optimizer``: the step (the scaled gradients of
:func:`jaxmp.flax.nnx_scaled_value_and_grad`, the optimizer's update) is the
body of the same do-while loop. NNX objects cannot be updated inside a
``lax.while_loop`` traced from outside it, so the loop carries the model's
variables and the optimizer state as arrays (``nnx.split``): each attempt
merges the model from them, and the result of the last attempt is written
back to the caller's model and optimizer once, after the loop.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax

from jaxmp._src.flax.fp8_nnx import has_fp8_meta
from jaxmp._src.flax.nnx import check_function_fallback, nnx_scaled_value_and_grad
from jaxmp._src.loss_scale import NoOpLossScale
from jaxmp._src.recovering_step import (
    _scaling_state,
    attempt_gradients,
    check_whole_step_recover,
    retry_while_skipped,
)
from jaxmp._src.recovery import Recover
from jaxmp._src.validation import check_bool

_CALLER = "jaxmp.flax.nnx_recovering_step"


def nnx_recovering_step(
    loss_fn: Callable[..., Any],
    recover: Recover = Recover(),
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """An NNX train step that recovers a non-finite batch, free when finite.

  The returned ``step(model, optimizer, *args, **kwargs)`` does what this
  plain NNX step does, where ``optimizer`` is an ``nnx.Optimizer`` built on
  :func:`jaxmp.loss_scaling`::

    with jaxmp.flax.nnx_keep_on_skip(model, optimizer):
      loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
          loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model, *args)
      optimizer.update(model, grads)

  and, when the loss-scaling optimizer skips the update because the
  gradients were not finite, recomputes the same batch inside the same step,
  as :class:`jaxmp.Recover` describes: at the backed-off scale, up to
  ``recover.max_retries`` times, then once with ``recover.fallback`` at
  scale 1. It is :func:`jaxmp.recovering_step` for NNX: the step is the body
  of one ``lax.while_loop`` whose first iteration is the step itself. A
  finite step compiles to what the plain step does (bytes accessed and
  temporary memory within 0.5%, docs/when-fp16-fails.md) and gives its bits,
  whereas ``nnx_scaled_value_and_grad(..., recover=)`` costs about +77%.
  Wrap the step in ``nnx.jit``; it updates ``model`` and ``optimizer`` in
  place, as an NNX train step does.

  **The model's other variables** (everything the optimizer does not update:
  BatchNorm statistics, RNG counts) are kept on a skipped attempt, as
  :func:`jaxmp.flax.nnx_keep_on_skip` keeps the BatchNorm statistics: each
  retry starts from the step's own (the same dropout masks), the applied
  attempt's values are written, and a lost batch leaves the whole model, the
  RNG counts included, bit-identical. ``optimizer.step`` grows by one per
  call, however many attempts ran; the metrics (``recovered_steps``,
  ``fallback_steps``, ``lost_steps``, ``skipped_steps``) count the step once.
  The devices agree on each retry through the optimizer's own check (pass
  ``axis_name`` to :func:`jaxmp.loss_scaling` inside ``shard_map``; nothing is
  needed under sharded ``jit``).

  The batch arguments are arrays: an NNX object the loss updates (an
  ``nnx.Rngs``) belongs in the model, which the loop carries.

  Args:
    loss_fn: ``loss_fn(model, *args, **kwargs)`` returning a scalar loss, or
      ``(loss, aux)`` when ``has_aux``; the gradients are taken with respect
      to the model's variables the optimizer updates (its ``wrt``).
    recover: the :class:`jaxmp.Recover` configuration (default
      ``jaxmp.Recover()``: 4 retries, no fallback). Its ``fallback``, if
      given, is a function with ``loss_fn``'s signature that computes in the
      fallback precision (an NNX model fixes its dtypes in its layers, so a
      policy cannot be applied from outside).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``step(model, optimizer, *args, **kwargs)`` returning ``(loss,
    recovery)``: the unscaled loss of the attempt that was applied (``(loss,
    aux)`` when ``has_aux``) and its :class:`jaxmp.RecoveryInfo`
    (``recovery.finite`` says whether the update was applied).

  Raises:
    TypeError: if ``recover`` is not a :class:`jaxmp.Recover` or its fallback
      is a policy, or ``has_aux`` is not a bool; when called, if ``optimizer``
      is not an ``nnx.Optimizer`` or an argument after it is an NNX object.
    ValueError: if ``recover`` has an ``axis_name``; when called, if the
      optimizer holds no loss-scaling state (or more than one), or holds it
      inside :func:`jaxmp.multi_steps`, or if the model has FP8 meta
      (:class:`jaxmp.flax.Fp8Meta`).

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, dtype=jnp.float16, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(model, jaxmp.loss_scaling(
    ...     optax.sgd(1e-6), jaxmp.DynamicLossScale(2.0**16)), wrt=nnx.Param)
    >>> loss_fn = lambda model, x: jnp.sum(model(x)).astype(jnp.float32)
    >>> step = nnx.jit(jaxmp.flax.nnx_recovering_step(loss_fn))
    >>> loss, recovery = step(model, optimizer, jnp.ones((2, 2)))
    >>> int(recovery.retries), bool(recovery.finite)  # recovered at 2**14
    (2, True)
    >>> metrics = jaxmp.loss_scaling_metrics(optimizer.opt_state)
    >>> int(optimizer.step[...]), int(metrics["recovered_steps"])
    (1, 1)
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  recover = check_whole_step_recover(
      recover, _CALLER, optimizer="jaxmp.loss_scaling(..., axis_name={!r})")
  recover = check_function_fallback(recover, _CALLER)
  has_aux = check_bool(_CALLER, "has_aux", has_aux)
  fallback = recover.fallback
  no_scale = NoOpLossScale()

  def step(model, optimizer, *args, **kwargs):
    if not isinstance(optimizer, nnx.Optimizer):
      raise TypeError(
          f"{_CALLER}: the step takes the model and its nnx.Optimizer, "
          f"step(model, optimizer, *batch); got a {type(optimizer).__name__} "
          "second. Build the optimizer with nnx.Optimizer(model, "
          "jaxmp.loss_scaling(tx, loss_scale), wrt=nnx.Param).")
    _refuse_nnx_objects(args, kwargs)
    if has_fp8_meta(model):
      raise ValueError(
          f"{_CALLER} does not support FP8 meta (jaxmp.flax.Fp8Meta): a retry "
          "at a backed-off scale would need the meta in that scale's units. "
          "Train the FP8 model with the plain step (nnx_keep_on_skip around "
          "nnx_scaled_value_and_grad and optimizer.update), which skips a "
          "non-finite step and keeps the meta.")
    wrt = optimizer.wrt
    graphdef, params, rest = nnx.split(model, wrt, ...)
    state = (nnx.as_pure(params), nnx.as_pure(rest),
             nnx.as_pure(optimizer.opt_state))

    def attempt(state, info):
      params, rest, opt_state = state

      def gradients(fn, scale):
        def on_a_copy():  # merged here: a lax.cond branch owns its Variables
          model = nnx.merge(graphdef, params, rest)
          out, grads = nnx_scaled_value_and_grad(
              fn, scale, argnums=nnx.DiffState(0, wrt), has_aux=has_aux)(
                  model, *args, **kwargs)
          return ((out, nnx.as_pure(nnx.split(model, wrt, ...)[2])),
                  nnx.as_pure(nnx.state(grads, wrt)))
        return on_a_copy

      (out, new_rest), grads = attempt_gradients(
          info, gradients(loss_fn, info.loss_scale),
          None if fallback is None else gradients(fallback, no_scale), _CALLER)
      # What optimizer.update does, on the carried arrays.
      updates, opt_state = optimizer.tx.update(
          grads, opt_state, params, recovery=info)
      applied = _scaling_state(opt_state).last_finite
      # A skipped attempt keeps the other variables, as nnx_keep_on_skip does.
      rest = optax.tree_utils.tree_where(applied, new_rest, rest)
      return (optax.apply_updates(params, updates), rest, opt_state), out

    (params, rest, opt_state), out, info = retry_while_skipped(
        attempt, state, recover, fallback is not None,
        opt_state_of=lambda state: state[2],
        with_opt_state=lambda state, opt_state: (state[0], state[1], opt_state),
        caller=_CALLER)
    nnx.update(model, params, rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step[...] += 1
    return out, info

  return step


def _refuse_nnx_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
  """Refuses NNX objects among the batch arguments (the loop cannot update them)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  nnx_object = lambda x: isinstance(x, (nnx.Pytree, nnx.Variable))
  named = [(f"batch argument {i}", arg) for i, arg in enumerate(args)]
  named += [(f"keyword argument {name!r}", arg) for name, arg in kwargs.items()]
  for where, arg in named:
    for path, leaf in jax.tree_util.tree_leaves_with_path(arg, is_leaf=nnx_object):
      if nnx_object(leaf):
        raise TypeError(
            f"{_CALLER}: the {where}{jax.tree_util.keystr(path)} is an NNX "
            f"object ({type(leaf).__name__}). The retries run in a "
            "lax.while_loop that carries the model and the optimizer only, so "
            "an NNX object passed beside them could not be updated. Make it an "
            "attribute of the model (model.rngs = nnx.Rngs(...)), or pass arrays.")
