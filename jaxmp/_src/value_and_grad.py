"""The scaled ``value_and_grad``: the gradients :func:`jaxmp.loss_scaling` expects."""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.frameworks import for_nnx_objects
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.validation import jmp_loss_scale_fix

_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)
_CALLER = "scaled_value_and_grad"


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    value_and_grad: Callable[..., Any] = jax.value_and_grad,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad`` of ``loss_scale.scale(fun(...))``, returning the unscaled loss.

  The gradients are those of the *scaled* loss, which :func:`jaxmp.loss_scaling`
  expects. ``value_and_grad`` may be ``nnx.value_and_grad`` (an NNX model's
  FP8 meta is differentiated too and written back where finite; guard it with
  :func:`jaxmp.keep_on_skip`) or ``eqx.filter_value_and_grad`` (no
  ``argnums``: put what you differentiate first).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> loss, grads = jaxmp.scaled_value_and_grad(
    ...     lambda w: jnp.sum(w ** 2), jaxmp.StaticLossScale(4.0))(jnp.array([1.0, 2.0]))
    >>> float(loss), grads
    (5.0, Array([ 8., 16.], dtype=float32))
  """
  grad_fn = scale_then_differentiate(
      value_and_grad, fun, loss_scale, argnums=argnums, has_aux=has_aux,
      caller=_CALLER,
      state_hint="With an optimizer state, pass jaxmp.get_loss_scale(opt_state).")

  def with_fp8_meta():
    from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

    return nnx_adapter.with_fp8_meta(grad_fn, fun, loss_scale, argnums, functools.partial(
        scale_then_differentiate, loss_scale=loss_scale, has_aux=has_aux,
        caller=_CALLER, state_hint=""))

  return for_nnx_objects(fun, grad_fn, with_fp8_meta)


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
  """``value_and_grad`` (JAX's, NNX's, Equinox's) of ``loss_scale.scale(fun(...))``,
  returning the unscaled loss; errors name ``caller`` (a bad loss scale's with ``state_hint``)."""
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"{caller} expects a loss scale as its second argument, got a "
        f"{type(loss_scale).__name__}. {state_hint}"
        f"{jmp_loss_scale_fix(loss_scale)}")
  if not callable(value_and_grad):
    raise TypeError(
        f"{caller}: value_and_grad must be a function such as "
        f"jax.value_and_grad or eqx.filter_value_and_grad, got "
        f"{value_and_grad!r}.")
  try:
    takes_argnums = "argnums" in inspect.signature(value_and_grad).parameters
  except (TypeError, ValueError):  # a callable without a signature
    takes_argnums = True
  if not takes_argnums and argnums != 0:
    module = (getattr(value_and_grad, "__module__", "") or "").split(".")[0]
    name = getattr(value_and_grad, "__qualname__", None) or repr(value_and_grad)
    raise TypeError(
        f"{caller}(argnums={argnums!r}): {module + '.' if module else ''}{name} takes no "
        "argnums; it differentiates the first argument. Put what you "
        "differentiate first (several objects as one tuple), and leave "
        "argnums at 0.")
  check_leaves = value_and_grad is jax.value_and_grad

  def scaled(*args, **kwargs):
    """``(loss_scale.scale(loss), (loss, aux))`` of ``fun``, the loss checked."""
    out = fun(*args, **kwargs)
    pair = isinstance(out, tuple) and len(out) == 2
    loss, aux = out if has_aux and pair else (out, None)
    dtype = jnp.result_type(loss) if isinstance(loss, _ARRAY_LEAVES) else None
    if has_aux and not pair:
      problem, fix = f"a pair (loss, aux), got a {type(out).__name__}", (
          "Return (loss, aux), e.g. (loss, {'accuracy': accuracy}).")
    elif dtype is None:
      problem = f"a scalar loss, got a {type(loss).__name__}"
      fix = ("Return (loss, aux) with the loss a scalar array first." if has_aux
             else "If fun returns (loss, aux), pass has_aux=True." if pair else
             "Return the loss as a scalar array; to return more (a dict of "
             "metrics, say), return (loss, aux) and pass has_aux=True.")
    elif np.shape(loss) != ():
      problem = f"a scalar loss, got shape {np.shape(loss)}"
      fix = "Reduce it first, e.g. with jnp.mean(...)."
    elif jnp.issubdtype(dtype, jnp.complexfloating):
      problem = (f"a real floating-point loss, got dtype {dtype}: only its real "
                 "part would be differentiated (jax.value_and_grad refuses it too)")
      fix = "Return a real loss, e.g. jnp.abs(z) ** 2 or z.real."
    elif not jnp.issubdtype(dtype, jnp.floating):
      problem = (f"a real floating-point loss, got dtype {dtype}, whose gradients "
                 "are all zero (jax.value_and_grad refuses it too)")
      fix = "Compute the loss from floating values, e.g. x.astype(jnp.float32)."
    else:
      return loss_scale.scale(loss), (loss, aux)
    raise TypeError(f"{caller}{'(has_aux=True)' if has_aux else ''} expects fun "
                    f"to return {problem}. {fix}")

  def scaled_value_and_grad_fn(*args, **kwargs):
    # Refuses non-array leaves where jax.value_and_grad differentiates (a bad
    # argnums it explains itself).
    for i in (argnums,) if isinstance(argnums, int) else tuple(argnums):
      if not (check_leaves and -len(args) <= i < len(args)):
        continue
      for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
        if not isinstance(leaf, _ARRAY_LEAVES):
          raise TypeError(
              f"{caller}: argument {i} holds a leaf that is not an array at "
              f"{jax.tree_util.keystr(path) or 'its top'} (a "
              f"{type(leaf).__name__}), which jax.value_and_grad cannot "
              "differentiate. An Equinox module? Pass "
              "value_and_grad=eqx.filter_value_and_grad, which differentiates "
              "only the floating arrays of its first argument; otherwise move "
              "the non-array parts into an argument that is not differentiated.")
    if takes_argnums:
      grad_fn = value_and_grad(scaled, argnums=argnums, has_aux=True)
    else:
      grad_fn = value_and_grad(scaled, has_aux=True)
    (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return scaled_value_and_grad_fn
