"""A Linen ``apply`` run under a policy: what ``wrap_apply`` returns.

:meth:`jaxmp.Policy.wrap_apply`, :meth:`jaxmp.PathPolicy.wrap_apply` and
:meth:`jaxmp.flax.ModulePolicy.wrap_apply` wrap a function of
``(variables, *args, **kwargs)`` (Linen's ``model.apply``) in a
:class:`WrappedApply`; :class:`jaxmp.flax.TrainState` stores it as its
``apply_fn``. Every wrapped call reports the Linen modules whose own
``dtype=`` defeats the policy (:func:`note_declared_dtype`). Nothing here
imports Flax (it intercepts Linen modules only where Linen is loaded), nor
the policies: they import this.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from jaxmp._src.validation import PrecisionWarning, listing


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


def _declared_dtype(module: Any) -> Any:
  """A Linen module's own ``dtype=`` as a NumPy dtype, or ``None``."""
  if "dtype" not in getattr(type(module), "__dataclass_fields__", {}):
    return None
  try:
    return None if module.dtype is None else np.dtype(module.dtype)
  except TypeError:  # a dtype attribute of another kind
    return None


def note_declared_dtype(defeated: dict[str, Any], module: Any, path: str,
                        compute_dtypes: Any) -> None:
  """Notes ``module`` in ``defeated`` when it declares a ``dtype`` that is
  none of ``compute_dtypes`` (the first is its policy's)."""
  declared, wanted = _declared_dtype(module), [np.dtype(d) for d in compute_dtypes]
  if declared is not None and declared not in wanted:
    defeated[path] = (declared, wanted[0], type(module).__name__)


def warn_declared_dtypes(defeated: dict[str, Any], owner: str,
                         stacklevel: int) -> None:
  """One :class:`jaxmp.PrecisionWarning` for the modules of ``defeated``."""
  if not defeated:
    return
  path = next((p for p in defeated if p), "")  # the example: a layer, if any
  declared, _, cls = defeated[path]
  found = listing((f"{p or '(root)'!r} declares dtype={d.name}, its policy "
                   f"computes in {c.name}" for p, (d, c, _) in defeated.items()), "; ")
  warnings.warn(
      f"{owner}: a module's own dtype wins over the policy, which does not "
      f"take effect there: {found}. Drop dtype= from the module (Flax's "
      "layers then compute in the dtype they receive), or pass "
      "override_dtype=True to a jaxmp.flax.ModulePolicy to make the policy "
      "set it; to keep it on purpose, give the module a ModulePolicy rule of "
      f"that dtype, e.g. ModulePolicy({{{repr(path) if path else cls}: "
      f"{declared.name!r}}}, "
      "default=...), which silences this.", PrecisionWarning,
      stacklevel=stacklevel + 1)


def _note_under_policy(compute_dtype: Any, params: Any, defeated: dict[str, Any],
                       next_fun, args, kwargs, context):
  """A Linen interceptor: notes the modules whose own ``dtype`` is none of the
  dtypes their params are cast to (the compute dtype where they have none)."""
  module = context.module
  if context.method_name != "setup" and not module.is_initializing():
    path = "/".join(module.scope.path) if module.scope is not None else ""
    own = params
    for name in path.split("/") if path else ():
      own = own.get(name) if isinstance(own, Mapping) else None
    dtypes = {np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(own)
              if np.issubdtype(getattr(x, "dtype", np.int32), np.inexact)}
    note_declared_dtype(defeated, module, path, [compute_dtype, *dtypes])
  return next_fun(*args, **kwargs)


def _apply_under(policy: Any, apply_fn: Callable[..., Any], variables: Any,
                 *args, **kwargs) -> Any:
  """``apply_fn(variables, *args, **kwargs)``: ``variables["params"]`` cast by
  ``policy.params_for_compute``, the floating inputs to the compute dtype and
  the output to the output dtype of ``policy.io_policy``; warns about the
  Linen modules whose own ``dtype`` wins over the policy."""
  io_policy, params = policy.io_policy, None
  if isinstance(variables, Mapping) and "params" in variables:
    params = policy.params_for_compute(variables["params"])
    variables = {**variables, "params": params}
  args, kwargs = io_policy.cast_to_compute((args, kwargs))
  defeated: dict[str, Any] = {}  # per call: under jit, once per trace
  linen = sys.modules.get("flax.linen")  # a Linen model means Linen is loaded
  with (linen.intercept_methods(functools.partial(
      _note_under_policy, io_policy.compute_dtype, params, defeated))
        if linen is not None else contextlib.nullcontext()):
    result = apply_fn(variables, *args, **kwargs)
  warn_declared_dtypes(defeated, "wrap_apply", stacklevel=3)
  return cast_apply_output(io_policy, result, kwargs)


def apply_under_policy(policy: Any, apply_fn: Callable[..., Any]) -> WrappedApply:
  """``apply_fn`` under a :class:`jaxmp.Policy` or :class:`jaxmp.PathPolicy`.

  Raises:
    ValueError: for a policy without a default.
  """
  _ = policy.io_policy  # raises now, not at the first call, without one
  return WrappedApply(_apply_under, policy, apply_fn)
