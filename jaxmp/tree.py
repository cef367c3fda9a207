"""Pytree helpers shared by the loss scales and the optax wrapper."""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def all_finite(tree: Any) -> jax.Array:
  """Returns a scalar bool array: true iff no leaf of ``tree`` holds inf or nan.

  An empty tree is finite. Works under ``jit``; under ``jit`` with sharded
  arrays the reduction is global (XLA inserts the all-reduce).

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> bool(jaxmp.all_finite({"a": jnp.ones(3), "b": jnp.array([1.0, jnp.inf])}))
    False
    >>> bool(jaxmp.all_finite({}))
    True
  """
  leaves = jax.tree_util.tree_leaves(tree)
  if not leaves:
    return jnp.array(True)
  flags = [jnp.all(jnp.isfinite(x)) for x in leaves]
  return jnp.stack(flags).all()


def select_tree(pred: Any, a: T, b: T) -> T:
  """Returns ``a`` where the scalar bool ``pred`` is true, else ``b``, leafwise.

  Args:
    pred: a scalar boolean (array).
    a: a pytree.
    b: a pytree of the same structure, shapes and dtypes as ``a``.

  Raises:
    TypeError: if ``pred`` is not a scalar boolean.
    ValueError: if ``a`` and ``b`` do not have the same structure and shapes.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> jaxmp.select_tree(jnp.array(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
  """
  pred = jnp.asarray(pred)
  if pred.shape != () or pred.dtype != jnp.bool_:
    raise TypeError(
        "select_tree expects a scalar boolean predicate, got an array of "
        f"shape {pred.shape} and dtype {pred.dtype}. Reduce it first, e.g. "
        "with jaxmp.all_finite(tree) or jnp.all(x)."
    )
  struct_a = jax.tree_util.tree_structure(a)
  struct_b = jax.tree_util.tree_structure(b)
  if struct_a != struct_b:
    raise ValueError(
        "select_tree expects two pytrees of the same structure, got "
        f"{struct_a} and {struct_b}."
    )
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a),
                          jax.tree_util.tree_leaves(b)):
    if jnp.shape(x) != jnp.shape(y):
      raise ValueError(
          f"select_tree: the leaves at {jax.tree_util.keystr(path)} have shapes "
          f"{jnp.shape(x)} and {jnp.shape(y)}. Pass two pytrees of the same "
          "shapes, e.g. the new and the old value of the same state."
      )
  return jax.tree_util.tree_map(lambda x, y: jnp.where(pred, x, y), a, b)
