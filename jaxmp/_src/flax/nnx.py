"""NNX training with loss scaling: the scaled ``nnx.value_and_grad``."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxmp._src.loss_scale import LossScale
from jaxmp._src.precision_audit import warn_on_first_trace
from jaxmp._src.value_and_grad import scale_then_differentiate


def nnx_scaled_value_and_grad(
    fun: Callable[..., Any],
    loss_scale: LossScale,
    *,
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """Like ``nnx.value_and_grad``, but differentiates the scaled loss.

  The NNX counterpart of :func:`jaxmp.scaled_value_and_grad`: ``fun`` takes
  NNX modules (or other arguments), the gradients are taken with respect to
  the ``nnx.Param`` variables of the argument(s) ``argnums`` and are those of
  ``loss_scale.scale(loss)``, which is what an ``nnx.Optimizer`` built on
  :func:`jaxmp.loss_scaling` expects. The returned value is the *unscaled*
  loss (with aux when ``has_aux``).

  The first call with given shapes (under ``jit``: once per compilation)
  also traces ``fun`` on a copy of the model, running nothing, and warns with
  a :class:`jaxmp.PrecisionWarning` when the model's 16-bit dtype does not
  take effect (see :func:`jaxmp.precision_report`).

  Args:
    fun: the loss function; returns a scalar (and aux when ``has_aux``).
    loss_scale: the current loss scale,
      ``jaxmp.get_loss_scale(optimizer.opt_state)``.
    argnums: which positional arguments to differentiate.
    has_aux: whether ``fun`` returns ``(loss, aux)``.

  Returns:
    A function with the signature of ``fun`` returning ``(loss, grads)`` or
    ``((loss, aux), grads)``.

  Raises:
    TypeError: if ``loss_scale`` is not a loss scale.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> optimizer = nnx.Optimizer(
    ...     model, jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale()),
    ...     wrt=nnx.Param)
    >>> x = jnp.ones((4, 2))
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...   loss_fn = lambda model: jnp.mean(model(x) ** 2)
    ...   loss, grads = jaxmp.flax.nnx_scaled_value_and_grad(
    ...       loss_fn, jaxmp.get_loss_scale(optimizer.opt_state))(model)
    ...   optimizer.update(model, grads)
    ...   return loss, jaxmp.loss_scaling_metrics(optimizer.opt_state)
    >>> loss, metrics = train_step(model, optimizer, x)
    >>> int(metrics["skipped_steps"]), float(metrics["loss_scale"])
    (0, 32768.0)
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  grad_fn = scale_then_differentiate(
      nnx.value_and_grad, fun, loss_scale, argnums=argnums, has_aux=has_aux,
      caller="nnx_scaled_value_and_grad",
      state_hint="With an nnx.Optimizer, pass "
      "jaxmp.get_loss_scale(optimizer.opt_state).")

  def on_a_copy(args, kwargs):  # the audit traces a copy: the model is untouched
    graphdef, state = nnx.split((args, kwargs))
    return lambda state: (lambda a, k: fun(*a, **k))(*nnx.merge(graphdef, state)), state

  # At trace time, once per compilation: warn if the 16-bit dtype the model
  # computes in does not take effect (docs/precision-audit.md).
  return warn_on_first_trace(
      grad_fn, fun, compute_dtype=None, caller="nnx_scaled_value_and_grad",
      prepare=on_a_copy)
