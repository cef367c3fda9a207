"""Runs an optimizer's update and keeps its old state on non-finite steps.

The obvious way to skip a step, ``jnp.where(finite, new, old)`` over the whole
new state after the inner update, makes XLA compute each new moment twice: once
inside the select, whose output overwrites the donated old moment in place,
and once more in the parameter update, which then still needs the *old* moment
and forces XLA to copy every moment first. On a 4M-parameter transformer that
costs +2.9% temp memory and +5.7% bytes accessed.

:func:`update_or_keep` instead traces the inner update to a jaxpr and
re-evaluates it with the select inserted right where each new state leaf is
produced, so everything downstream (the parameter update included) reads the
selected value. On finite steps every value is bit-identical to the plain
update; on skipped steps the state is the old one and the updates are
replaced by the caller. XLA then writes each moment once, in place, as in the
unguarded step (+0.3% temp memory, +1.0% bytes accessed: the extra read of the
gradients by ``all_finite``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jax_core


def _can_select(var: Any, old: Any) -> bool:
  return (
      isinstance(var, jax_core.Var)
      and tuple(var.aval.shape) == tuple(jnp.shape(old))
      and var.aval.dtype == getattr(old, "dtype", None)
  )


def _is_traced(tree: Any) -> bool:
  return any(
      isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves(tree)
  )


def _varies_over_manual_axes(tree: Any) -> bool:
  """Whether a leaf varies over a ``shard_map`` axis (the name moved in JAX)."""
  for x in jax.tree_util.tree_leaves(tree):
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if getattr(aval, "vma", None) or getattr(manual, "varying", None):
      return True
  return False


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
  if not _is_traced(inputs) or _varies_over_manual_axes(inputs):
    # Outside jit there is no fusion to help (and concrete values may take
    # other paths, e.g. integer powers); inside shard_map a re-traced jaxpr
    # loses the varying-axes types of its inputs. Select whole trees there.
    updates, new_state = update(grads, state, params)
    return updates, jax.tree_util.tree_map(
        lambda new, old: jnp.where(finite, new, old), new_state, state
    )
  closed, out_shape = jax.make_jaxpr(update, return_shape=True)(
      grads, state, params
  )
  jaxpr = closed.jaxpr
  updates_shape, state_shape = out_shape
  n_updates = len(jax.tree_util.tree_leaves(updates_shape))
  old_leaves, old_def = jax.tree_util.tree_flatten(state)
  new_def = jax.tree_util.tree_structure(state_shape)
  if new_def != old_def:
    raise ValueError(
        "jaxmp.loss_scaling: the wrapped optimizer's update returned a state "
        f"of another structure than its input:\n  input:  {old_def}\n  output: "
        f"{new_def}\nAn optax transformation must return a state of the "
        "structure its init returned."
    )
  state_vars = jaxpr.outvars[n_updates:]

  # The new state leaves produced by an equation, each at exactly one place.
  places: dict[Any, int] = {}
  for var in state_vars:
    if isinstance(var, jax_core.Var):
      places[var] = places.get(var, 0) + 1
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)
  select_at = {
      var: old
      for var, old in zip(state_vars, old_leaves)
      if _can_select(var, old) and places[var] == 1 and var not in inputs
  }

  env: dict[Any, Any] = {}

  def read(var):
    return var.val if isinstance(var, jax_core.Literal) else env[var]

  env.update(zip(jaxpr.constvars, closed.consts))
  env.update(zip(jaxpr.invars, jax.tree_util.tree_leaves((grads, state, params))))
  for eqn in jaxpr.eqns:
    bind_params = eqn.primitive.get_bind_params(eqn.params)
    ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
    with ctx if ctx is not None else contextlib.nullcontext():
      out = eqn.primitive.bind(*map(read, eqn.invars), **bind_params)
    outs = out if eqn.primitive.multiple_results else [out]
    for var, value in zip(eqn.outvars, outs):
      if isinstance(var, jax_core.Var) and var in select_at:
        value = jnp.where(finite, value, select_at[var])
      env[var] = value

  outs = [read(var) for var in jaxpr.outvars]
  new_leaves = [
      value
      if isinstance(var, jax_core.Var) and var in select_at
      else jnp.where(finite, value, old)
      for var, value, old in zip(state_vars, outs[n_updates:], old_leaves)
  ]
  updates = jax.tree_util.tree_unflatten(
      jax.tree_util.tree_structure(updates_shape), outs[:n_updates]
  )
  return updates, jax.tree_util.tree_unflatten(new_def, new_leaves)
