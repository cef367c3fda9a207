"""The loss scale a policy needs when the user does not choose one."""

from __future__ import annotations

from typing import Any

from jaxmp._src.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from jaxmp._src.policy import get_policy


def as_policy(spec: Any) -> Any:
  """Returns ``spec`` as a policy: a policy kind as is, else ``get_policy(spec)``.

  Accepts anything :func:`jaxmp.get_policy` takes and every policy kind
  (:class:`jaxmp.Policy`, :class:`jaxmp.PathPolicy`,
  :class:`jaxmp.flax.ModulePolicy`, or any class with their members, which
  is all :class:`jaxmp.flax.TrainState` uses).
  """
  # The members are looked up on the class: the ``io_policy`` property raises
  # for a rule-based policy without a default.
  if not isinstance(spec, str) and all(
      hasattr(type(spec), name) for name in _POLICY_MEMBERS):
    return spec
  return get_policy(spec)


_POLICY_MEMBERS = ("needs_loss_scaling", "io_policy", "params_for_storage",
                   "params_for_compute", "wrap_apply", "for_autocast")


def default_loss_scale(policy: Any) -> LossScale:
  """Returns the loss scale to train with under ``policy``, by default.

  ``jaxmp.DynamicLossScale()`` (initial scale ``2**15``, doubled after 2000
  finite steps in a row, halved on an overflow) when the policy computes in
  float16 or a float8 type, whose gradients underflow without scaling;
  ``jaxmp.NoOpLossScale()`` otherwise (float32, bfloat16), where scaling
  would only cost time. :meth:`jaxmp.flax.TrainState.create` uses it when no
  ``loss_scale`` is given.

  Args:
    policy: anything :func:`jaxmp.get_policy` takes (``"mixed_float16"``,
      ``"p=f32,c=bf16,o=f32"``, a :class:`jaxmp.Policy`), a
      :class:`jaxmp.PathPolicy` or a :class:`jaxmp.flax.ModulePolicy`
      (with or without a default). A rule-based policy needs loss scaling
      when any of its policies does.

  Returns:
    A new loss scale.

  Raises:
    ValueError: if ``policy`` is a string :func:`jaxmp.get_policy` refuses.
    TypeError: if ``policy`` is neither a policy nor a string.

  Example:
    >>> import jaxmp
    >>> loss_scale = jaxmp.default_loss_scale("mixed_float16")
    >>> type(loss_scale).__name__, float(loss_scale.loss_scale), loss_scale.period
    ('DynamicLossScale', 32768.0, 2000)
    >>> type(jaxmp.default_loss_scale("mixed_bfloat16")).__name__
    'NoOpLossScale'
  """
  if as_policy(policy).needs_loss_scaling:
    return DynamicLossScale()
  return NoOpLossScale()
