"""Recovering a non-finite batch inside the step: ``Recover`` and ``RecoveryInfo``.

:func:`jaxmp.scaled_value_and_grad` (and the Flax helpers) take
``recover=jaxmp.Recover(...)``. When the gradients at the current loss scale
are not finite, the same batch is recomputed in the same jitted step: at
backed-off scales (``loss_scale.adjust(False)`` once per retry, as if each
overflow had happened on a step of its own), then, if still not finite, once
under a fallback precision at scale 1. The returned :class:`RecoveryInfo`
tells :func:`jaxmp.loss_scaling` which scale the gradients were computed at.

A finite first attempt costs one scalar predicate: the recompute sits in a
``lax.while_loop`` (and a ``lax.cond``) whose body does not run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src.hardware import hardware_report
from jaxmp._src.loss_scale import (
    LossScale,
    NoOpLossScale,
    StaticLossScale,
    agree_across,
    all_finite,
)
from jaxmp._src.policy import Policy, get_policy
from jaxmp._src.validation import check_number

# Each retry adds a recompute to the compiled step's code only once (it is a
# loop), but a run that needs more than this many backoffs has a broken scale.
MAX_RETRIES = 64


@dataclasses.dataclass(frozen=True)
class Recover:
  """How to recover a batch whose gradients are not finite, inside the step.

  Pass it as ``recover=`` to :func:`jaxmp.scaled_value_and_grad`,
  :meth:`jaxmp.flax.TrainState.value_and_grad` or
  :func:`jaxmp.flax.nnx_scaled_value_and_grad`, or to the whole-step forms
  :func:`jaxmp.recovering_step`, :func:`jaxmp.flax.recovering_train_step`
  and :func:`jaxmp.flax.nnx_recovering_step`. Frozen and hashable: it is
  static configuration (a ``jax.jit`` static argument is fine).

  When the gradients at the current loss scale are not finite, the same
  batch is recomputed inside the same jitted step:

  1. at backed-off scales, up to ``max_retries`` times: before each retry the
     scale takes one ``adjust(False)``, exactly as if that overflow had
     happened on a step of its own (with hysteresis, the scale backs off only
     once the budget is used, as it would over several steps). Only a
     :class:`jaxmp.DynamicLossScale` changes on ``adjust(False)``, so static
     and no-op scales skip this stage;
  2. then, if still not finite and ``fallback`` is given, once in the
     fallback precision at scale 1.

  Only a batch still non-finite after that (bad data: nan inputs) is skipped,
  as without recovery.

  Attributes:
    max_retries: how many backed-off recomputes to try (0 goes straight to
      the fallback). Default 4: with the default backoff factor of 0.5, the
      gradients are tried down to 2**-4 of the current scale.
    fallback: None (no fallback), a policy spec (anything
      :func:`jaxmp.get_policy` takes, e.g. ``"float32"`` or
      ``"mixed_bfloat16"``), used by :meth:`jaxmp.flax.TrainState.value_and_grad`,
      which runs the loss under that policy; or a callable with the loss
      function's signature that computes the loss in the fallback precision,
      for :func:`jaxmp.scaled_value_and_grad` and the NNX helper. A policy
      must compute in float32 or bfloat16; bfloat16 is refused (when the
      value-and-grad is built) where :func:`jaxmp.hardware_report` says it is
      not native.
    axis_name: inside ``pmap`` or ``shard_map``, the axis name (or tuple of
      names) over which the batch is split, so that all devices agree on each
      retry (the finiteness flag is reduced with ``pmin``). Not needed under
      plain ``jit`` with sharded arrays, where the check is already global.

  Raises:
    TypeError: if ``max_retries`` is not an integer, or ``fallback`` is not
      None, a policy spec or a callable.
    ValueError: if ``max_retries`` is out of range, or ``fallback`` names an
      unknown policy, or one that computes in float16 or float8.

  Example:
    >>> import jaxmp
    >>> recover = jaxmp.Recover(max_retries=2, fallback="float32")
    >>> recover.max_retries, str(recover.fallback)
    (2, 'p=f32,c=f32,o=f32')
  """

  max_retries: int = 4
  fallback: Any = None
  axis_name: Any = None

  def __post_init__(self):
    object.__setattr__(self, "max_retries", check_number(
        "jaxmp.Recover", "max_retries", self.max_retries, integer=True,
        minimum=0, maximum=MAX_RETRIES,
        advice="Pass how many backed-off recomputes to try, e.g. 4; 0 goes "
        "straight to the fallback."))
    fallback = self.fallback
    if fallback is not None and (isinstance(fallback, Policy) or not callable(fallback)):
      try:
        fallback = get_policy(fallback)
      except (TypeError, ValueError) as error:
        raise type(error)(
            f"jaxmp.Recover(fallback={self.fallback!r}): the fallback must be "
            "None, a policy spec such as 'float32' or 'mixed_bfloat16', or a "
            "function with the loss function's signature that computes in the "
            f"fallback precision. ({error})") from None
      compute = np.dtype(fallback.compute_dtype)
      if compute.itemsize < 2 or compute == np.dtype(jnp.float16):
        raise ValueError(
            f"jaxmp.Recover(fallback={self.fallback!r}) computes in {compute}, "
            "which overflows at scale 1 sooner than the run it would rescue. "
            "Fall back to 'float32', or to 'mixed_bfloat16' where bfloat16 is "
            "native.")
      object.__setattr__(self, "fallback", fallback)
    try:
      hash(self.fallback)
      hash(self.axis_name)
    except TypeError:
      raise TypeError(
          "jaxmp.Recover is static configuration, so its fallback and "
          "axis_name must be hashable; got "
          f"fallback={self.fallback!r}, axis_name={self.axis_name!r}. Pass a "
          "plain function (not a functools.partial of arrays) and a string "
          "or tuple of strings.") from None


class RecoveryInfo(NamedTuple):
  """What a recovering value-and-grad did: pass it to the optimizer's update.

  A pytree of scalar arrays (and a loss scale), returned as the third element
  by :func:`jaxmp.scaled_value_and_grad` with ``recover=``; pass it on as
  ``tx.update(grads, opt_state, params, recovery=recovery)``.

  Attributes:
    loss_scale: the loss scale after the retries' backoffs: the scale the
      returned gradients were computed at, unless ``fell_back`` (then they
      were computed at scale 1).
    retries: int32, how many backed-off recomputes ran.
    fell_back: bool, whether the returned gradients come from the fallback.
    finite: bool, whether the returned gradients are all finite (agreed over
      ``axis_name``).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> fun = lambda w: jnp.sum(w.astype(jnp.float16) * 3.0)  # fp16 grads
    >>> loss, grads, info = jaxmp.scaled_value_and_grad(
    ...     fun, jaxmp.DynamicLossScale(2.0**16), recover=jaxmp.Recover())(jnp.ones(2))
    >>> int(info.retries), float(info.loss_scale.loss_scale), bool(info.finite)
    (2, 16384.0, True)
  """

  loss_scale: LossScale
  retries: jax.Array
  fell_back: jax.Array
  finite: jax.Array


def check_recover(recover: Any, caller: str, *, optional: bool = True,
                  fallback: str = "'float32'") -> Recover:
  """``recover`` if it is a :class:`Recover`; refuses anything else.

  ``optional`` says whether the caller also takes ``recover=None``, and
  ``fallback`` is the fallback its example shows (a function where policies
  are not accepted).
  """
  if not isinstance(recover, Recover):
    raise TypeError(
        f"{caller}(recover={recover!r}): recover must be a jaxmp.Recover, e.g. "
        f"recover=jaxmp.Recover(max_retries=4, fallback={fallback})"
        + (", or None." if optional else "."))
  return recover


def fallback_policy(recover: Recover, caller: str) -> Policy | None:
  """The fallback policy of ``recover`` (or None); refuses bf16 where not native."""
  policy = recover.fallback
  if not isinstance(policy, Policy):
    return None
  if (np.dtype(policy.compute_dtype) == np.dtype(jnp.bfloat16)
      and not hardware_report().native_bfloat16):
    report = hardware_report()
    raise ValueError(
        f"{caller}: the recovery fallback {policy} computes in bfloat16, which "
        f"is not native on this {report.platform} device (see "
        "jaxmp.hardware_report()): it would be emulated, slowly. Fall back to "
        "'float32' here: jaxmp.Recover(fallback='float32').")
  return policy


def agreed_finite(grads: Any, axis_name: Any, caller: str) -> jax.Array:
  """``all_finite(grads)``, reduced with ``pmin`` over ``axis_name`` if given."""
  return agree_across(
      all_finite(grads), axis_name,
      f"{caller}(recover=jaxmp.Recover(axis_name={axis_name!r})): that axis "
      "name is not bound here. Call it inside jax.shard_map or jax.pmap over "
      "that axis, or drop axis_name under plain jax.jit, where the check over "
      "sharded arrays is already global.")


def _cast_like(tree: Any, like: Any) -> Any:
  return jax.tree_util.tree_map(
      lambda x, y: jnp.asarray(x).astype(jnp.result_type(y)), tree, like)


def like_the_attempt(fallback_result: tuple[Any, Any], attempt_result: tuple[Any, Any],
                     caller: str) -> tuple[Any, Any]:
  """The fallback's ``(out, grads)`` cast to the dtypes of the attempt's.

  Raises:
    ValueError: if the fallback's gradients have another structure.
  """
  (fb_out, fb_grads), (out, grads) = fallback_result, attempt_result
  if (jax.tree_util.tree_structure(fb_grads)
      != jax.tree_util.tree_structure(grads)):
    raise ValueError(
        f"{caller}: the recovery fallback's gradients have the structure "
        f"{jax.tree_util.tree_structure(fb_grads)}, but the loss "
        f"function's have {jax.tree_util.tree_structure(grads)}. The "
        "fallback must take the same arguments and return the same kind "
        "of loss (and aux) as the loss function.")
  return _cast_like(fb_out, out), _cast_like(fb_grads, grads)


def recovering(
    attempt: Callable[[LossScale], tuple[Any, Any]],
    fallback_attempt: Callable[[], tuple[Any, Any]] | None,
    loss_scale: LossScale,
    recover: Recover,
    caller: str,
) -> tuple[Any, Any, RecoveryInfo]:
  """Runs ``attempt(loss_scale)`` and, while not finite, the recovery.

  ``attempt(scale)`` returns ``(out, grads)`` computed at ``scale`` (``out``
  may hold anything the attempt wants carried, e.g. NNX state);
  ``fallback_attempt()`` the same at scale 1 in the fallback precision (its
  results are cast to the first attempt's dtypes). Returns
  ``(out, grads, RecoveryInfo)``.
  """
  loss_scale = jax.tree_util.tree_map(jnp.asarray, loss_scale)
  out, grads = attempt(loss_scale)
  finite = agreed_finite(grads, recover.axis_name, caller)
  carry = (loss_scale, jnp.zeros([], jnp.int32), out, grads, finite)
  retries_change_scale = not isinstance(loss_scale, (StaticLossScale, NoOpLossScale))
  if recover.max_retries > 0 and retries_change_scale:

    def not_yet(carry):
      _, retries, _, _, finite = carry
      return jnp.logical_not(finite) & (retries < recover.max_retries)

    def retry(carry):
      scale, retries, _, _, _ = carry
      scale = scale.adjust(jnp.zeros([], jnp.bool_))
      out, grads = attempt(scale)
      return (scale, retries + 1, out, grads,
              agreed_finite(grads, recover.axis_name, caller))

    carry = jax.lax.while_loop(not_yet, retry, carry)
  fell_back = jnp.zeros([], jnp.bool_)
  if fallback_attempt is not None:

    def keep(carry):
      return carry + (jnp.zeros([], jnp.bool_),)

    def fall_back(carry):
      scale, retries, out, grads, _ = carry
      fb_out, fb_grads = like_the_attempt(fallback_attempt(), (out, grads), caller)
      return (scale, retries, fb_out, fb_grads,
              agreed_finite(fb_grads, recover.axis_name, caller),
              jnp.ones([], jnp.bool_))

    scale, retries, out, grads, finite, fell_back = jax.lax.cond(
        carry[-1], keep, fall_back, carry)
  else:
    scale, retries, out, grads, finite = carry
  return out, grads, RecoveryInfo(
      loss_scale=scale, retries=retries, fell_back=fell_back, finite=finite)


def check_recovery(recovery: Any, loss_scale: LossScale, owner: str) -> RecoveryInfo:
  """Refuses a ``recovery`` that is not a :class:`RecoveryInfo` of this scale."""
  if not isinstance(recovery, RecoveryInfo):
    raise TypeError(
        f"{owner}'s update: recovery must be the jaxmp.RecoveryInfo that "
        "jaxmp.scaled_value_and_grad(..., recover=jaxmp.Recover()) returned "
        f"as its third result; got a {type(recovery).__name__}.")
  theirs = getattr(recovery.loss_scale, "config", None)
  if not isinstance(recovery.loss_scale, LossScale) or theirs() != loss_scale.config():
    raise ValueError(
        f"{owner}'s update: the recovery's loss scale "
        f"({getattr(recovery.loss_scale, 'config', lambda: recovery.loss_scale)()}) "
        f"is not the optimizer's ({loss_scale.config()}). Compute the "
        "gradients at the optimizer's scale: "
        "jaxmp.scaled_value_and_grad(loss_fn, jaxmp.get_loss_scale(opt_state), "
        "recover=...).")
  return recovery


def backed_off_after_fallback(recovery: RecoveryInfo) -> LossScale:
  """The recovery's scale, backed off once more where the fallback succeeded.

  The attempt at ``recovery.loss_scale`` overflowed too when the fallback
  ran; each overflowed attempt backs the scale off once. (Where the fallback
  failed as well, the optimizer's own backoff for the lost step counts it.)
  """
  scale = recovery.loss_scale
  again = jnp.asarray(recovery.fell_back) & jnp.asarray(recovery.finite)
  backed_off = scale.adjust(jnp.zeros([], jnp.bool_))
  return jax.tree_util.tree_map(
      lambda a, b: jnp.where(again, a, b), backed_off, scale)


def computed_at(recovery: RecoveryInfo) -> StaticLossScale:
  """A loss scale with the value the gradients were computed at (1 after a fallback)."""
  value = jnp.asarray(recovery.loss_scale.loss_scale, jnp.float32)
  return StaticLossScale(jnp.where(recovery.fell_back, jnp.float32(1), value))
