"""The scaled ``value_and_grad``: the gradients :func:`jaxmp.loss_scaling` expects."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmp._src.loss_scale import LossScale


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
