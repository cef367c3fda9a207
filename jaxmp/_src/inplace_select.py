"""Runs an optimizer's update and keeps its old state on non-finite steps.

The obvious way to skip a step, ``optax.tree.where(finite, new, old)`` over
the whole new state after the inner update, makes XLA compute each new moment
twice: once inside the select, whose output overwrites the donated old moment
in place, and once more in the parameter update, which then still needs the
*old* moment and forces XLA to copy every moment first. On XLA:CPU, on a
4M-parameter transformer, that costs +2.9% temp memory and +5.7% bytes
accessed. (XLA's GPU compiler fuses the plain select instead, so there it is
the default: see :func:`cpu_form`.)

:func:`update_or_keep` instead traces the inner update to a jaxpr and
evaluates it again (:func:`jaxprs.evaluate`) with a rule that binds each
equation as traced and selects each new state leaf right where it is
produced, so everything downstream (the parameter update included) reads the
selected value. On finite steps every value is bit-identical to the plain
update; on skipped steps the state is the old one and the updates are
replaced by the caller. XLA then writes each moment once, in place, as in the
unguarded step (+0.3% temp memory, +0.5% bytes accessed: the extra read of the
gradients by ``all_finite``). Inside ``shard_map`` it relies on the jaxpr
keeping the varying manual axes of its inputs. If a JAX release breaks the
evaluation, ``JAXMP_INPLACE_SELECT=0`` selects whole trees instead (same
values, one more copy of the optimizer state per step).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxmp._src import jaxpr as jaxprs

INPLACE_SELECT_ENV = "JAXMP_INPLACE_SELECT"
GROUPED_CHECK_ENV = "JAXMP_GROUPED_CHECK"
# What each variable's 1 (the form written for XLA:CPU) and 0 choose.
_FORMS = {
    INPLACE_SELECT_ENV: ("the in-place select of jaxmp.loss_scaling",
                         "the plain optax.tree.where select"),
    GROUPED_CHECK_ENV: ("the grouped reduces of jaxmp.all_finite",
                        "one reduce per leaf"),
}


def cpu_form(variable: str) -> bool:
  """Whether the form written for XLA:CPU is on: ``variable`` is 1, or unset on a CPU.

  The one choice of form by backend, for the select (``JAXMP_INPLACE_SELECT``)
  and the finiteness check (``JAXMP_GROUPED_CHECK``). Unset, the default
  backend decides. On XLA:CPU the plain select copies every optimizer-state
  leaf (+5.7% bytes accessed on the benchmark transformer) and a one-operand
  reduce writes its ``isfinite`` mask to memory; the in-place select and the
  grouped variadic reduces do neither. On a GPU (an H200) XLA fuses the plain
  select into the update (-0.5% bytes; in place +2.9%, at the same step
  time), and jmp's check, one reduce per leaf, ran fastest of the four guards
  (benchmarks/README.md). Read each time a step is traced, so a step compiled
  before the variable changed keeps the forms it was compiled with.

  Raises:
    ValueError: if the variable holds anything but ``0`` or ``1``.
  """
  value = os.environ.get(variable)
  if value is None:
    return jax.default_backend() == "cpu"
  value = value.strip()
  if value not in ("0", "1"):
    one, zero = _FORMS[variable]
    raise ValueError(
        f"The environment variable {variable} must be 1 ({one}, the default "
        f"on a CPU) or 0 ({zero}, the default elsewhere), got {value!r}."
    )
  return value == "1"


def check_same_structure(
    a: Any, b: Any, *, owner: str, names: Sequence[str], fix: str
) -> None:
  """Raises unless ``a`` and ``b`` have the same tree structure and leaf shapes.

  The one structure check of the optax wrapper: gradients against params,
  and an inner update's new state against its old one.

  Args:
    a: a pytree (arrays or ``jax.ShapeDtypeStruct`` leaves).
    b: the pytree it must match.
    owner: who checks; starts the message.
    names: what ``a`` and ``b`` are, e.g. ``("the gradients", "the params")``.
    fix: the sentence that says what to do; ends the message.

  Raises:
    ValueError: naming the two structures, or the first path whose shapes
      differ.
  """
  name_a, name_b = names
  struct_a = jax.tree_util.tree_structure(a)
  struct_b = jax.tree_util.tree_structure(b)
  if struct_a != struct_b:
    raise ValueError(
        f"{owner}: {name_a} and {name_b} differ in tree structure:\n"
        f"  {name_a}: {struct_a}\n  {name_b}: {struct_b}\n{fix}"
    )
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    shape_x, shape_y = getattr(x, "shape", None), getattr(y, "shape", None)
    if shape_x is not None and shape_y is not None and (
        tuple(shape_x) != tuple(shape_y)):
      raise ValueError(
          f"{owner}: {name_a} and {name_b} differ in shape at "
          f"{jax.tree_util.keystr(path)}: {tuple(shape_x)} against "
          f"{tuple(shape_y)}. {fix}"
      )


def _varies_over_manual_axes(tree: Any) -> bool:
  """Whether a leaf varies over a ``shard_map`` axis."""
  return any(jaxprs.manual_axes(jax.typeof(x)) for x in jax.tree_util.tree_leaves(tree))


def _keeps_manual_axes(jaxpr: Any, leaves: Sequence[Any]) -> bool:
  """Whether the jaxpr's inputs vary over the ``shard_map`` axes ``leaves`` do.

  A JAX whose traced jaxprs dropped these types would re-evaluate the update
  with the wrong ones inside ``shard_map``.
  """
  return all(jaxprs.manual_axes(var.aval) == jaxprs.manual_axes(jax.typeof(x))
             for var, x in zip(jaxpr.invars, leaves))


def _is_traced(tree: Any) -> bool:
  return any(
      isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree)
  )


# The select.


def update_or_keep(
    update: Callable[..., tuple[Any, Any]],
    finite: jax.Array,
    grads: Any,
    state: Any,
    params: Any,
) -> tuple[Any, Any]:
  """Returns ``update(grads, state, params)``, with the old state where not finite.

  Args:
    update: the inner update, ``(grads, state, params) -> (updates, new_state)``.
    finite: scalar bool; where false, the returned state is ``state``.
    grads: the gradients.
    state: the inner optimizer state before the update.
    params: the parameters (or None).

  Returns:
    ``(updates, new_state)``. The updates are the inner updates when ``finite``
    and unspecified otherwise (the caller replaces them); ``new_state`` is the
    inner new state when ``finite`` and bit-identical to ``state`` otherwise.

  Raises:
    ValueError: if ``update`` returns a state of another structure or other
      shapes than ``state``.

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> from jaxmp._src.inplace_select import update_or_keep
    >>> tx = optax.sgd(0.1, momentum=0.9)
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> step = jax.jit(lambda finite, grads, state: update_or_keep(
    ...     tx.update, finite, grads, state, params))
    >>> _, kept = step(jnp.array(False), {"w": jnp.array([jnp.inf, 1.0])}, state)
    >>> kept[0].trace["w"]
    Array([0., 0.], dtype=float32)
  """
  inputs = (finite, grads, state, params)
  if not _is_traced(inputs) or not cpu_form(INPLACE_SELECT_ENV):
    # Outside jit there is no fusion to help (and concrete values may take
    # other paths, e.g. integer powers), and the switch turns it off.
    return _update_then_select(update, finite, grads, state, params)
  closed, (updates_shape, state_shape) = jax.make_jaxpr(
      update, return_shape=True)(grads, state, params)
  _check_state(state_shape, state)
  if not _keeps_manual_axes(closed.jaxpr,
                            jax.tree_util.tree_leaves((grads, state, params))):
    # Inside shard_map, with a JAX whose jaxprs do not keep the varying
    # manual axes of their inputs (JAX 0.10 keeps them).
    return _update_then_select(update, finite, grads, state, params)
  try:
    outs = _evaluate_with_select(closed, finite, (grads, state, params),
                                 len(jax.tree_util.tree_leaves(updates_shape)))
  except Exception as error:  # pylint: disable=broad-except
    raise RuntimeError(
        "jaxmp.loss_scaling's in-place select failed with this JAX version "
        f"({jax.__version__}): {type(error).__name__}: {error}\nSet the "
        f"environment variable {INPLACE_SELECT_ENV}=0 to use the plain "
        "select (same results, one more copy of the optimizer state per "
        "step), and please report the error."
    ) from error
  n_updates = len(jax.tree_util.tree_leaves(updates_shape))
  updates = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(updates_shape), outs[:n_updates])
  new_state = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(state), outs[n_updates:])
  return updates, new_state


def _update_then_select(update, finite, grads, state, params):
  """The plain select: the inner update, then a select of whole trees."""
  updates, new_state = update(grads, state, params)
  _check_state(new_state, state)
  return updates, optax.tree.where(finite, new_state, state)


def _check_state(new_state: Any, state: Any) -> None:
  check_same_structure(
      new_state, state, owner="jaxmp.loss_scaling",
      names=("the new state returned by the wrapped optimizer's update",
             "its input state"),
      fix="An optax transformation must return a state of the structure and "
      "shapes its init returned.")


def _evaluate_with_select(closed: Any, finite: jax.Array, inputs: Any,
                          n_updates: int) -> list[Any]:
  """Evaluates ``closed`` on ``inputs``, selecting the old state in place.

  The outputs after the first ``n_updates`` are the new state; each is
  replaced by ``where(finite, new, old)`` at the equation that produces it
  (or at the output, where it is not produced by an equation of its own).
  """
  jaxpr = closed.jaxpr
  grads, state, params = inputs
  old_leaves = jax.tree_util.tree_leaves(state)
  state_vars = jaxpr.outvars[n_updates:]
  # The new state leaves produced by an equation, each at exactly one place.
  places: dict[Any, int] = {}
  for var in state_vars:
    if jaxprs.is_var(var):
      places[var] = places.get(var, 0) + 1
  jaxpr_inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  # Inside shard_map, a flag that varies over axes a leaf does not (no
  # axis_name) would make the selected leaf vary too, and the equations after
  # it were traced for a leaf that does not: select such leaves at the output.
  flag_axes = jaxprs.manual_axes(jax.typeof(finite))
  select_at = {
      var: old
      for var, old in zip(state_vars, old_leaves)
      if jaxprs.is_var(var) and places[var] == 1 and var not in jaxpr_inputs
      and tuple(var.aval.shape) == tuple(jnp.shape(old))
      and var.aval.dtype == getattr(old, "dtype", None)
      and flag_axes <= jaxprs.manual_axes(var.aval)
  }

  def select(value, old):
    return jnp.where(finite, value, old)

  def rule(eqn, invals, name_stack):
    outs = jaxprs.bind_rule(eqn, invals, name_stack)
    return [select(value, select_at[var]) if var in select_at else value
            for var, value in zip(eqn.outvars, outs)]

  outs = jaxprs.evaluate(jaxpr, closed.consts,
                         jax.tree_util.tree_leaves((grads, state, params)), rule)
  new_leaves = [
      value if jaxprs.is_var(var) and var in select_at else select(value, old)
      for var, value, old in zip(state_vars, outs[n_updates:], old_leaves)
  ]
  return outs[:n_updates] + new_leaves
