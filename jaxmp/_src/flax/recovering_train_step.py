"""Recovering the batch with the whole ``TrainState`` step in the loop.

:func:`recovering_train_step` is :func:`jaxmp.recovering_step` for a
:class:`jaxmp.flax.TrainState`: the step (``state.value_and_grad`` and
``state.apply_gradients``) is the body of the same do-while loop, which
carries the whole state. A skipped update leaves the params, the optimizer
state and every field written through ``apply_gradients`` bit-identical, so
each retry starts from them again at the backed-off scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax

from jaxmp._src.loss_scale import NoOpLossScale
from jaxmp._src.recovering_step import (
    attempt_gradients,
    check_whole_step_recover,
    retry_while_skipped,
)
from jaxmp._src.flax.train_state import TrainState, fallback_loss
from jaxmp._src.recovery import Recover
from jaxmp._src.validation import check_bool
from jaxmp._src.value_and_grad import differentiator

_CALLER = "jaxmp.flax.recovering_train_step"


def recovering_train_step(
    loss_fn: Callable[..., Any],
    recover: Recover = Recover(),
    *,
    has_aux: bool = False,
    fields: Callable[[Any], Mapping[str, Any]] | None = None,
) -> Callable[..., Any]:
  """A ``TrainState`` step that recovers a non-finite batch, free when finite.

  The returned ``step(state, *args, **kwargs)`` does what this plain step
  does, where ``state`` is a :class:`jaxmp.flax.TrainState`::

    loss, grads = state.value_and_grad(loss_fn)(state.params, state, *args)
    state = state.apply_gradients(grads=grads)

  and, when the loss-scaling optimizer skips the update because the
  gradients were not finite, recomputes the same batch inside the same step,
  as :class:`jaxmp.Recover` describes: at the backed-off scale, up to
  ``recover.max_retries`` times, then once with ``recover.fallback`` at
  scale 1. It is :func:`jaxmp.recovering_step` for a ``TrainState``: the
  step is the body of one ``lax.while_loop`` whose first iteration is the
  step itself, carrying the whole state. A finite step compiles to what the
  plain step does (bytes accessed and temporary memory within 0.5%,
  docs/when-fp16-fails.md), and gives its bits.

  **The loss function** is called as ``loss_fn(params, state, *args,
  **kwargs)``: the params to differentiate (cast to the policy's compute
  dtype) and the state of the step, for ``state.apply_fn`` and fields such
  as ``state.batch_stats``; on every retry that state is the step's own
  (only the loss scale has moved). **Other fields** (BatchNorm statistics,
  EMA params): with ``has_aux``, ``fields(aux)`` returns them as a dict,
  passed as ``state.apply_gradients(..., **fields(aux))`` in each attempt,
  so they are written with the applied update and kept bit-identical when
  the batch is lost.

  ``state.step`` grows by one per call, however many attempts ran; the
  metrics (``recovered_steps``, ``fallback_steps``, ``lost_steps``,
  ``skipped_steps``) count the step once, as with ``recover=`` on
  :meth:`jaxmp.flax.TrainState.value_and_grad`. The devices agree on each
  retry through the optimizer's own check (``TrainState.create(...,
  axis_name=...)`` inside ``shard_map``; nothing is needed under sharded
  ``jit``). FP8 meta (``state.fp8_meta``) is refused, as it is with
  ``value_and_grad(recover=)``.

  Args:
    loss_fn: ``loss_fn(params, state, *args, **kwargs)`` returning a scalar
      loss, or ``(loss, aux)`` when ``has_aux``.
    recover: the :class:`jaxmp.Recover` configuration (default
      ``jaxmp.Recover()``: 4 retries, no fallback). Its ``fallback`` is a
      policy (``"float32"``: ``loss_fn`` runs under it at scale 1, as in
      :meth:`jaxmp.flax.TrainState.value_and_grad`) or a function with
      ``loss_fn``'s signature.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    fields: with ``has_aux``, ``fields(aux)`` giving the other fields of the
      state to write (``lambda aux: {"batch_stats": aux["batch_stats"]}``).
      Default None: only the params and the optimizer state change.

  Returns:
    ``step(state, *args, **kwargs)`` returning ``(state, loss, recovery)``:
    the new state, the unscaled loss of the attempt that was applied
    (``(loss, aux)`` when ``has_aux``) and its :class:`jaxmp.RecoveryInfo`
    (``recovery.finite`` says whether the update was applied).

  Raises:
    TypeError: if ``recover`` is not a :class:`jaxmp.Recover`, ``has_aux``
      not a bool, ``fields`` not a function; when called, if ``state`` is
      not a :class:`jaxmp.flax.TrainState` or ``fields(aux)`` not a dict.
    ValueError: if ``recover`` has an ``axis_name``, ``fields`` comes without
      ``has_aux``, or the fallback policy computes in bfloat16 where it is not
      native; when called, if the state has FP8 meta.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp, jaxmp.flax
    >>> state = jaxmp.flax.TrainState.create(
    ...     apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(1e-6),
    ...     policy="mixed_float16", loss_scale=jaxmp.DynamicLossScale(2.0**16))
    >>> loss_fn = lambda params, state: jnp.sum(params["w"] * 3.0)  # fp16 grads
    >>> step = jax.jit(jaxmp.flax.recovering_train_step(loss_fn))
    >>> state, loss, recovery = step(state)
    >>> int(recovery.retries), bool(recovery.finite)  # recovered at 2**14
    (2, True)
    >>> int(state.step), int(state.metrics["recovered_steps"])
    (1, 1)
  """
  recover = check_whole_step_recover(
      recover, _CALLER, optimizer="TrainState.create(..., axis_name={!r})",
      fallback="'float32'")
  has_aux = check_bool(_CALLER, "has_aux", has_aux)
  if fields is not None and not callable(fields):
    raise TypeError(
        f"{_CALLER}: fields must be a function of the aux giving the fields "
        f"to write, e.g. fields=lambda aux: {{'batch_stats': "
        f"aux['batch_stats']}}; got {fields!r}.")
  if fields is not None and not has_aux:
    raise ValueError(
        f"{_CALLER}: fields=... computes the fields from the loss function's "
        "aux, but has_aux is False. Return (loss, aux) from the loss function "
        "and pass has_aux=True.")
  fallback_fun = fallback_loss(loss_fn, recover, _CALLER)
  fallback_at = None if fallback_fun is None else differentiator(
      jax.value_and_grad, argnums=0, has_aux=has_aux, caller=_CALLER)(fallback_fun)
  no_scale = NoOpLossScale()

  def step(state, *args, **kwargs):
    if not isinstance(state, TrainState):
      raise TypeError(
          f"{_CALLER}: the step takes a jaxmp.flax.TrainState first, got a "
          f"{type(state).__name__}. For params and an optax state, use "
          "jaxmp.recovering_step(loss_fn, tx, recover).")
    if state.fp8_meta is not None:
      raise ValueError(
          f"{_CALLER} does not support FP8 meta: a retry at a backed-off "
          "scale would need the meta in that scale's units. Train the FP8 "
          "state with state.value_and_grad and state.apply_gradients, which "
          "skip a non-finite step and keep the meta.")
    start = state.step

    def attempt(state, info):
      # The carried state holds the attempt's loss scale, which
      # state.value_and_grad reads.
      out, grads = attempt_gradients(
          info, lambda: state.value_and_grad(loss_fn, has_aux=has_aux)(
              state.params, state, *args, **kwargs),
          None if fallback_at is None else (
              lambda: fallback_at(no_scale, state.params, state, *args, **kwargs)),
          _CALLER)
      written = {} if fields is None else _fields_of(fields, out[1])
      # A skipped attempt leaves the state as it was but for ``step``, which
      # apply_gradients advances: each attempt starts from the step's own.
      state = state.replace(step=start).apply_gradients(
          grads=grads, recovery=info, **written)
      return state, out

    return retry_while_skipped(
        attempt, state, recover, fallback_at is not None,
        opt_state_of=lambda state: state.opt_state,
        with_opt_state=lambda state, opt_state: state.replace(opt_state=opt_state),
        caller=_CALLER)

  return step


def _fields_of(fields: Callable[[Any], Any], aux: Any) -> dict[str, Any]:
  """``fields(aux)``, checked to be a mapping of field names."""
  written = fields(aux)
  if not isinstance(written, Mapping):
    raise TypeError(
        f"{_CALLER}: fields(aux) must return a dict of field names to new "
        f"values, e.g. {{'batch_stats': aux['batch_stats']}}; got a "
        f"{type(written).__name__}.")
  return dict(written)
