"""The NNX adapters: what the one mechanism of each capability needs for NNX.

NNX objects are updated in place, so a function over them is run on a copy
merged from their split state, and what it updated is written back. The core
modules reach these adapters inside a function, when their arguments hold NNX
objects (``_src/frameworks.py``):

* :func:`with_fp8_meta` for :func:`jaxmp.scaled_value_and_grad`: the FP8 meta
  of an NNX model (:class:`jaxmp.flax.Fp8Meta`) is differentiated with the
  params, and written back;
* :func:`on_a_copy` for :func:`jaxmp.autocast`;
* :func:`split_for_loop` for :func:`jaxmp.retry_skipped`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxmp._src.flax.fp8 import (
    in_step_units, keep_meta_of_ops_that_did_not_run, skip_unless_meta_finite)
from jaxmp._src.flax.fp8 import Fp8Meta
from jaxmp._src.loss_scale import all_finite
from jaxmp._src.value_and_grad import scale_then_differentiate

_CALLER = "scaled_value_and_grad"


def with_fp8_meta(grad_fn: Callable[..., Any], fun: Callable[..., Any],
                  loss_scale: Any, argnums: Any, has_aux: bool
                  ) -> Callable[..., Any]:
  """``grad_fn``, or for arguments holding FP8 meta, the FP8 value-and-grad.

  The FP8 meta of the arguments (:class:`jaxmp.flax.Fp8Meta` variables) is
  differentiated too, as an extra leading argument: inside, it is put into
  the model in the step's units (:func:`in_step_units`), and its cotangents
  are its new values, back in unscaled units (Flax's "overwrite with
  gradient"). The param gradients are made nan where the new meta is not
  finite (the optimizer then skips the step), and the new meta is written
  into the model where it is finite. Guard it with :func:`jaxmp.keep_on_skip`
  after the optimizer's update, as any state the optimizer does not own, so
  that a skipped step leaves it bit-identical.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(argnums, int) or isinstance(argnums, nnx.DiffState):
    with_meta, single = (0, _shifted(argnums)), True
  else:
    with_meta, single = (0, *(_shifted(a) for a in argnums)), False

  def fun_with_meta(stored_meta, *args, **kwargs):
    nnx.update((args, kwargs), in_step_units(stored_meta, loss_scale.loss_scale))
    return fun(*args, **kwargs)

  meta_grad_fn = scale_then_differentiate(
      nnx.value_and_grad, fun_with_meta, loss_scale, argnums=with_meta,
      has_aux=has_aux, caller=_CALLER, state_hint="")

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


def _shifted(argnum: Any) -> Any:
  """``argnum`` (an int or an ``nnx.DiffState``) one position later."""
  from flax import nnx  # pylint: disable=g-import-not-at-top

  if isinstance(argnum, nnx.DiffState):
    return nnx.DiffState(argnum.argnum + 1, argnum.filter)
  return argnum + 1 if argnum >= 0 else argnum


def on_a_copy(fn: Callable[..., Any], evaluate: Callable[..., Any]) -> Callable[..., Any]:
  """``fn`` over NNX objects, run by ``evaluate`` on a copy, written back.

  ``evaluate(pure_fn)`` returns a function of ``pure_fn``'s arguments (for
  :func:`jaxmp.autocast`, one that traces and evaluates it again), where
  ``pure_fn(graphdef, state) -> (out, variables)`` merges a copy of the
  objects, runs ``fn`` and returns what it computed and the variables it
  left. The objects' in-place updates (BatchNorm statistics, RNG counts) are
  then written back to the caller's objects.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

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
  """NNX objects as arrays that a ``lax.while_loop`` can carry.

  Returns ``(state, as_pure_step, write_back)``: the ``nnx.State`` of
  ``objects``; ``as_pure_step(step)``, which turns ``step(objects) ->
  (objects, aux)`` into a function of that state, merging fresh objects for
  each call (a loop body owns its Variables); and ``write_back(state)``, which
  updates the caller's objects in place and returns them. Used by
  :func:`jaxmp.retry_skipped`.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

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
