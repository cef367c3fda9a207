"""Guarding state on a skipped step, and retrying a skipped batch.

Both read the one loss-scaling state (the state of :func:`jaxmp.loss_scaling`) of a state, wherever it
sits: whether the last update was applied (``last_finite``) decides what
:func:`keep_on_skip` keeps, and what :func:`retry_skipped` retries. The loss
scale's transitions stay in :func:`jaxmp.loss_scaling`'s update: a retry is the
user's own step, run again from the step's original state with only the loss
scale replaced by the one the skip backed off to.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxmp._src import jaxpr as jaxprs
from jaxmp._src.frameworks import holds_nnx_objects
from jaxmp._src.inplace_select import check_same_structure
from jaxmp._src.loss_scale import LossScale, NoOpLossScale, StaticLossScale
from jaxmp._src.loss_scaling import (
    _find_state, loss_scaling_states_with_path, plain_loss_scale)
from jaxmp._src.validation import check_number

# A run that needs more backoffs than this in one step has a broken scale.
MAX_RETRIES = 64


def keep_on_skip(opt_state: Any, new: Any, old: Any) -> Any:
  """``new`` where the last update was applied, ``old`` where it was skipped.

  The one way to guard state that the optimizer does not own (BatchNorm
  statistics, EMA params, FP8 meta, NNX variables): on a step that
  :func:`jaxmp.loss_scaling` skipped, ``old`` comes back bit-identical. The
  flag is the ``last_finite`` of the loss-scaling state in ``opt_state``,
  found wherever it sits (a chain, ``inject_hyperparams``, an
  ``nnx.Optimizer``, a :class:`jaxmp.flax.TrainState`); the choice is a
  ``jnp.where`` per leaf, with no host synchronisation. Call it after the
  optimizer's update. Leaves of ``new`` in another dtype are cast to
  ``old``'s, so that a jitted step does not retrace.

  Under gradient accumulation, ``new`` is kept where *this micro-batch's*
  gradients were finite: the ``skip_state["should_skip"]`` that
  :func:`jaxmp.multi_steps` records, as does ``optax.MultiSteps(...,
  should_skip_update_fn=optax.skip_not_finite)``. A plain ``optax.MultiSteps``
  records no such flag and is refused.

  Args:
    opt_state: the optimizer state after this step's update (or anything
      holding it).
    new: the values this step computed.
    old: the values before the step: the same structure and shapes.

  Returns:
    ``new`` or ``old``, leaf by leaf, in ``old``'s dtypes.

  Raises:
    ValueError: if ``opt_state`` holds no loss-scaling state (or more than
      one) or holds it inside an ``optax.MultiSteps`` without
      ``skip_not_finite``, ``new`` and ``old`` differ in structure or
      shapes, or ``old`` holds the very NNX variables ``new`` holds.

  For NNX, whose layers update their variables in place, take a copy of
  them before the step and write the kept ones back after the update:
  ``old = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat))``, then
  ``nnx.update(model, jaxmp.keep_on_skip(optimizer.opt_state,
  nnx.state(model, nnx.BatchStat), old))``.

  Example:
    >>> import jax.numpy as jnp, optax, jaxmp
    >>> tx = jaxmp.loss_scaling(optax.sgd(0.1), jaxmp.DynamicLossScale())
    >>> opt_state = tx.init(jnp.ones(2))
    >>> _, opt_state = tx.update(jnp.array([jnp.inf, 0.0]), opt_state)  # skipped
    >>> stats = {"mean": jnp.zeros(2)}
    >>> jaxmp.keep_on_skip(opt_state, {"mean": jnp.full(2, jnp.inf)}, stats)
    {'mean': Array([0., 0.], dtype=float32)}
  """
  applied = _applied(opt_state)
  _refuse_live_variables(new, old)
  check_same_structure(
      new, old, owner="jaxmp.keep_on_skip",
      names=("the new value", "the old value"),
      fix="A skipped step keeps the old value, so the new one must have its "
      "structure and shapes: pass the updated collection itself (e.g. "
      "updates['batch_stats'], not the dict that holds it).")

  def select(new_leaf, old_leaf):
    new_leaf, old_leaf = jnp.asarray(new_leaf), jnp.asarray(old_leaf)
    if new_leaf.dtype != old_leaf.dtype:  # (a typed PRNG key has no astype)
      new_leaf = new_leaf.astype(old_leaf.dtype)
    return jnp.where(applied, new_leaf, old_leaf)

  return jax.tree_util.tree_map(select, new, old)


def _applied(opt_state: Any) -> jax.Array:
  """Whether this step's values may be written: see keep_on_skip."""
  applied = jnp.asarray(_find_state(opt_state, "jaxmp.keep_on_skip").last_finite)
  [(path, _)] = loss_scaling_states_with_path(opt_state)
  for outer, state in optax.tree_utils.tree_get_all_with_path(
      opt_state, optax.MultiStepsState.__name__,
      filtering=lambda _, x: isinstance(x, optax.MultiStepsState)):
    if path[:len(outer)] != outer:  # not around the loss-scaling state
      continue
    skip = state.skip_state
    if not (isinstance(skip, dict) and "should_skip" in skip
            and set(skip) <= {"should_skip", "num_not_finite"}):
      raise ValueError(
          "jaxmp.keep_on_skip: the loss-scaling state sits inside "
          "optax.MultiSteps, whose state does not record whether this "
          f"micro-batch's gradients were finite (its skip_state is {skip!r}); "
          "the flag of the last completed step would write the values of a "
          "nan micro-batch. Use jaxmp.multi_steps(optax.adamw(1e-3), "
          "loss_scale, k), which records it, or optax.MultiSteps(..., "
          "should_skip_update_fn=optax.skip_not_finite).")
    applied = ~jnp.asarray(skip["should_skip"])  # this micro-batch's
  return applied


