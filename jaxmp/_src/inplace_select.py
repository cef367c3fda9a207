"""``update_or_keep``: an optimizer update with the old state selected in place where not finite.

After the update, ``optax.tree.where`` makes XLA:CPU copy every moment (+5.7%
bytes); here the update's jaxpr is evaluated again with each new state leaf
selected where it is produced. XLA:GPU fuses the plain one (:func:`cpu_form`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import jaxpr as jaxprs

INPLACE_SELECT_ENV = "JAXMP_INPLACE_SELECT"
GROUPED_CHECK_ENV = "JAXMP_GROUPED_CHECK"


def cpu_form(variable: str) -> bool:
  """Whether the form written for XLA:CPU is on: ``variable`` is 1, or unset on a CPU.

  The one choice by backend, of the select and of the finiteness check.
  """
  value = os.environ.get(variable)
  if value is None:
    return jax.default_backend() == "cpu"
  value = value.strip()
  if value not in ("0", "1"):
    raise ValueError(
        f"The environment variable {variable} must be 1 (the form written for "
        f"XLA:CPU, the default on a CPU) or 0 (the form for other backends, "
        f"the default elsewhere), got {value!r}.")
  return value == "1"


def check_same_structure(
    a: Any, b: Any, *, owner: str, names: Sequence[str], fix: str
) -> None:
  """A ValueError, from ``owner`` and ending with ``fix``, unless ``a`` and ``b`` (named
  ``names``) have one tree structure and leaf shapes."""
  name_a, name_b = names
  struct_a = jax.tree_util.tree_structure(a)
  struct_b = jax.tree_util.tree_structure(b)
  if struct_a != struct_b:
    raise ValueError(
        f"{owner}: {name_a} and {name_b} differ in tree structure:\n"
        f"  {name_a}: {struct_a}\n  {name_b}: {struct_b}\n{fix}")
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if np.shape(x) != np.shape(y):
      raise ValueError(
          f"{owner}: {name_a} and {name_b} differ in shape at "
          f"{jax.tree_util.keystr(path)}: {np.shape(x)} against "
          f"{np.shape(y)}. {fix}")


def _keeps_manual_axes(jaxpr: Any, leaves: Sequence[Any]) -> bool:
  """Whether the jaxpr's inputs vary over the ``shard_map`` axes ``leaves`` do."""
  return all(jaxprs.manual_axes(var.aval) == jaxprs.manual_axes(jax.typeof(x))
             for var, x in zip(jaxpr.invars, leaves))


def update_or_keep(
    update: Callable[..., tuple[Any, Any]],
    finite: jax.Array,
    grads: Any,
    state: Any,
    params: Any,
) -> tuple[Any, Any]:
  """``update(grads, state, params)``, with ``state`` kept bit-identical where not
  ``finite`` (the updates are then unspecified: the caller replaces them)."""
  inputs = (finite, grads, state, params)
  traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(inputs))
  if traced and cpu_form(INPLACE_SELECT_ENV):
    closed, (updates_shape, state_shape) = jax.make_jaxpr(
        update, return_shape=True)(grads, state, params)
    _check_state(state_shape, state)
    # A JAX whose jaxprs drop the varying manual axes of their inputs inside
    # shard_map takes the plain select (JAX 0.10 keeps them).
    if _keeps_manual_axes(closed.jaxpr,
                          jax.tree_util.tree_leaves((grads, state, params))):
      n_updates = len(jax.tree_util.tree_leaves(updates_shape))
      try:
        outs = _evaluate_with_select(closed, finite, (grads, state, params), n_updates)
      except Exception as error:  # pylint: disable=broad-except
        raise RuntimeError(
            "jaxmp.loss_scaling's in-place select failed with this JAX version "
            f"({jax.__version__}): {type(error).__name__}: {error}\nSet the "
            f"environment variable {INPLACE_SELECT_ENV}=0 to use the plain "
            "select (same results, one more copy of the optimizer state per "
            "step), and please report the error."
        ) from error
      updates = jax.tree_util.tree_unflatten(
          jax.tree_util.tree_structure(updates_shape), outs[:n_updates])
      new_state = jax.tree_util.tree_unflatten(
          jax.tree_util.tree_structure(state), outs[n_updates:])
      return updates, new_state
  # Outside jit (no fusion to help), on other backends, or switched off.
  updates, new_state = update(grads, state, params)
  _check_state(new_state, state)
  return updates, optax.tree.where(finite, new_state, state)


_check_state = functools.partial(
    check_same_structure, owner="jaxmp.loss_scaling",
    names=("the new state returned by the wrapped optimizer's update", "its input state"),
    fix="An optax transformation must return a state of the structure and "
    "shapes its init returned.")


def _evaluate_with_select(closed: Any, finite: jax.Array, inputs: Any,
                          n_updates: int) -> list[Any]:
  """Evaluates ``closed`` on ``inputs``; each new state leaf (the outputs after
  ``n_updates``) is ``where(finite, new, old)`` at the equation producing it."""
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
