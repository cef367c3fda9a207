"""Recognising a framework's objects (NNX) without importing the framework."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def holds_nnx_objects(tree: Any) -> bool:
  """Whether ``tree`` holds NNX objects (modules, optimizers, ``nnx.Rngs``)."""
  is_nnx = lambda x: any(c.__module__.startswith("flax.nnx") for c in type(x).__mro__)
  return any(is_nnx(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_nnx))


def for_nnx_objects(fn: Callable[..., Any], plain: Callable[..., Any],
                    on_objects: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  """``plain``, or where the arguments hold NNX objects, ``on_objects()`` (built once)."""
  built = []

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if not holds_nnx_objects((args, kwargs)):
      return plain(*args, **kwargs)
    if not built:
      built.append(on_objects())
    return built[0](*args, **kwargs)

  return call
