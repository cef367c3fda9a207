"""Recognising a framework's objects without importing the framework."""

from __future__ import annotations

from typing import Any

import jax


def _is_nnx_object(x: Any) -> bool:
  return any(c.__module__.startswith("flax.nnx") for c in type(x).__mro__)


def holds_nnx_objects(tree: Any) -> bool:
  """Whether ``tree`` holds NNX objects (modules, optimizers, ``nnx.Rngs``).

  They are updated in place, so a function over them must be split and
  merged (``jaxmp._src.flax.nnx``) to be traced again or carried by a loop.
  """
  return any(_is_nnx_object(x) for x in jax.tree_util.tree_leaves(
      tree, is_leaf=_is_nnx_object))
