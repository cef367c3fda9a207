"""Recovering the batch with the whole step in the loop: ``recovering_step``.

:func:`recovering_step` builds a train step (gradients, optimizer update,
new params) that runs as the body of one ``lax.while_loop``: its first
iteration *is* the step, and it iterates again only while the loss-scaling
optimizer skipped the update. A skipped update leaves the params and the inner
optimizer state bit-identical (that is what the skip does), so each retry
starts from them again, at the scale the skip backed off to. On a finite step
the loop runs its body once, and the program holds one forward and backward
pass and one update, fused as in the plain step: nothing is copied or
materialised for the retries (docs/when-fp16-fails.md has the figures).

The retries keep the semantics of ``scaled_value_and_grad(..., recover=)``:
each attempt passes a :class:`jaxmp.RecoveryInfo` to the optimizer's update,
whose counters are rewound to the step's own before every attempt, so that
the last one counts the step once.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxmp._src.loss_scale import NoOpLossScale, StaticLossScale
from jaxmp._src.loss_scaling import (
    LossScalingState,
    _find_state,
    loss_scaling_states_with_path,
)
from jaxmp._src.recovery import (
    Recover,
    RecoveryInfo,
    check_recover,
    like_the_attempt,
)
from jaxmp._src.value_and_grad import _check_array_leaves, differentiator

_CALLER = "jaxmp.recovering_step"


def recovering_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    recover: Recover = Recover(),
    *,
    has_aux: bool = False,
) -> Callable[..., Any]:
  """A train step that recovers a non-finite batch, at no cost when finite.

  The returned ``step(params, opt_state, *args, **kwargs)`` computes the
  gradients of ``loss_fn(params, *args, **kwargs)`` scaled by the optimizer's
  loss scale, runs ``tx.update`` and applies the updates, as this plain step
  does::

    loss, grads = jaxmp.scaled_value_and_grad(
        loss_fn, jaxmp.get_loss_scale(opt_state))(params, *args)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)

  When ``tx`` (a :func:`jaxmp.loss_scaling` optimizer) skips the update
  because the gradients were not finite, the same batch is recomputed inside
  the same step, as :class:`jaxmp.Recover` describes: at the backed-off
  scale, up to ``recover.max_retries`` times, then once with
  ``recover.fallback`` (a function with ``loss_fn``'s signature that
  computes in float32 or bfloat16) at scale 1.

  **What it costs.** The step is the body of a ``lax.while_loop`` whose first
  iteration is the step itself; a retry is one more iteration. A skipped
  update keeps the params and the optimizer state bit-identical, so the loop
  carries them in place and a retry starts from them. On a finite step the
  compiled program reads and writes what the plain step does, and its
  temporary memory is that of the plain step (within 0.5% on the benchmark
  transformer; docs/when-fp16-fails.md), whereas
  ``scaled_value_and_grad(..., recover=)`` materialises the gradients at the
  end of its loop. With a ``fallback``, the body chooses between the two
  gradient computations with a ``lax.cond``; XLA's cost analysis counts the
  larger of the two.

  Use :func:`jaxmp.scaled_value_and_grad` with ``recover=`` instead where the
  step does more between the gradients and the update (several optimizers, a
  ``pmean`` of your own), and with :func:`jaxmp.multi_steps`, which recovers
  each micro-batch.

  Args:
    loss_fn: ``loss_fn(params, *args, **kwargs)`` returning a scalar loss (and
      aux when ``has_aux``); ``params`` is a pytree of arrays, differentiated.
    tx: a :func:`jaxmp.loss_scaling` optimizer (possibly inside
      ``optax.inject_hyperparams``; not :func:`jaxmp.multi_steps`).
    recover: the :class:`jaxmp.Recover` configuration (default
      ``jaxmp.Recover()``: 4 retries, no fallback). Its ``fallback``, if
      given, is a function with ``loss_fn``'s signature. The devices agree on
      each retry through the optimizer's own check: pass ``axis_name`` to
      :func:`jaxmp.loss_scaling`, not to ``Recover``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Returns:
    ``step(params, opt_state, *args, **kwargs)`` returning ``(params,
    opt_state, loss, recovery)``: the new params and optimizer state, the
    unscaled loss of the attempt that was applied (``(loss, aux)`` when
    ``has_aux``), and the :class:`jaxmp.RecoveryInfo` of the step (its
    ``finite`` says whether the update was applied).

  Raises:
    TypeError: if ``recover`` is not a :class:`jaxmp.Recover`, its fallback a
      policy rather than a function, or ``tx`` not an optax transformation;
      when called, as :func:`jaxmp.scaled_value_and_grad` does for a bad loss.
    ValueError: if ``recover`` has an ``axis_name``; when called, if
      ``opt_state`` holds no loss-scaling state (or more than one), or holds
      it inside :func:`jaxmp.multi_steps` or ``optax.MultiSteps``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16) * 3.0)  # fp16 grads
    >>> tx = jaxmp.loss_scaling(optax.sgd(1e-6), jaxmp.DynamicLossScale(2.0**16))
    >>> step = jax.jit(jaxmp.recovering_step(loss_fn, tx))
    >>> w = jnp.ones(2)
    >>> w, opt_state, loss, recovery = step(w, tx.init(w))
    >>> int(recovery.retries), bool(recovery.finite)  # recovered at 2**14
    (2, True)
    >>> metrics = jaxmp.loss_scaling_metrics(opt_state)
    >>> int(metrics["recovered_steps"]), int(metrics["skipped_steps"])
    (1, 0)
  """
  recover = check_whole_step_recover(
      recover, _CALLER, optimizer="jaxmp.loss_scaling(..., axis_name={!r})")
  fallback = recover.fallback
  if fallback is not None and not callable(fallback):
    raise TypeError(
        f"{_CALLER}: the recovery fallback {fallback} is a policy, which "
        f"{_CALLER} cannot apply to an arbitrary loss function. Pass a "
        "function with the loss function's signature that computes in the "
        "fallback precision: jaxmp.Recover(fallback=loss_fn_in_float32).")
  if not (hasattr(tx, "init") and hasattr(tx, "update")):
    raise TypeError(
        f"{_CALLER} expects the optimizer as its second argument, an "
        "optax.GradientTransformation wrapped with jaxmp.loss_scaling; got "
        f"{tx!r}.")
  differentiate = differentiator(
      jax.value_and_grad, argnums=0, has_aux=has_aux, caller=_CALLER)
  grad_at = differentiate(loss_fn)
  fallback_at = None if fallback is None else differentiate(fallback)
  no_scale = NoOpLossScale()

  def step(params, opt_state, *args, **kwargs):
    _check_array_leaves((params,), 0, _CALLER)

    def gradients(info, params):
      return attempt_gradients(
          info, lambda: grad_at(info.loss_scale, params, *args, **kwargs),
          None if fallback_at is None else (
              lambda: fallback_at(no_scale, params, *args, **kwargs)),
          _CALLER)

    def attempt(state, info):
      params, opt_state = state
      out, grads = gradients(info, params)
      updates, opt_state = tx.update(grads, opt_state, params, recovery=info)
      return (optax.apply_updates(params, updates), opt_state), out

    (params, opt_state), out, info = retry_while_skipped(
        attempt, (params, opt_state), recover, fallback is not None,
        opt_state_of=lambda state: state[1],
        with_opt_state=lambda state, opt_state: (state[0], opt_state),
        caller=_CALLER)
    return params, opt_state, out, info

  return step


def check_whole_step_recover(recover: Any, caller: str, *, optimizer: str,
                             fallback: str = "loss_fn_f32") -> Recover:
  """``recover``, checked for a whole-step retry loop.

  ``fallback`` is the fallback the error's example shows. ``optimizer`` is
  where the axis name goes instead, a format string for
  the name (``"jaxmp.loss_scaling(..., axis_name={!r})"``).

  Raises:
    TypeError: if ``recover`` is not a :class:`jaxmp.Recover`.
    ValueError: if it has an ``axis_name``.
  """
  recover = check_recover(recover, caller, optional=False, fallback=fallback)
  if recover.axis_name is not None:
    raise ValueError(
        f"{caller}(recover=jaxmp.Recover(axis_name={recover.axis_name!r})): "
        "the retries follow the optimizer's own finiteness check, so the "
        "devices agree through it. Pass the axis name to the optimizer, "
        f"{optimizer.format(recover.axis_name)}, and drop it from Recover.")
  return recover


def attempt_gradients(
    info: RecoveryInfo,
    training_precision: Callable[[], tuple[Any, Any]],
    fallback_precision: Callable[[], tuple[Any, Any]] | None,
    caller: str,
) -> tuple[Any, Any]:
  """The ``(out, grads)`` of the attempt ``info`` describes.

  ``training_precision()`` computes them at ``info.loss_scale``;
  ``fallback_precision()`` (None without a fallback) in the fallback
  precision at scale 1, which the attempt runs when ``info.fell_back``
  (a ``lax.cond``), its results cast to the dtypes of the other's.
  """
  if fallback_precision is None:
    return training_precision()
  return jax.lax.cond(
      info.fell_back,
      lambda: like_the_attempt(
          fallback_precision(), jax.eval_shape(training_precision), caller),
      training_precision)


def _refuse_accumulation(opt_state: Any, caller: str) -> None:
  """Refuses a loss-scaling state inside ``optax.MultiSteps``."""
  for path, accumulating in optax.tree_utils.tree_get_all_with_path(
      opt_state, "MultiStepsState",
      filtering=lambda _, value: isinstance(value, optax.MultiStepsState)):
    if loss_scaling_states_with_path(accumulating.inner_opt_state):
      raise ValueError(
          f"{caller}: the optimizer accumulates gradients (a MultiStepsState "
          f"at {jax.tree_util.keystr(path) or 'the top'} of its state), and "
          "skips only on the last micro-batch, so a whole-step retry cannot "
          "see a micro-batch overflow. Recover each micro-batch with "
          "jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale("
          "opt_state), recover=jaxmp.Recover()) and pass its recovery to "
          "tx.update(..., recovery=recovery).")


def _scaling_state(opt_state: Any) -> LossScalingState:
  """The one loss-scaling state of ``opt_state`` (checked by ``_find_state``)."""
  return loss_scaling_states_with_path(opt_state)[0][1]


def _with_loss_scaling_state(opt_state: Any, new: LossScalingState) -> Any:
  """``opt_state`` with its one loss-scaling state replaced by ``new``."""
  return jax.tree_util.tree_map(
      lambda node: new if isinstance(node, LossScalingState) else node,
      opt_state, is_leaf=lambda node: isinstance(node, LossScalingState))


def retry_while_skipped(
    attempt: Callable[[Any, RecoveryInfo], tuple[Any, Any]],
    state: Any,
    recover: Recover,
    has_fallback: bool,
    *,
    opt_state_of: Callable[[Any], Any],
    with_opt_state: Callable[[Any, Any], Any],
    caller: str,
) -> tuple[Any, Any, RecoveryInfo]:
  """Runs ``attempt`` in a do-while loop until its update is not skipped.

  ``attempt(state, info)`` computes the gradients at ``info.loss_scale`` (in
  the fallback precision at scale 1 when ``info.fell_back``), runs the
  optimizer's update with ``recovery=info`` and returns ``(state, out)``;
  ``state`` is any pytree that holds the optimizer state, read with
  ``opt_state_of(state)`` and replaced with ``with_opt_state(state,
  opt_state)`` (``(params, opt_state)`` for :func:`recovering_step`, a
  ``jaxmp.flax.TrainState`` for ``recovering_train_step``). Returns the
  state and ``out`` of the last attempt and its :class:`jaxmp.RecoveryInfo`.
  """
  original = _find_state(opt_state_of(state), caller)  # warns if misplaced
  _refuse_accumulation(opt_state_of(state), caller)
  scale = jax.tree_util.tree_map(jnp.asarray, original.loss_scale)
  backs_off = not isinstance(scale, (StaticLossScale, NoOpLossScale))
  in_training_precision = 1 + (recover.max_retries if backs_off else 0)
  attempts = in_training_precision + int(has_fallback)

  def rewound(state):
    """``state`` with the step's own counters, and the current scale."""
    current = _scaling_state(opt_state_of(state))
    return with_opt_state(state, _with_loss_scaling_state(
        opt_state_of(state), original._replace(
            inner_state=current.inner_state, loss_scale=current.loss_scale)))

  def info_for(k, state, last):
    """The RecoveryInfo of attempt ``k`` (0 is the step itself)."""
    retries = jnp.minimum(k, in_training_precision - 1).astype(jnp.int32)
    if not has_fallback:
      return RecoveryInfo(
          loss_scale=_scaling_state(opt_state_of(state)).loss_scale,
          retries=retries, fell_back=jnp.zeros([], jnp.bool_), finite=None)
    fell_back = k >= in_training_precision
    # The fallback attempt reports the scale of the last attempt in the
    # training precision, as scaled_value_and_grad(recover=) does: the
    # optimizer backs it off once more for that attempt's overflow.
    current = _scaling_state(opt_state_of(state)).loss_scale
    at = jax.tree_util.tree_map(
        lambda a, b: jnp.where(fell_back, a, b), last.loss_scale, current)
    return RecoveryInfo(loss_scale=at, retries=retries, fell_back=fell_back,
                        finite=None)

  first = RecoveryInfo(loss_scale=scale, retries=jnp.zeros([], jnp.int32),
                       fell_back=jnp.zeros([], jnp.bool_), finite=None)
  out_shape = jax.eval_shape(lambda s: attempt(s, first)[1], state)
  carry = (state, jnp.zeros([], jnp.int32), first,
           jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), out_shape))

  def again(carry):
    state, k, _, _ = carry
    skipped = jnp.logical_not(_scaling_state(opt_state_of(state)).last_finite)
    return (k == 0) | (skipped & (k < attempts))

  def body(carry):
    state, k, last, _ = carry
    state = rewound(state)
    info = info_for(k, state, last)
    state, out = attempt(state, info)
    return state, k + 1, info, out

  state, _, info, out = jax.lax.while_loop(again, body, carry)
  finite = jnp.asarray(_scaling_state(opt_state_of(state)).last_finite)
  return state, out, info._replace(finite=finite)
