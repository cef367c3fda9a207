"""The NNX adapters the core modules reach inside a function when their arguments hold NNX objects:
a function over them runs on a copy merged from their split state, its updates written back."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmp._src.flax.fp8 import (
    in_step_units, keep_meta_of_ops_that_did_not_run, skip_unless_meta_finite)
from jaxmp._src.flax.fp8 import Fp8Meta
from jaxmp._src.loss_scale import all_finite


def with_fp8_meta(grad_fn: Callable[..., Any], fun: Callable[..., Any],
                  loss_scale: Any, argnums: Any, differentiate: Callable[..., Any]
                  ) -> Callable[..., Any]:
  """``grad_fn``, or where the arguments hold FP8 meta, that meta differentiated too.

  The meta is an extra leading argument, in the step's units; its cotangents
  are its new values. The gradients are nan where the new meta is not finite,
  and it is written back where it is. ``differentiate(value_and_grad, fun,
  argnums=...)`` is ``scale_then_differentiate`` with the loss scale bound.
  """
  # Each argnum (an int or an nnx.DiffState) one position later.
  shifted = lambda a: (nnx.DiffState(a.argnum + 1, a.filter) if isinstance(a, nnx.DiffState)
                       else a + 1 if a >= 0 else a)
  single = isinstance(argnums, (int, nnx.DiffState))
  with_meta = (0, *map(shifted, [argnums] if single else argnums))

  def fun_with_meta(stored_meta, *args, **kwargs):
    nnx.update((args, kwargs), in_step_units(stored_meta, loss_scale.loss_scale))
    return fun(*args, **kwargs)

  meta_grad_fn = differentiate(nnx.value_and_grad, fun_with_meta, argnums=with_meta)

  def value_and_grad_fn(*args, **kwargs):
    meta = nnx.state((args, kwargs), Fp8Meta)
    if not meta:
      return grad_fn(*args, **kwargs)
    stored_meta = nnx.as_pure(meta)
    out, (new_meta, *grads) = meta_grad_fn(stored_meta, *args, **kwargs)
    new_meta = keep_meta_of_ops_that_did_not_run(stored_meta, new_meta)
    grads = skip_unless_meta_finite(grads[0] if single else tuple(grads), new_meta)
    finite = all_finite(new_meta)
    nnx.update((args, kwargs), jax.tree_util.tree_map(
        lambda new, old: jnp.where(finite, new, old), new_meta, stored_meta))
    return out, grads

  return value_and_grad_fn


def on_a_copy(fn: Callable[..., Any], evaluate: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` over NNX objects, run by ``evaluate(pure_fn)`` on a copy, its updates
  written back; ``pure_fn(graphdef, state) -> (out, variables)`` (for autocast)."""
  def pure_fn(graphdef, state):
    args, kwargs = nnx.merge(graphdef, state, copy=True)
    out = fn(*args, **kwargs)
    return out, nnx.state((args, kwargs), nnx.Variable)

  evaluated = evaluate(pure_fn)

  @functools.wraps(fn)
  def on_objects(*args, **kwargs):
    if nnx.state((args, kwargs), Fp8Meta):
      raise ValueError(
          "jaxmp.autocast: the model has FP8 meta (jaxmp.flax.Fp8Meta). "
          "autocast casts each operation, and the FP8 ops keep per-tensor "
          "scales: leave autocast out; set_nnx_dtypes has set the layers' "
          "dtypes already.")
    graphdef, state = nnx.split((args, kwargs))
    out, variables = evaluated(graphdef, state)
    nnx.update((args, kwargs), variables)
    return out

  return on_objects


def split_for_loop(objects: Any) -> tuple[Any, Callable[..., Any], Callable[[Any], Any]]:
  """``(state, as_pure_step, write_back)``: NNX objects as arrays a loop carries; the
  pure step merges fresh objects for each call (for :func:`jaxmp.retry_skipped`)."""
  graphdef, state = nnx.split(objects)

  def as_pure_step(step):
    def pure_step(pure_state):
      out, aux = step(nnx.merge(graphdef, pure_state))
      return nnx.state(out), aux
    return pure_step

  def write_back(pure_state):
    nnx.update(objects, pure_state)
    return objects

  return state, as_pure_step, write_back
