"""``retry_skipped``: a train step run again, inside the same step, while its update was skipped."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.frameworks import holds_nnx_objects
from jaxmp._src.inplace_select import check_same_structure
from jaxmp._src.loss_scale import LossScale, NoOpLossScale, StaticLossScale
from jaxmp._src.loss_scaling import (
    _find_state, loss_scaling_states_with_path, plain_loss_scale)
from jaxmp._src.validation import check_number

# A run that needs more backoffs than this in one step has a broken scale.
MAX_RETRIES = 64


class RecoveryInfo(NamedTuple):
  """What a step built by :func:`jaxmp.retry_skipped` did.

  ``loss_scale`` is the scale the applied (or, for a lost batch, the last)
  attempt ran at; ``retries`` (int32) the runs after a skip; ``fell_back``
  and ``finite`` (bool) whether the fallback ran and an update was applied.

  Example:
    >>> import jax.numpy as jnp, jaxmp
    >>> info = jaxmp.RecoveryInfo(jaxmp.StaticLossScale(8.0), jnp.int32(0),
    ...                           jnp.bool_(False), jnp.bool_(True))
    >>> int(info.retries), bool(info.finite)
    (0, True)
  """

  loss_scale: LossScale
  retries: jax.Array
  fell_back: jax.Array
  finite: jax.Array


def _simple(path) -> str:
  """A key path as ``a/b/0``, whatever kinds of keys (optax's ``NamedTupleKey``) name it."""
  return "/".join(next((str(getattr(key, a)) for a in ("name", "key", "idx") if hasattr(key, a)),
                       jax.tree_util.keystr((key,), simple=True)) for key in path)


def retry_skipped(
    step: Callable[..., tuple[Any, Any]],
    *,
    max_retries: int = 4,
    fallback: Callable[..., tuple[Any, Any]] | None = None,
) -> Callable[..., tuple[Any, Any, RecoveryInfo]]:
  """Runs a train step again, inside the same step, while its update was skipped.

  ``step(state, *args, **kwargs) -> (state, aux)`` is your own step, in any
  framework, over a state holding one loss-scaling state (or NNX objects).
  A skipped step runs again from its original state at the backed-off scale,
  up to ``max_retries`` times (not for static and no-op scales), then
  ``fallback`` once; a batch still lost leaves the state as the plain skip
  does. The result returns ``(state, aux, info)``, ``info`` a
  :class:`jaxmp.RecoveryInfo`. Details: docs/loss-scaling.md.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(1e-6), jaxmp.DynamicLossScale(2.0**16))
    >>> loss_fn = lambda w: jnp.sum(w.astype(jnp.float16) * 3.0)  # fp16 grads
    >>> def train_step(state):
    ...   params, opt_state = state
    ...   loss, grads = jaxmp.scaled_value_and_grad(
    ...       loss_fn, jaxmp.get_loss_scale(opt_state))(params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   return (optax.apply_updates(params, updates), opt_state), loss
    >>> w = jnp.ones(2)
    >>> _, loss, info = jax.jit(jaxmp.retry_skipped(train_step))((w, tx.init(w)))
    >>> int(info.retries), float(info.loss_scale.loss_scale), bool(info.finite)
    (2, 16384.0, True)
  """
  if not callable(step):
    raise TypeError(
        f"jaxmp.retry_skipped expects your train step, step(state, *batch) "
        f"-> (state, aux); got {step!r}.")
  max_retries = check_number(
      "jaxmp.retry_skipped", "max_retries", max_retries, integer=True,
      minimum=0, maximum=MAX_RETRIES,
      advice="Pass how many times to run a skipped step again, e.g. 4; 0 "
      "goes straight to the fallback.")
  if fallback is not None and not callable(fallback):
    raise TypeError(
        f"jaxmp.retry_skipped(fallback={fallback!r}): the fallback must be a "
        "step with the same signature as the step, e.g. the same step under a "
        "wider policy (fallback=train_step_float32), or None.")

  @functools.wraps(step)
  def recovering_step(state, *args, **kwargs):
    scaling = _find_state(state, "jaxmp.retry_skipped")
    [(path, _)] = loss_scaling_states_with_path(state)
    if any(getattr(key, "name", None) == "inner_opt_state" for key in path):
      raise ValueError(
          "jaxmp.retry_skipped: the loss-scaling state sits inside gradient "
          "accumulation (optax.MultiSteps or jaxmp.multi_steps). A skip there "
          "drops the gradients of every micro-batch of the accumulated step, "
          "and a retry could only recompute the last one. Retry a step without "
          "accumulation, or let the accumulated step be skipped (the scale "
          "backs off once and the next accumulation starts clean).")
    retries_help = not isinstance(
        scaling.loss_scale, (StaticLossScale, NoOpLossScale))
    if holds_nnx_objects(state):  # NNX objects cannot be carried by a loop: their arrays are.
      from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

      pure, as_pure_step, write_back = nnx_adapter.split_for_loop(state)
    else:
      pure, as_pure_step, write_back = state, lambda step: step, lambda pure: pure
    as_step = lambda fn: as_pure_step(lambda s: _state_and_aux(fn, s, args, kwargs))

    # Where the loss-scaling state's leaves sit among the leaves of `pure` (the
    # state, or the nnx.State of its objects, whose paths name the same fields).
    leaves, treedef = jax.tree_util.tree_flatten(pure)
    names = [_simple(p) for p, _ in jax.tree_util.tree_flatten_with_path(pure)[0]]

    def under(field):
      start = f"{_simple(path)}/{field}" if path else field
      return [i for i, n in enumerate(names) if n == start or n.startswith(start + "/")]

    # The loss scale's leaves in its own order (NNX sorts them by name).
    scale_at = [under("loss_scale/" + _simple(p))[0] for p, _ in
                jax.tree_util.tree_flatten_with_path(plain_loss_scale(scaling))[0]]
    [finite_at], [recovered_at], [fallback_at] = (
        under("last_finite"), under("recovered_steps"), under("fallback_steps"))
    # A retry runs from the step's original state, but for the loss scale and
    # the floating arrays (params, moments, statistics), which it takes from
    # the skipped attempt: a skip leaves those bit-identical, and so XLA
    # carries them through the retries in place. Counters, keys and scalars
    # are the original's, so they advance once per step.
    retried_leaves = [
        i in scale_at or (_is_array(leaf) and np.size(leaf) > 1
                          and jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
        for i, leaf in enumerate(leaves)]
    # The loop carries the arrays; other leaves (an Equinox module's
    # functions) are static, the original's.
    dynamic = [_is_array(leaf) for leaf in leaves]
    position = {i: k for k, i in enumerate(
        i for i, d in enumerate(dynamic) if d)}
    retried = [r for r, d in zip(retried_leaves, dynamic) if d]
    original = [leaf for leaf, d, r in zip(leaves, dynamic, retried_leaves)
                if d and not r]

    def tree_of(arrays):
      it = iter(arrays)
      return jax.tree_util.tree_unflatten(
          treedef, [next(it) if d else leaf for leaf, d in zip(leaves, dynamic)])

    arrays_of = lambda tree: [x for x, d in zip(jax.tree_util.tree_leaves(tree), dynamic) if d]
    scale_of = lambda arrays: [jnp.asarray(arrays[position[i]]) for i in scale_at]
    applied = lambda arrays: jnp.asarray(arrays[position[finite_at]])

    def start_from(arrays):
      kept = iter(original)
      return [a if r else next(kept) for a, r in zip(arrays, retried)]

    def as_arrays_step(fn):
      def arrays_step(arrays):
        new, aux = fn(tree_of(arrays))
        check_same_structure(
            new, tree_of(arrays), owner="jaxmp.retry_skipped",
            names=("the state the step returned", "the state it took"),
            fix="The loop that runs a skipped step again carries the state "
            "it took: return a state of its structure and shapes (create "
            "every entry before the first step, e.g. in the initial state).")
        return arrays_of(new), aux
      return arrays_step

    attempt = as_arrays_step(as_step(step))
    fall_back = None if fallback is None else as_arrays_step(as_step(fallback))
    pure = arrays_of(pure)
    aux_shape = jax.eval_shape(attempt, pure)[1]
    # Attempt 0 is the step; 1 to `limit` are the retries; then the fallback.
    limit = max_retries if retries_help else 0
    last = limit + (fall_back is not None)

    def again(carry):
      pure_state, _, attempts, _, _, _ = carry
      return (attempts == 0) | (~applied(pure_state) & (attempts <= last))

    def run(carry):
      pure_state, _, attempts, _, _, first = carry
      start = start_from(pure_state)
      if fall_back is None:
        falls_back = jnp.zeros([], jnp.bool_)
        new, aux = attempt(start)
      else:
        falls_back = attempts > limit
        new, aux = jax.lax.cond(falls_back, fall_back, attempt, start)
      # The loss scale after the first attempt: the plain step's.
      first = [jnp.where(attempts == 0, a, b) for a, b in zip(scale_of(new), first)]
      return new, aux, attempts + 1, scale_of(start), falls_back, first

    carry = (pure, jax.tree_util.tree_map(_zeros, aux_shape),
             jnp.zeros([], jnp.int32), scale_of(pure), jnp.zeros([], jnp.bool_),
             scale_of(pure))
    pure, aux, attempts, scale, fell_back, first = jax.lax.while_loop(
        again, run, carry)
    finite = applied(pure)
    # A lost batch leaves the state as the plain step's skip does: the
    # retries' backoffs are undone.
    for i, plain_scale in zip(scale_at, first):
      pure[position[i]] = jnp.where(finite, pure[position[i]], plain_scale)
    retries = attempts - 1 - fell_back.astype(jnp.int32)
    recovered, fallback_steps = position[recovered_at], position[fallback_at]
    pure[recovered] = pure[recovered] + (
        finite & ((retries > 0) | fell_back)).astype(jnp.int32)
    pure[fallback_steps] = pure[fallback_steps] + (
        finite & fell_back).astype(jnp.int32)
    pure = tree_of(pure)
    info = RecoveryInfo(
        loss_scale=jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(plain_loss_scale(scaling)), scale),
        retries=retries, fell_back=fell_back, finite=finite)
    return write_back(pure), aux, info

  return recovering_step


def _state_and_aux(step: Callable[..., Any], state: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> tuple[Any, Any]:
  """``step(state, *args, **kwargs)``, refused unless it is ``(state, aux)``."""
  out = step(state, *args, **kwargs)
  alone = jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(state)
  if alone or not (isinstance(out, tuple) and len(out) == 2):
    raise TypeError(
        "jaxmp.retry_skipped: the step must return (state, aux); it returned "
        + ("the state alone" if alone else f"a {type(out).__name__}")
        + ". Return an aux too: return (params, opt_state), loss (or None).")
  return out


def _zeros(shape: jax.ShapeDtypeStruct) -> jax.Array:
  """Zeros of ``shape``, varying over the ``shard_map`` axes it varies over."""
  zeros = jnp.zeros(shape.shape, shape.dtype)
  axes = jaxprs.manual_axes(shape)
  return jax.lax.pcast(zeros, tuple(axes), to="varying") if axes else zeros


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))
