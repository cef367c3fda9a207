"""A Flax ``TrainState`` for mixed-precision training with loss scaling."""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from flax import struct
from flax.training import train_state

from jaxmp._src.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from jaxmp._src.loss_scaling import (
  LossScalingState,
  get_loss_scale,
  loss_scaling,
  loss_scaling_metrics,
)
from jaxmp._src.policy import PolicyLike, get_policy
from jaxmp._src.precision_audit import warn_on_first_trace
from jaxmp._src.value_and_grad import scaled_value_and_grad


def _as_policy(spec: Any) -> PolicyLike:
  """Returns ``spec`` as a policy: a policy kind as is, else ``get_policy(spec)``.

  Accepts anything :func:`jaxmp.get_policy` takes and every policy kind
  (:class:`jaxmp.PathPolicy`, :class:`jaxmp.flax.ModulePolicy`). The policy
  of inputs and outputs is checked here, so that a rule-based policy without
  a default fails at ``create``.
  """
  policy = spec if isinstance(spec, PolicyLike) else get_policy(spec)
  policy.io_policy  # pylint: disable=pointless-statement
  return policy


class TrainState(train_state.TrainState):
  """A Flax ``TrainState`` that trains with a dtype policy and loss scaling.

  :meth:`create` wraps ``tx`` with :func:`jaxmp.loss_scaling`, so
  :meth:`apply_gradients` takes the gradients of the *scaled* loss, unscales
  them and skips the update (params and inner optimizer state bit-identical)
  when any of them is inf or nan. :meth:`value_and_grad` produces those
  gradients from a loss function run under the policy.

  **Steps.** ``step`` counts calls to ``apply_gradients``, as in Flax: it grows
  on skipped steps too. The number of skipped steps is
  ``state.metrics["skipped_steps"]``, so the number of applied updates is
  ``step - skipped_steps``. optax schedules and counters *inside* ``tx`` (e.g.
  the step count of ``optax.adam`` or of a learning-rate schedule) are part of
  the inner state and do not advance on skipped steps.

  Attributes:
    policy: the :class:`jaxmp.Policy` (or :class:`jaxmp.PathPolicy`, or
      :class:`jaxmp.flax.ModulePolicy`); static, not a pytree leaf.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> import flax.linen as nn
    >>> model = nn.Dense(1)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> state = jaxmp.flax.TrainState.create(
    ...     apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
    ...     tx=optax.sgd(0.1), policy="mixed_float16",
    ...     loss_scale=jaxmp.DynamicLossScale(2.0**10))
    >>> def loss_fn(params, x, y):
    ...   return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)
    >>> loss, grads = state.value_and_grad(loss_fn)(state.params, x, y)
    >>> state = state.apply_gradients(grads=grads)
    >>> int(state.step), float(state.loss_scale.loss_scale), state.params["kernel"].dtype
    (1, 1024.0, dtype('float32'))
  """

  policy: Any = struct.field(pytree_node=False, default=None)

  @classmethod
  def create(
      cls,
      *,
      apply_fn: Callable[..., Any],
      params: Any,
      tx: optax.GradientTransformation,
      policy: Any = "float32",
      loss_scale: LossScale | None = None,
      **kwargs,
  ) -> "TrainState":
    """Creates a state with ``step=0``; wraps ``tx`` with loss scaling.

    Args:
      apply_fn: usually ``model.apply``. With a
        :class:`jaxmp.flax.ModulePolicy` it is wrapped by
        :meth:`~jaxmp.flax.ModulePolicy.wrap_apply`, so call
        ``state.apply_fn`` (not ``model.apply``) in the loss function.
      params: the model's parameters; cast to the policy's ``param_dtype``
        (per path with a :class:`jaxmp.PathPolicy`; kept as they are with a
        module policy).
      tx: the optimizer, *not* yet wrapped with :func:`jaxmp.loss_scaling`
        (clipping, weight decay and schedules inside).
      policy: anything :func:`jaxmp.get_policy` takes (``"mixed_float16"``,
        ``"p=f32,c=bf16,o=f32"``, a :class:`jaxmp.Policy`), a
        :class:`jaxmp.PathPolicy` or a :class:`jaxmp.flax.ModulePolicy`.
        Default ``"float32"``.
      loss_scale: the initial loss scale. Default:
        ``jaxmp.DynamicLossScale()`` when the policy computes in float16 (or
        float8), else ``jaxmp.NoOpLossScale()``.
      **kwargs: further fields of a subclass, as in Flax.

    Returns:
      The new state.

    Raises:
      ValueError: if ``tx`` is already wrapped with :func:`jaxmp.loss_scaling`.
      TypeError: if ``loss_scale`` is not a loss scale.
    """
    policy = _as_policy(policy)
    if loss_scale is None:
      loss_scale = (
          DynamicLossScale() if policy.needs_loss_scaling else NoOpLossScale()
      )
    if not isinstance(loss_scale, LossScale):
      raise TypeError(
          "TrainState.create: loss_scale must be a jaxmp loss scale such as "
          f"jaxmp.DynamicLossScale(); got {loss_scale!r}."
      )
    apply_fn = policy.wrap_apply(apply_fn)
    params = policy.params_for_storage(params)
    abstract = jax.eval_shape(tx.init, params)
    is_state = lambda x: isinstance(x, LossScalingState)
    if any(is_state(x) for x in jax.tree_util.tree_leaves(abstract, is_leaf=is_state)):
      raise ValueError(
          "TrainState.create: tx is already wrapped with jaxmp.loss_scaling. "
          "Pass the bare optimizer (e.g. optax.adamw(1e-3)) and the loss scale "
          "as loss_scale=...; create wraps it for you."
      )
    tx = loss_scaling(tx, loss_scale)
    return cls(
        step=jax.numpy.zeros([], jax.numpy.int32),
        apply_fn=apply_fn,
        params=params,
        tx=tx,
        opt_state=tx.init(params),
        policy=policy,
        **kwargs,
    )

  @property
  def loss_scale(self) -> LossScale:
    """The current loss scale (from the optimizer state)."""
    return get_loss_scale(self.opt_state)

  @property
  def metrics(self) -> dict[str, jax.Array]:
    """:func:`jaxmp.loss_scaling_metrics` of the optimizer state; jit-safe."""
    return loss_scaling_metrics(self.opt_state)

  def value_and_grad(
      self, loss_fn: Callable[..., Any], has_aux: bool = False
  ) -> Callable[..., Any]:
    """Returns a function of ``(params, *args, **kwargs)`` giving loss and grads.

    The returned function runs ``loss_fn(params, *args, **kwargs)`` under the
    policy: the params are cast to the compute dtype (per path with a
    :class:`jaxmp.PathPolicy`; inside each module with a
    :class:`jaxmp.flax.ModulePolicy`), the floating inputs to the (default)
    compute dtype, and the loss (and aux) to the output dtype. It returns the
    *unscaled* loss (``(loss, aux)`` when ``has_aux``) and the gradients of the
    *scaled* loss with respect to ``params``, in the params' own dtype, ready
    for :meth:`apply_gradients`.

    The first call with given shapes (under ``jit``: once per compilation)
    also traces the forward pass once more, as :func:`jaxmp.precision_report`
    does (running nothing), and warns with a :class:`jaxmp.PrecisionWarning` when a 16-bit
    policy does not take effect (a layer's own ``dtype=jnp.float32``, a
    float32 batch captured by ``loss_fn``'s closure).

    Args:
      loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar loss,
        or ``(loss, aux)`` when ``has_aux``.
      has_aux: whether ``loss_fn`` returns auxiliary data.

    Returns:
      The function described above.
    """
    policy = self.policy
    if policy is None:
      raise ValueError(
          "This TrainState has no policy: build it with "
          "jaxmp.flax.TrainState.create(..., policy='mixed_float16'), not with "
          "the constructor."
      )
    io_policy = policy.io_policy

    def run(params, *args, **kwargs):
      params = policy.params_for_compute(params)
      args, kwargs = io_policy.cast_to_compute((args, kwargs))
      return io_policy.cast_to_output(loss_fn(params, *args, **kwargs))

    grad_fn = scaled_value_and_grad(run, self.loss_scale, has_aux=has_aux)
    # At trace time, once per compilation: warn if the policy does not take
    # effect (docs/precision-audit.md).
    return warn_on_first_trace(
        grad_fn, run, compute_dtype=io_policy.compute_dtype,
        caller="TrainState.value_and_grad", names_from=loss_fn)
