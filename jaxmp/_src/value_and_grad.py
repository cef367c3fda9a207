"""The scaled ``value_and_grad``: the gradients :func:`jaxmp.loss_scaling` expects."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.frameworks import for_nnx_objects
from jaxmp._src.loss_scale import LossScale
from jaxmp._src.validation import jmp_loss_scale_fix

_ARRAY_LEAVES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)


def scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    value_and_grad: Callable[..., Any] = jax.value_and_grad,
) -> Callable[..., Any]:
  """Like ``jax.value_and_grad``, but differentiates the scaled loss.

  The returned function computes ``loss_scale.scale(fun(...))`` and its
  gradients. It returns the *unscaled* loss (with aux when ``has_aux``, as in
  JAX) and the gradients of the *scaled* loss, which is what
  :func:`loss_scaling` expects.

  **Any value-and-grad.** ``value_and_grad`` is called as
  ``value_and_grad(scaled_fun, has_aux=True)``, with ``argnums=argnums`` too
  when it has an ``argnums`` parameter (``jax.value_and_grad``, Flax's
  ``nnx.value_and_grad``), and must return a function giving ``((value, aux),
  grads)``. ``eqx.filter_value_and_grad`` has no ``argnums``: it
  differentiates the floating arrays of the first argument (an Equinox
  module), so ``argnums`` must stay 0; to differentiate several objects, pass
  them as a tuple in the first argument. Pass
  ``value_and_grad=eqx.filter_value_and_grad`` whenever the differentiated
  argument holds functions or other non-array leaves, as Equinox modules do.

  **NNX.** Pass ``value_and_grad=nnx.value_and_grad``: the gradients are
  those of the ``nnx.Param`` variables, as an ``nnx.Optimizer`` built on
  :func:`loss_scaling` expects. A model with FP8 ops (``"mixed_fp8"``, see
  ``docs/fp8.md``) has its FP8 meta (:class:`jaxmp.flax.Fp8Meta`)
  differentiated too: the new meta is written into the model where finite,
  its output-gradient part in unscaled units, and the gradients are nan where
  it is not, so that the optimizer skips the step. Guard the meta (and the
  BatchNorm statistics) with :func:`jaxmp.keep_on_skip` after the update.

  Args:
    fun: the loss function; returns a floating-point scalar (and aux when
      ``has_aux``).
    loss_scale: the current loss scale, e.g. ``jaxmp.get_loss_scale(opt_state)``.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.
    value_and_grad: the value-and-grad transformation to use.

  Returns:
    A function with the signature of ``fun`` returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale, if ``argnums`` is not 0
      for a ``value_and_grad`` without ``argnums``; when called, if ``fun``
      returns a non-scalar, integer or complex loss (``jax.value_and_grad``
      refuses those too), or if a differentiated argument holds leaves that
      are not arrays under the default ``jax.value_and_grad``.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> loss_fn = lambda w: jnp.sum(w ** 2)
    >>> loss, grads = jaxmp.scaled_value_and_grad(
    ...     loss_fn, jaxmp.StaticLossScale(4.0))(jnp.array([1.0, 2.0]))
    >>> float(loss), grads
    (5.0, Array([ 8., 16.], dtype=float32))
  """
  grad_fn = scale_then_differentiate(
      value_and_grad, fun, loss_scale, argnums=argnums, has_aux=has_aux,
      caller="scaled_value_and_grad",
      state_hint="With an optimizer state, pass jaxmp.get_loss_scale(opt_state).")
  def with_fp8_meta():
    # An NNX model's FP8 meta is differentiated too, and written back.
    from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

    return nnx_adapter.with_fp8_meta(grad_fn, fun, loss_scale, argnums, has_aux)

  return for_nnx_objects(fun, grad_fn, with_fp8_meta)


def _takes_argnums(value_and_grad: Callable[..., Any]) -> bool:
  try:
    parameters = inspect.signature(value_and_grad).parameters
  except (TypeError, ValueError):  # a callable without a signature
    return True
  return "argnums" in parameters


def _name(fn: Callable[..., Any]) -> str:
  module = getattr(fn, "__module__", "") or ""
  name = getattr(fn, "__qualname__", None) or repr(fn)
  return f"{module.split('.')[0]}.{name}" if module else name


def _check_array_leaves(args: tuple[Any, ...], argnums: int | Sequence[int],
                        caller: str) -> None:
  """Refuses non-array leaves where ``jax.value_and_grad`` differentiates."""
  for i in (argnums,) if isinstance(argnums, int) else tuple(argnums):
    if not -len(args) <= i < len(args):
      continue  # jax.value_and_grad explains a bad argnums itself
    for path, leaf in jax.tree_util.tree_leaves_with_path(args[i]):
      if not isinstance(leaf, _ARRAY_LEAVES):
        raise TypeError(
            f"{caller}: argument {i} holds a leaf that is not an array at "
            f"{jax.tree_util.keystr(path) or 'its top'} (a "
            f"{type(leaf).__name__}), which jax.value_and_grad cannot "
            "differentiate. An Equinox module? Pass "
            "value_and_grad=eqx.filter_value_and_grad, which differentiates "
            "only the floating arrays of its first argument; otherwise move "
            "the non-array parts into an argument that is not differentiated."
        )


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
  """``value_and_grad`` (JAX's, NNX's, Equinox's) of ``loss_scale.scale(fun(...))``.

  Returns the unscaled loss (with aux when ``has_aux``) and the gradients of
  the scaled loss. Shared by :func:`scaled_value_and_grad`,
  :meth:`jaxmp.flax.TrainState.value_and_grad` and the NNX FP8 path; errors
  name ``caller``.
  """
  if not isinstance(loss_scale, LossScale):
    raise TypeError(
        f"{caller} expects a loss scale as its second argument, got a "
        f"{type(loss_scale).__name__}. {state_hint}"
        f"{jmp_loss_scale_fix(loss_scale)}"
    )
  if not callable(value_and_grad):
    raise TypeError(
        f"{caller}: value_and_grad must be a function such as "
        f"jax.value_and_grad or eqx.filter_value_and_grad, got "
        f"{value_and_grad!r}."
    )

  differentiate = differentiator(value_and_grad, argnums=argnums, has_aux=has_aux,
                                 caller=caller)
  grad_at = differentiate(fun)
  check_leaves = value_and_grad is jax.value_and_grad

  def scaled_value_and_grad_fn(*args, **kwargs):
    if check_leaves:
      _check_array_leaves(args, argnums, caller)
    return grad_at(loss_scale, *args, **kwargs)

  return scaled_value_and_grad_fn


def differentiator(value_and_grad: Callable[..., Any], *, argnums: int | Sequence[int],
                   has_aux: bool, caller: str) -> Callable[..., Any]:
  """``differentiate(f)`` giving ``at(scale, *args, **kwargs)``.

  ``at`` returns the unscaled loss (with aux when ``has_aux``) of
  ``f(*args, **kwargs)`` and the gradients of ``scale.scale(loss)``, taken
  with ``value_and_grad``.

  Raises:
    TypeError: if ``argnums`` is not 0 for a ``value_and_grad`` without
      ``argnums``.
  """
  takes_argnums = _takes_argnums(value_and_grad)
  if not takes_argnums and argnums != 0:
    raise TypeError(
        f"{caller}(argnums={argnums!r}): {_name(value_and_grad)} takes no "
        "argnums; it differentiates the first argument. Put what you "
        "differentiate first (several objects as one tuple), and leave "
        "argnums at 0."
    )

  def differentiate(f):
    def at(scale, *args, **kwargs):
      def scaled(*args, **kwargs):
        return _checked_scaled_loss(f, scale, has_aux, caller, args, kwargs)

      if takes_argnums:
        grad_fn = value_and_grad(scaled, argnums=argnums, has_aux=True)
      else:
        grad_fn = value_and_grad(scaled, has_aux=True)
      (_, (loss, aux)), grads = grad_fn(*args, **kwargs)
      return ((loss, aux) if has_aux else loss), grads

    return at

  return differentiate


def _checked_scaled_loss(fun, loss_scale, has_aux, caller, args, kwargs):
  """``(loss_scale.scale(loss), (loss, aux))`` of ``fun(*args, **kwargs)``, checked."""
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
  if not isinstance(loss, _ARRAY_LEAVES):
    if has_aux:
      fix = ("Return (loss, aux) with the loss a scalar array first, e.g. "
             "(loss, {'accuracy': accuracy}).")
    elif isinstance(loss, tuple) and len(loss) == 2:
      fix = "If fun returns (loss, aux), pass has_aux=True."
    else:
      fix = ("Return the loss as a scalar array; to return more (a dict of "
             "metrics, say), return (loss, aux) and pass has_aux=True.")
    raise TypeError(
        f"{caller}{'(has_aux=True)' if has_aux else ''} expects fun to return "
        f"a scalar loss, got a {type(loss).__name__}. {fix}"
    )
  if np.shape(loss) != ():
    raise TypeError(
        f"{caller} expects fun to return a scalar loss, got shape "
        f"{np.shape(loss)}. Reduce it first, e.g. with jnp.mean(...)."
    )
  dtype = jnp.result_type(loss)
  if jnp.issubdtype(dtype, jnp.complexfloating):
    raise TypeError(
        f"{caller} expects fun to return a real floating-point loss, got "
        f"dtype {dtype}: only its real part would be differentiated "
        "(jax.value_and_grad refuses it too). Return a real loss, e.g. "
        "jnp.abs(z) ** 2 or z.real."
    )
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"{caller} expects fun to return a real floating-point loss, got "
        f"dtype {dtype}, whose gradients are all zero (jax.value_and_grad "
        "refuses it too). Compute the loss from floating values, e.g. "
        "x.astype(jnp.float32)."
    )
  return loss_scale.scale(loss), (loss, aux)
