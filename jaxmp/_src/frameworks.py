"""Recognising a framework's objects without importing the framework."""

from __future__ import annotations

import functools
from collections.abc import Callable
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


def for_nnx_objects(fn: Callable[..., Any], plain: Callable[..., Any],
                    on_objects: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
  """``plain``, or where the arguments hold NNX objects, ``on_objects()``.

  ``on_objects`` builds the NNX variant (it imports Flax's adapters, so only
  on the first call that needs them); the result has ``fn``'s name and
  signature.
  """
  built = []

  @functools.wraps(fn)
  def call(*args, **kwargs):
    if not holds_nnx_objects((args, kwargs)):
      return plain(*args, **kwargs)
    if not built:
      built.append(on_objects())
    return built[0](*args, **kwargs)

  return call
