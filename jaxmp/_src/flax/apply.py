"""A Linen ``apply`` run under a policy: what ``wrap_apply`` returns.

Every wrapped call reports the Linen modules whose own ``dtype=`` defeats
the policy. Nothing here imports Flax (Linen modules are intercepted only
where Linen is loaded) or the policies (they import this).
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


def cast_apply_output(io_policy: Any, result: Any, apply_kwargs: Mapping[str, Any]) -> Any:
  """``result`` cast to the output dtype; with ``mutable=`` or
  ``capture_intermediates=``, only the output, not the collections."""
  if apply_kwargs.get("mutable", False) is not False or bool(
      apply_kwargs.get("capture_intermediates", False)):
    out, collections = result
    return io_policy.cast_to_output(out), collections
  return io_policy.cast_to_output(result)


class WrappedApply:
  """``run(policy, apply_fn, *args, **kwargs)`` as ``apply_fn``; equal (and
  of equal hash) for equal policies and ``apply_fn``s, as ``model.apply`` is,
  so a state built twice is one pytree structure."""

  def __init__(self, run: Callable[..., Any], policy: Any, apply_fn: Callable[..., Any]):
    self._run, self.policy, self.apply_fn = run, policy, apply_fn
    functools.update_wrapper(self, apply_fn, updated=())

  def __call__(self, *args, **kwargs):
    return self._run(self.policy, self.apply_fn, *args, **kwargs)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, WrappedApply) and (
        self._run, self.policy, self.apply_fn) == (other._run, other.policy, other.apply_fn)

  def __hash__(self) -> int:
    return hash((self._run, self.policy, self.apply_fn))


def note_declared_dtype(defeated: dict[str, Any], module: Any, path: str,
                        compute_dtypes: Any) -> None:
  """Notes ``module`` when its own ``dtype`` field is none of ``compute_dtypes``
  (the first is its policy's)."""
  declared = None
  if "dtype" in getattr(type(module), "__dataclass_fields__", {}):
    try:
      declared = None if module.dtype is None else np.dtype(module.dtype)
    except TypeError:  # a dtype attribute of another kind
      pass
  wanted = [np.dtype(d) for d in compute_dtypes]
  if declared is not None and declared not in wanted:
    defeated[path] = (declared, wanted[0], type(module).__name__)


def warn_declared_dtypes(defeated: dict[str, Any], owner: str, stacklevel: int) -> None:
  """One :class:`jaxmp.PrecisionWarning` naming the modules of ``defeated``."""
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
      f"{declared.name!r}}}, default=...), which silences this.",
      PrecisionWarning, stacklevel=stacklevel + 1)


def _note_under_policy(compute_dtype: Any, params: Any, defeated: dict[str, Any],
                       next_fun, args, kwargs, context):
  """A Linen interceptor noting the modules whose own ``dtype`` is none of the
  dtypes of their params (the compute dtype where they have none)."""
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
  """``apply_fn`` with ``variables["params"]`` cast by ``policy.params_for_compute``,
  the floating inputs to the compute dtype and the output to the output
  dtype (a :class:`jaxmp.Policy` or :class:`jaxmp.PathPolicy`)."""
  policy.io_policy  # pylint: disable=pointless-statement  # raises now without a default
  return WrappedApply(_apply_under, policy, apply_fn)
