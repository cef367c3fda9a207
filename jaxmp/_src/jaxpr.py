"""The JAX internals jaxmp relies on, in one place.

:func:`jaxmp.autocast`, the precision audit and the in-place select read or
evaluate jaxprs again. They need a few things that JAX exposes only through
``jax.extend`` or as attributes of its internal objects: the atoms of a jaxpr
(``Literal``, ``Var``, ``DropVar``), the programs held in an equation's
parameters, a primitive's bind parameters and the equation's context, the
name stack of the trace, and the ``shard_map`` axes a value varies over. Each
is touched here only, and ``tests/test_jaxpr.py`` (the canary) exercises them
all against the installed JAX: when a release moves one, that test fails
first and says which.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from jax.extend import core as _core
from jax.extend import source_info_util as _source_info
from jax.extend.core import primitives as _primitives


def is_literal(atom: Any) -> bool:
  """Whether a jaxpr atom is a literal constant (its value is ``atom.val``)."""
  return isinstance(atom, _core.Literal)


def is_var(atom: Any) -> bool:
  """Whether a jaxpr atom is a variable (not a literal constant)."""
  return isinstance(atom, _core.Var)


def is_dropped(var: Any) -> bool:
  """Whether an equation's output variable is dropped (``_``)."""
  return isinstance(var, _core.DropVar)


def is_closed(jaxpr: Any) -> bool:
  """Whether ``jaxpr`` is a ``ClosedJaxpr`` (a jaxpr with its constants)."""
  return isinstance(jaxpr, _core.ClosedJaxpr)


def is_primitive(x: Any) -> bool:
  return isinstance(x, _core.Primitive)


def primitive_names() -> frozenset[str]:
  """The names of the primitives ``jax.extend.core.primitives`` exports."""
  return frozenset(
      p.name for p in vars(_primitives).values() if isinstance(p, _core.Primitive))


def inner_jaxprs(params: dict[str, Any]) -> list[Any]:
  """The programs an equation holds in its parameters (a jit's, a loop's)."""
  return list(_core.jaxprs_in_params(params))


def bind_params(eqn: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
  """``params`` (default: the equation's own) as ``primitive.bind`` takes them,
  as ``jax.core.eval_jaxpr`` turns them."""
  return eqn.primitive.get_bind_params(eqn.params if params is None else params)


def bind(eqn: Any, invals: list[Any], params: dict[str, Any] | None = None
         ) -> list[Any]:
  """Binds ``eqn``'s primitive on ``invals``; returns its outputs as a list."""
  out = eqn.primitive.bind(*invals, **bind_params(eqn, params))
  return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def equation_context(eqn: Any, name_stack: Any = None) -> Iterator[None]:
  """The context an equation was traced in: its source, name stack and
  compute type. ``name_stack`` (default: the current one, extended by the
  equation's) is the stack to bind it under."""
  if name_stack is None:
    name_stack = current_name_stack() + eqn.source_info.name_stack
  manager = getattr(getattr(eqn, "ctx", None), "manager", None)
  with _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack):
    with manager if manager is not None else contextlib.nullcontext():
      yield


def current_name_stack() -> Any:
  """The name stack of the trace being built (``jax.named_scope`` names)."""
  return _source_info.current_name_stack()


def new_name_stack() -> Any:
  """An empty name stack."""
  return _source_info.new_name_stack()


def manual_axes(aval: Any) -> frozenset:
  """The ``shard_map`` axes an abstract value varies over (the name moved in JAX)."""
  manual = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(aval, "vma", None) or getattr(manual, "varying", None)
                   or ())