def _refuse_live_variables(new: Any, old: Any) -> None:
  """Refuses an ``old`` that holds the very variables ``new`` holds.

  ``nnx.state(model, ...)`` returns the model's own ``nnx.Variable`` objects,
  which the step updates in place: taken before the step and given as
  ``old``, it already holds the new values, and nothing would be kept.
  """
  def is_variable(x):
    return hasattr(x, "get_value") and hasattr(x, "set_value")

  new_variables = jax.tree_util.tree_leaves(new, is_leaf=is_variable)
  old_variables = jax.tree_util.tree_leaves(old, is_leaf=is_variable)
  if any(is_variable(a) and a is b for a, b in zip(new_variables, old_variables)):
    raise ValueError(
        "jaxmp.keep_on_skip: the old value holds the model's own NNX "
        "variables, which the step has updated in place, so it already holds "
        "the new values and nothing would be kept. Take a copy before the "
        "step: old = jax.tree.map(lambda x: x, nnx.state(model, nnx.BatchStat)).")


class RecoveryInfo(NamedTuple):
  """What a step built by :func:`jaxmp.retry_skipped` did.

  Attributes:
    loss_scale: the loss scale the applied attempt (or the last one, if the
      batch was lost) ran at.
    retries: int32, how many times the step ran again after a skip.
    fell_back: bool, whether the fallback step ran.
    finite: bool, whether an update was applied; false when the batch was
      lost.

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
  """A key path as ``a/b/0``, whatever kinds of keys name its steps."""
  names = []
  for key in path:
    for attribute in ("name", "key", "idx"):
      if hasattr(key, attribute):
        names.append(str(getattr(key, attribute)))
        break
    else:
      names.append(jax.tree_util.keystr((key,), simple=True))
  return "/".join(names)


class _Layout(NamedTuple):
  """Where the loss-scaling state's leaves sit among a state's flat leaves."""

  scale: tuple[int, ...]  # the loss scale's leaves
  finite: int  # last_finite
  recovered: int  # recovered_steps
  fallback: int  # fallback_steps
  retried: tuple[bool, ...]  # which leaves a retry takes from the attempt


def _layout(state_with_objects: Any, pure: Any) -> _Layout:
  """The layout of ``pure``'s leaves; the state is found in ``state_with_objects``.

  ``pure`` is ``state_with_objects`` itself, or the ``nnx.State`` of its NNX
  objects: their leaf paths name the same attributes.
  """
  [(path, found)] = loss_scaling_states_with_path(state_with_objects)
  prefix = _simple(path)
  leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
  names = [_simple(p) for p, _ in leaves]

  def under(field):
    start = f"{prefix}/{field}" if prefix else field
    return [i for i, n in enumerate(names) if n == start or n.startswith(start + "/")]

  # The loss scale's leaves in its own order (NNX sorts them by name).
  scale = []
  for field_path, _ in jax.tree_util.tree_flatten_with_path(
      plain_loss_scale(found))[0]:
    [index] = under("loss_scale/" + _simple(field_path))
    scale.append(index)
  scale = tuple(scale)
  # A retry runs from the step's original state, but for the loss scale and
  # the floating arrays (params, moments, statistics), which it takes from the
  # skipped attempt: a skip leaves those bit-identical, and so XLA carries
  # them through the retries in place. Counters, keys and scalars are the
  # original's, so they advance once per step.
  retried = tuple(
      i in scale or (_is_array(leaf) and np.size(leaf) > 1
                     and jnp.issubdtype(jnp.result_type(leaf), jnp.floating))
      for i, (_, leaf) in enumerate(leaves))
  [finite], [recovered], [fallback] = (
      under("last_finite"), under("recovered_steps"), under("fallback_steps"))
  return _Layout(scale, finite, recovered, fallback, retried)


def _check_retry_options(max_retries: Any, fallback: Any) -> int:
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
  return max_retries


def _refuse_accumulation(state: Any) -> None:
  [(path, _)] = loss_scaling_states_with_path(state)
  if any(getattr(key, "name", None) == "inner_opt_state" for key in path):
    raise ValueError(
        "jaxmp.retry_skipped: the loss-scaling state sits inside gradient "
        "accumulation (optax.MultiSteps or jaxmp.multi_steps). A skip there "
        "drops the gradients of every micro-batch of the accumulated step, "
        "and a retry could only recompute the last one. Retry a step without "
        "accumulation, or let the accumulated step be skipped (the scale "
        "backs off once and the next accumulation starts clean).")


def retry_skipped(
    step: Callable[..., tuple[Any, Any]],
    *,
    max_retries: int = 4,
    fallback: Callable[..., tuple[Any, Any]] | None = None,
) -> Callable[..., tuple[Any, Any, RecoveryInfo]]:
  """Runs a train step again, inside the same step, when it was skipped.

  ``step(state, *args, **kwargs) -> (state, aux)`` is your own train step,
  for any framework; ``state`` is any pytree that holds one
  loss-scaling state (the state of :func:`jaxmp.loss_scaling`) (``(params, opt_state)``, a
  :class:`jaxmp.flax.TrainState`), or NNX objects (a model and its
  ``nnx.Optimizer``), which the returned step splits and merges itself and
  updates in place.

  When the loss-scaling optimizer skipped the update because the gradients
  were not finite, the step runs again from the step's original state with
  only the loss scale replaced by the one the skip backed off to, up to
  ``max_retries`` times (not for static and no-op scales, which a skip does
  not change); then, if still skipped, ``fallback`` (a step of the same
  signature, e.g. the same step under a wider policy) runs once the same way.
  Only a batch still non-finite after that is lost, and leaves the state
  bit-identical to the plain step's skip: the scale backed off once, as the
  first attempt left it (``info.loss_scale`` is the last attempt's).

  * **A finite step is the plain step**, bit for bit: the step is the body of
    a ``lax.while_loop`` whose first iteration is the step itself, and that
    carries the floating arrays in place, so the compiled program reads,
    writes and holds what the plain step does.
  * **Counters advance once per step.** A retry takes the state's integer,
    key and scalar leaves (a ``TrainState``'s ``step``, an
    ``inject_hyperparams`` schedule's count, NNX RNG counts) from the
    original state; its floating arrays (params, optimizer moments, and the
    statistics you guard with :func:`jaxmp.keep_on_skip`) come from the
    skipped attempt, which leaves them bit-identical. Guard every array your
    step writes with :func:`jaxmp.keep_on_skip`, as without retries.
  * **The metrics** count a recovered batch in ``recovered_steps`` (and in
    ``fallback_steps`` when the fallback ran), and a lost one in
    ``lost_steps`` and ``skipped_steps``.

  Accumulation is refused: a skip inside ``optax.MultiSteps`` or
  :func:`jaxmp.multi_steps` drops every micro-batch of the accumulated step,
  and a retry could only recompute the last.

  Inside ``shard_map``, ``aux`` may vary over the devices (each one's loss).

  Args:
    step: the train step, ``step(state, *args, **kwargs) -> (state, aux)``;
      the state it returns has the structure and shapes of the one it takes.
    max_retries: how many times to run a skipped step again (0 goes straight
      to the fallback). Default 4: down to ``2**-4`` of the scale with the
      default backoff.
    fallback: None, or a step of ``step``'s signature to run once after the
      retries.

  Returns:
    ``recovering_step(state, *args, **kwargs)`` returning ``(state, aux,
    info)``, where ``info`` is a :class:`jaxmp.RecoveryInfo`.

  Raises:
    TypeError: if ``max_retries`` is not an integer, or ``fallback`` not
      callable; when called, if the step returns no ``(state, aux)``.
    ValueError: if ``max_retries`` is out of range; when called, if the
      state holds no loss-scaling state (or more than one), or holds it
      inside gradient accumulation, or the step returns a state of another
      structure.

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
    >>> step = jax.jit(jaxmp.retry_skipped(train_step))
    >>> w = jnp.ones(2)
    >>> (w, opt_state), loss, info = step((w, tx.init(w)))
    >>> int(info.retries), float(info.loss_scale.loss_scale), bool(info.finite)
    (2, 16384.0, True)
    >>> int(jaxmp.loss_scaling_metrics(opt_state)["recovered_steps"])
    1
  """
  if not callable(step):
    raise TypeError(
        f"jaxmp.retry_skipped expects your train step, step(state, *batch) "
        f"-> (state, aux); got {step!r}.")
  max_retries = _check_retry_options(max_retries, fallback)

  @functools.wraps(step)
  def recovering_step(state, *args, **kwargs):
    scaling = _find_state(state, "jaxmp.retry_skipped")
    _refuse_accumulation(state)
    retries_help = not isinstance(
        scaling.loss_scale, (StaticLossScale, NoOpLossScale))
    nnx_objects = holds_nnx_objects(state)
    if nnx_objects:
      # NNX objects cannot be carried by a loop: their arrays are.
      from jaxmp._src.flax import nnx as nnx_adapter  # pylint: disable=g-import-not-at-top

      pure, as_pure_step, write_back = nnx_adapter.split_for_loop(state)

      def as_step(fn):
        return as_pure_step(lambda objects: _state_and_aux(fn, objects, args, kwargs))
    else:
      pure = state

      def as_step(fn):
        return lambda pure_state: _state_and_aux(fn, pure_state, args, kwargs)

    layout = _layout(state, pure)
    leaves, treedef = jax.tree_util.tree_flatten(pure)
    # The loop carries the arrays; other leaves (an Equinox module's
    # functions) are static, the original's.
    dynamic = [_is_array(leaf) for leaf in leaves]
    position = {i: k for k, i in enumerate(
        i for i, d in enumerate(dynamic) if d)}
    retried = [r for r, d in zip(layout.retried, dynamic) if d]
    original = [leaf for leaf, d, r in zip(leaves, dynamic, layout.retried)
                if d and not r]

    def tree_of(arrays):
      it = iter(arrays)
      return jax.tree_util.tree_unflatten(
          treedef, [next(it) if d else leaf for leaf, d in zip(leaves, dynamic)])

    def arrays_of(tree):
      return [x for x, d in zip(jax.tree_util.tree_leaves(tree), dynamic) if d]

    def start_from(arrays):
      """The state a (re)try runs from: see _layout."""
      kept = iter(original)
      return [a if r else next(kept) for a, r in zip(arrays, retried)]

    def scale_of(arrays):
      return [jnp.asarray(arrays[position[i]]) for i in layout.scale]

    def applied(arrays):
      return jnp.asarray(arrays[position[layout.finite]])

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
    for i, plain_scale in zip(layout.scale, first):
      pure[position[i]] = jnp.where(finite, pure[position[i]], plain_scale)
    retries = attempts - 1 - fell_back.astype(jnp.int32)
    recovered, fallback_steps = position[layout.recovered], position[layout.fallback]
    pure[recovered] = pure[recovered] + (
        finite & ((retries > 0) | fell_back)).astype(jnp.int32)
    pure[fallback_steps] = pure[fallback_steps] + (
        finite & fell_back).astype(jnp.int32)
    pure = tree_of(pure)
    info = RecoveryInfo(
        loss_scale=jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(plain_loss_scale(scaling)), scale),
        retries=retries, fell_back=fell_back, finite=finite)
    if nnx_objects:
      return write_back(pure), aux, info
    return pure, aux, info

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
