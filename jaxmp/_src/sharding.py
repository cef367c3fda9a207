"""Shardings for the optimizer state of a sharded (GSPMD) training step."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec


def _is_spec_or_sharding(x: Any) -> bool:
  return isinstance(x, (PartitionSpec, jax.sharding.Sharding))


def _replicated_like(leaf: Any) -> Any:
  if isinstance(leaf, NamedSharding):
    return NamedSharding(leaf.mesh, PartitionSpec(), memory_kind=leaf.memory_kind)
  if isinstance(leaf, PartitionSpec):
    return PartitionSpec()
  raise TypeError(
      "opt_state_shardings cannot tell what 'replicated' means for a "
      f"{type(leaf).__name__}. Give the parameter shardings as NamedSharding "
      "or PartitionSpec leaves, or pass replicated=NamedSharding(mesh, P())."
  )


def opt_state_shardings(
    tx: optax.GradientTransformation,
    params: Any,
    param_shardings: Any = None,
    *,
    replicated: Any = None,
) -> Any:
  """Returns shardings for ``tx``'s state: moments like params, the rest replicated.

  Every part of the optimizer state that has the structure of the parameters
  (Adam's moments, accumulators of ``optax.MultiSteps``, ...) gets the
  parameters' shardings; everything else (the :func:`jaxmp.loss_scaling`
  state with its loss scale and counters, step counts, schedules) is
  replicated, so that every device holds the same loss scale and takes the same
  skip decision. Use the result as ``out_shardings`` of ``jax.jit(tx.init)``
  and as ``in_shardings``/``out_shardings`` of the training step; give
  :class:`jax.sharding.PartitionSpec` leaves to get ``in_specs`` and
  ``out_specs`` for ``jax.shard_map``.

  ``jax.jit(tx.init)(params)`` alone does not do this: the moments are zeros
  that do not depend on the parameters' values, so they do not inherit their
  sharding and may all land on one device.

  The parameter-shaped parts are found with
  :func:`optax.tree_utils.tree_map_params`.

  Args:
    tx: the optimizer (typically ``jaxmp.loss_scaling(...)``).
    params: the parameters, as arrays or ``jax.ShapeDtypeStruct``; only their
      shapes and dtypes are used (``tx.init`` is evaluated abstractly).
    param_shardings: a pytree of the params' structure with
      ``NamedSharding`` or ``PartitionSpec`` leaves. Defaults to the
      ``.sharding`` of each leaf of ``params``.
    replicated: what to use for state that is not shaped like the params.
      Defaults to ``NamedSharding(mesh, PartitionSpec())`` on the mesh of the
      parameter shardings, or ``PartitionSpec()`` for partition specs.

  Returns:
    A pytree with the structure of ``tx.init(params)`` whose leaves are
    shardings (or partition specs).

  Raises:
    ValueError: if ``param_shardings`` does not have the structure of
      ``params``, or a leaf of ``params`` has no sharding.
    TypeError: if ``replicated`` is not given and cannot be derived.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> from jax.sharding import PartitionSpec as P
    >>> tx = jaxmp.loss_scaling(optax.adam(1e-3), jaxmp.DynamicLossScale())
    >>> params = {"w": jnp.zeros((8, 4))}
    >>> specs = jaxmp.opt_state_shardings(tx, params, {"w": P("data", "fsdp")})
    >>> specs.inner_state[0].mu, specs.inner_state[0].count
    ({'w': P('data', 'fsdp')}, P())
    >>> specs.loss_scale.loss_scale, specs.skipped_steps
    (P(), P())
  """
  if param_shardings is None:
    missing = [
        jax.tree_util.keystr(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if getattr(leaf, "sharding", None) is None
    ]
    if missing:
      raise ValueError(
          "opt_state_shardings: these params have no sharding: "
          f"{', '.join(missing)}. Place them with jax.device_put(params, "
          "shardings) first, or pass param_shardings."
      )
    param_shardings = jax.tree_util.tree_map(lambda x: x.sharding, params)
  struct_params = jax.tree_util.tree_structure(params)
  struct_shardings = jax.tree_util.tree_structure(
      param_shardings, is_leaf=_is_spec_or_sharding
  )
  if struct_params != struct_shardings:
    raise ValueError(
        "opt_state_shardings: param_shardings must have the structure of "
        f"params, with one sharding or PartitionSpec per leaf.\n  params:    "
        f"{struct_params}\n  shardings: {struct_shardings}"
    )
  if replicated is None:
    leaves = jax.tree_util.tree_leaves(
        param_shardings, is_leaf=_is_spec_or_sharding
    )
    replicated = _replicated_like(leaves[0]) if leaves else PartitionSpec()
  abstract_state = jax.eval_shape(tx.init, params)
  return optax.tree_utils.tree_map_params(
      tx,
      lambda _, sharding: sharding,
      abstract_state,
      param_shardings,
      transform_non_params=lambda _: replicated,
  )
