"""A Linen ``apply`` run under a policy: what ``wrap_apply`` returns.

:meth:`jaxmp.Policy.wrap_apply`, :meth:`jaxmp.PathPolicy.wrap_apply` and
:meth:`jaxmp.flax.ModulePolicy.wrap_apply` wrap a function of
``(variables, *args, **kwargs)`` (Linen's ``model.apply``) in a
:class:`WrappedApply`; :class:`jaxmp.flax.TrainState` stores it as its
``apply_fn``. Nothing here imports Flax, nor the policies: they import this.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any


def cast_apply_output(io_policy: Any, result: Any,
                      apply_kwargs: Mapping[str, Any]) -> Any:
  """Casts what a Linen ``apply`` returned to ``io_policy``'s output dtype.

  ``apply(..., mutable=...)`` (anything but ``False``) and
  ``capture_intermediates=...`` return ``(output, updated_collections)``:
  only the output is cast; the collections (``batch_stats`` ...) keep their
  own dtype.
  """
  if apply_kwargs.get("mutable", False) is not False or bool(
      apply_kwargs.get("capture_intermediates", False)):
    out, collections = result
    return io_policy.cast_to_output(out), collections
  return io_policy.cast_to_output(result)


class WrappedApply:
  """``run(policy, apply_fn, *args, **kwargs)``, named and documented as ``apply_fn``.

  It compares (and hashes) equal to another made from an equal policy and an
  equal ``apply_fn``, as bound methods such as ``model.apply`` do: as a
  static argument of ``jax.jit`` it does not recompile for each
  ``wrap_apply`` call.
  """

  def __init__(self, run: Callable[..., Any], policy: Any, apply_fn: Callable[..., Any]):
    self._run, self.policy, self.apply_fn = run, policy, apply_fn
    functools.update_wrapper(self, apply_fn, updated=())

  def __call__(self, *args, **kwargs):
    return self._run(self.policy, self.apply_fn, *args, **kwargs)

  def _key(self) -> tuple[Any, ...]:
    return (self._run, self.policy, self.apply_fn)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, WrappedApply) and self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())


def _apply_under(policy: Any, apply_fn: Callable[..., Any], variables: Any,
                 *args, **kwargs) -> Any:
  """``apply_fn(variables, *args, **kwargs)``: ``variables["params"]`` cast by
  ``policy.params_for_compute``, the floating inputs to the compute dtype and
  the output to the output dtype of ``policy.io_policy``."""
  io_policy = policy.io_policy
  if isinstance(variables, Mapping) and "params" in variables:
    variables = {**variables, "params": policy.params_for_compute(variables["params"])}
  args, kwargs = io_policy.cast_to_compute((args, kwargs))
  return cast_apply_output(io_policy, apply_fn(variables, *args, **kwargs), kwargs)


def apply_under_policy(policy: Any, apply_fn: Callable[..., Any]) -> WrappedApply:
  """``apply_fn`` under a :class:`jaxmp.Policy` or :class:`jaxmp.PathPolicy`.

  Raises:
    ValueError: for a policy without a default.
  """
  _ = policy.io_policy  # raises now, not at the first call, without one
  return WrappedApply(_apply_under, policy, apply_fn)
