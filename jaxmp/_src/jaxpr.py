"""The JAX internals jaxmp relies on, and the one jaxpr evaluator.

:func:`jaxmp.autocast`, the precision audit and the in-place select each
evaluate a traced jaxpr again with a rule per equation (:func:`evaluate`):
autocast binds each primitive on cast inputs, the audit computes facts about
each value without binding anything, and the select binds each primitive as
traced and selects the new optimizer state where it is produced. They need a
few things that JAX exposes only through ``jax.extend`` or as attributes of
its internal objects: the atoms of a jaxpr (``Literal``, ``Var``,
``DropVar``), the programs held in an equation's parameters, a primitive's
bind parameters and the equation's context, the name stack of the trace and
an equation's source line, and the ``shard_map`` axes a value varies over.
Each is touched here only, and ``tests/test_jaxpr.py`` (the canary) exercises
them all against the installed JAX: when a release moves one, that test fails
first and says which.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from jax.extend import core as _core
from jax.extend import source_info_util as _source_info
from jax.extend.core import primitives as _primitives

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


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


def custom_jvp_rule(params: dict[str, Any], num_primals: int) -> tuple[Any, list, list]:
  """A ``custom_jvp_call``'s JVP rule as ``(jaxpr, consts, output zero flags)``."""
  return params["jvp_jaxpr_fun"].call_wrapped(*[False] * num_primals)


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


def name_parts(name_stack: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """The scopes (``jax.named_scope`` and Linen module names) and the
  transforms (``jvp``, ``transpose``) of a name stack, outermost first."""
  items = getattr(name_stack, "stack", ())
  return (tuple(i.name for i in items if type(i).__name__ != "Transform"),
          tuple(i.name for i in items if type(i).__name__ == "Transform"))


def source_line(eqn: Any) -> str:
  """The line that created ``eqn``, as JAX names it in its own messages: the
  innermost frame outside JAX, ``"file.py:12:4 (function)"`` (no folder);
  ``""`` if that frame is jaxmp's own."""
  line = _source_info.summarize(eqn.source_info)
  return "" if line.startswith(_PACKAGE) else os.path.basename(line)


def bind_rule(eqn: Any, invals: list[Any], name_stack: Any = None) -> list[Any]:
  """The default rule of :func:`evaluate`: binds ``eqn``'s primitive on
  ``invals`` in the context it was traced in."""
  del name_stack  # the equation's own, under the current one
  with equation_context(eqn):
    return bind(eqn, invals)


def evaluate(
    jaxpr: Any,
    consts: Sequence[Any],
    args: Sequence[Any],
    rule: Callable[[Any, list[Any], Any], list[Any]] = bind_rule,
    *,
    literal: Callable[[Any], Any] = lambda value: value,
    name_stack: Any = None,
) -> list[Any]:
  """Evaluates an open ``jaxpr`` with a rule per equation; returns its outputs.

  Args:
    jaxpr: a ``Jaxpr`` (a ``ClosedJaxpr``'s is ``closed.jaxpr``, its
      constants ``closed.consts``).
    consts: the values of its constant variables.
    args: the values of its inputs.
    rule: ``rule(eqn, invals, name_stack) -> outvals``, called once per
      equation in order, with the values of its inputs and its name stack
      (``name_stack`` extended by the equation's own); it returns one value
      per output variable. The default binds the primitive. A rule recurses
      into the programs of an equation (``inner_jaxprs``) by calling
      ``evaluate`` again, with the equation's name stack.
    literal: the value of a literal constant, from the constant.
    name_stack: the name stack ``jaxpr`` runs under (default: empty).

  Values are whatever the rule computes: arrays, tracers, or facts about
  them; the evaluator only stores and reads them.
  """
  env: dict[Any, Any] = {}

  def read(atom):
    return literal(atom.val) if is_literal(atom) else env[atom]

  def write(variables, values):
    for var, value in zip(variables, values, strict=True):
      if not is_dropped(var):
        env[var] = value

  base = new_name_stack() if name_stack is None else name_stack
  write(jaxpr.constvars, consts)
  write(jaxpr.invars, args)
  for eqn in jaxpr.eqns:
    write(eqn.outvars, rule(eqn, [read(a) for a in eqn.invars],
                            base + eqn.source_info.name_stack))
  return [read(a) for a in jaxpr.outvars]
